"""The partitioner: exact on synthetic costs (checked against brute force), memory-aware."""

from __future__ import annotations

import itertools
import random

import pytest

from lightning_parallel.pipeline.partition import (
    PartitionError,
    partition,
    plan_for,
    projected_step,
)
from lightning_parallel.pipeline.profile import LayerCost, ModelProfile


def synthetic(seed: int, layers: int) -> ModelProfile:
    rng = random.Random(seed)
    costs = tuple(
        LayerCost(
            forward_seconds=rng.uniform(0.1, 3.0),
            backward_seconds=rng.uniform(0.1, 6.0),
            activation_bytes=rng.randint(1, 50) * 1000,
            output_bytes=rng.randint(1, 20) * 1000,
            parameter_bytes=rng.randint(0, 80) * 1000,
        )
        for _ in range(layers)
    )
    return ModelProfile(costs, input_bytes=8000)


def brute_force(
    profile: ModelProfile,
    stages: int,
    micro_batches: int,
    schedule: str,
    recompute: str,
    limit: float | None,
) -> float | None:
    best = None
    for cuts in itertools.combinations(range(1, len(profile)), stages - 1):
        plan = plan_for(profile, list(cuts), micro_batches, schedule, recompute)
        if limit is not None and max(plan.stage_memory_bytes) > limit:
            continue
        if best is None or plan.slowest_stage_seconds < best:
            best = plan.slowest_stage_seconds
    return best


@pytest.mark.parametrize("seed", range(12))
def test_dynamic_programming_matches_brute_force(seed: int) -> None:
    rng = random.Random(100 + seed)
    layers, stages = rng.randint(4, 10), rng.randint(2, 4)
    micro_batches = rng.choice([1, 4, 8])
    schedule = rng.choice(["gpipe", "1f1b"])
    recompute = rng.choice(["never", "except_last", "always"])
    profile = synthetic(seed, layers)
    unlimited = brute_force(profile, stages, micro_batches, schedule, recompute, None)
    assert unlimited is not None
    plan = partition(profile, stages, micro_batches, schedule=schedule, recompute=recompute)
    assert plan.slowest_stage_seconds == pytest.approx(unlimited)
    # a cap that rules out some splits: the optimum among the rest, and it fits
    memories = sorted(
        max(plan_for(profile, list(c), micro_batches, schedule, recompute).stage_memory_bytes)
        for c in itertools.combinations(range(1, layers), stages - 1)
    )
    limit = memories[len(memories) // 2]
    capped = partition(
        profile,
        stages,
        micro_batches,
        schedule=schedule,
        recompute=recompute,
        memory_limit_bytes=limit,
    )
    assert max(capped.stage_memory_bytes) <= limit
    assert capped.slowest_stage_seconds == pytest.approx(
        brute_force(profile, stages, micro_batches, schedule, recompute, limit)
    )


def test_beats_the_greedy_split() -> None:
    # greedy "fill a stage up to the mean" puts 4+4 together and leaves 1+1+6 = 8 -> max 8;
    # the optimum is [4 | 4, 1, 1 | 6] -> max 6
    seconds = [4.0, 4.0, 1.0, 1.0, 6.0]
    profile = ModelProfile(tuple(LayerCost(s, 0.0, 0, 0, 0) for s in seconds), 0)
    plan = partition(profile, 3, 4)
    assert plan.boundaries == (1, 4)
    assert plan.slowest_stage_seconds == 6.0


def test_recomputation_trades_time_for_memory() -> None:
    profile = synthetic(7, 8)
    plain = plan_for(profile, [4], 8, "gpipe", "never")
    recomputed = plan_for(profile, [4], 8, "gpipe", "always")
    assert max(recomputed.stage_memory_bytes) < max(plain.stage_memory_bytes)
    forward = [
        sum(c.forward_seconds for c in profile.layers[:4]),
        sum(c.forward_seconds for c in profile.layers[4:]),
    ]
    for k in range(2):
        assert recomputed.stage_seconds[k] == pytest.approx(plain.stage_seconds[k] + forward[k])


def test_projection_formulas() -> None:
    step, bubble = projected_step([1.0, 1.0, 1.0], 4)
    assert step == pytest.approx(6.0) and bubble == pytest.approx(2 / 6)
    step, bubble = projected_step([1.0, 3.0], 4)  # the slow stage paces the steady state
    assert step == pytest.approx(4.0 + 3 * 3.0)
    assert bubble == pytest.approx(1 - 4 * 4.0 / (2 * 13.0))


def test_impossible_requests_name_the_fix() -> None:
    profile = synthetic(3, 4)
    with pytest.raises(PartitionError, match=r"use 1\.\.4 stages"):
        partition(profile, 5, 4)
    with pytest.raises(PartitionError, match="raise the memory limit"):
        partition(profile, 2, 4, memory_limit_bytes=1.0)


def test_mean_profile_averages_times_and_keeps_bytes() -> None:
    from lightning_parallel.pipeline.profile import mean_profile

    a = ModelProfile((LayerCost(1.0, 2.0, 10, 20, 30), LayerCost(3.0, 4.0, 1, 2, 3)), 7)
    b = ModelProfile((LayerCost(3.0, 4.0, 10, 20, 30), LayerCost(5.0, 8.0, 1, 2, 3)), 7)
    mean = mean_profile([a, b])
    assert [(c.forward_seconds, c.backward_seconds) for c in mean.layers] == [
        (2.0, 3.0),
        (4.0, 6.0),
    ]
    assert mean.layers[0].activation_bytes == 10 and mean.input_bytes == 7
    with pytest.raises(ValueError, match="different numbers of layers"):
        mean_profile([a, ModelProfile(a.layers[:1], 7)])
