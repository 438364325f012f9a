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
    plan = partition(
        profile, stages, micro_batches, schedule=schedule, recompute=recompute, tolerance=0.0
    )
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
        tolerance=0.0,
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


def _largest_stage_parameters(profile: ModelProfile, boundaries: list[int]) -> int:
    edges = [0, *boundaries, len(profile)]
    return max(
        sum(c.parameter_bytes for c in profile.layers[edges[k] : edges[k + 1]])
        for k in range(len(edges) - 1)
    )


@pytest.mark.parametrize("seed", range(12))
def test_near_ties_go_to_the_split_with_the_smallest_largest_stage(seed: int) -> None:
    rng = random.Random(200 + seed)
    layers, stages = rng.randint(4, 10), rng.randint(2, 4)
    profile = synthetic(seed, layers)
    optimum = brute_force(profile, stages, 4, "1f1b", "never", None)
    assert optimum is not None
    plan = partition(profile, stages, 4, tolerance=0.1)
    assert plan.slowest_stage_seconds <= 1.1 * optimum + 1e-12
    near = [
        list(c)
        for c in itertools.combinations(range(1, layers), stages - 1)
        if plan_for(profile, list(c), 4).slowest_stage_seconds <= 1.1 * optimum + 1e-12
    ]
    assert _largest_stage_parameters(profile, list(plan.boundaries)) == min(
        _largest_stage_parameters(profile, c) for c in near
    )


def _noisy_layer(rng: random.Random, seconds: float, parameters: int) -> LayerCost:
    noisy = seconds * rng.uniform(0.96, 1.04)  # run-to-run timing spread of a few percent
    return LayerCost(noisy / 3, 2 * noisy / 3, 1000, 1000, parameters)


def test_timing_noise_between_equal_blocks_does_not_move_the_boundary() -> None:
    # eight linear + ReLU blocks between an input layer and a head of equal cost: cutting just
    # before or just after the middle ReLU differs by well under the few percent that timings
    # move from run to run; the boundary must not move with them
    chosen = set()
    for seed in range(20):
        rng = random.Random(seed)
        costs = [_noisy_layer(rng, 0.3, 16_000), _noisy_layer(rng, 0.01, 0)]
        for _ in range(8):
            costs += [_noisy_layer(rng, 1.0, 65_000), _noisy_layer(rng, 0.03, 0)]
        costs.append(_noisy_layer(rng, 0.3, 2_500))
        plan = partition(ModelProfile(tuple(costs), input_bytes=1000), 2, 4)
        chosen.add(plan.boundaries)
    assert len(chosen) == 1


def test_a_slow_link_moves_the_cut_to_where_fewer_bytes_cross() -> None:
    """Equal compute everywhere, but the first layers' outputs are large: compute alone cuts
    in the middle, a slow link moves the cut to the small activations (and so the plan's
    stage times add the bytes at each stage's cuts, both ways)."""
    sizes = [8_000_000, 8_000_000, 8_000_000, 1_000, 1_000, 1_000]
    layers = tuple(LayerCost(0.01, 0.02, 0, size, 100) for size in sizes)
    profile = ModelProfile(layers, input_bytes=1_000)
    assert partition(profile, 2, 8).boundaries == (3,)
    linked = partition(profile, 2, 8, link_seconds_per_byte=1e-8)
    assert linked.boundaries == (4,)
    assert linked.stage_seconds[0] == pytest.approx(4 * 0.03 + 2e-8 * 1_000)
    assert linked.stage_seconds[1] == pytest.approx(2 * 0.03 + 2e-8 * 1_000)


def test_a_split_that_separates_a_tied_tensor_pays_for_its_exchange() -> None:
    """Token ids into layer 0, an embedding at layer 1 tied to the head at layer 3 (a language
    model): compute alone cuts at 3, between the embedding and the head, where the stages then
    exchange the tied tensor. A pipeline that never flushes exchanges it twice an update: charged
    for that, the cut goes after the token ids (1), both uses on one stage. One that flushes
    exchanges it once a step (``1/m`` a micro-batch) and keeps the cut at 3."""
    layers = (
        LayerCost(0.001, 0.001, 0, 1_000, 0),
        LayerCost(0.5, 0.5, 0, 1_000, 4_000_000),
        LayerCost(0.25, 0.25, 0, 1_000, 4_000_000),
        LayerCost(0.75, 0.75, 0, 1_000, 4_000_000),
    )
    profile = ModelProfile(layers, input_bytes=1_000, tied=((4_000_000, (1, 3)),))
    link = 3e-7  # 1.2 s for the tensor's bytes, 0.3 ms for a cut's
    untied = ModelProfile(layers, input_bytes=1_000)
    assert partition(untied, 2, 1, link_seconds_per_byte=link).boundaries == (3,)
    assert partition(profile, 2, 1, link_seconds_per_byte=link, flushing=False).boundaries == (1,)
    assert partition(profile, 2, 1, link_seconds_per_byte=link).boundaries == (3,)
    # the charge on each stage holding some of the uses
    cut = 2 * link * 1_000
    plan = plan_for(profile, [3], 1, link_seconds_per_byte=link, flushing=False)
    assert plan.stage_seconds == pytest.approx((1.502 + cut + 2 * 1.2, 1.5 + cut + 2 * 1.2))
    plan = plan_for(profile, [3], 8, link_seconds_per_byte=link)
    assert plan.stage_seconds == pytest.approx((1.502 + cut + 1.2 / 8, 1.5 + cut + 1.2 / 8))
    # a stage holding every use, or none, pays nothing
    plan = plan_for(profile, [1], 1, link_seconds_per_byte=link, flushing=False)
    assert plan.stage_seconds == pytest.approx((0.002 + cut, 3.0 + cut))


def test_mean_profile_keeps_the_tied_tensors() -> None:
    from lightning_parallel.pipeline.profile import mean_profile

    a = ModelProfile(
        (LayerCost(1.0, 2.0, 10, 20, 30), LayerCost(3.0, 4.0, 1, 2, 3)), 7, ((3, (0, 1)),)
    )
    assert mean_profile([a, a]).tied == ((3, (0, 1)),)
