"""The automatic partition settled by timing whole stages (pipeline.trial)."""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch
from helpers.distributed import run_distributed
from torch import nn

from lightning_parallel.pipeline.profile import LayerCost, ModelProfile
from lightning_parallel.pipeline.trial import choose_by_trial, trial_stage_seconds


def test_the_measured_step_decides_not_the_projection() -> None:
    """Candidate 0 (the projection's) measures 30 ms on its slowest stage, candidate 1 24 ms:
    1 wins. A slow link charged twice over each candidate's cut bytes turns it back."""
    candidates = [[2], [3]]
    measured = [[0.030, 0.020], [0.024, 0.022]]
    assert choose_by_trial(candidates, measured, [0, 10, 10, 10, 10], 8, 0.0) == 1
    # cut 3 (layer 2's output) sends 1 MB a micro-batch each way: 2 * 1e6 * 1e-8 = 20 ms more
    # on both stages
    assert choose_by_trial(candidates, measured, [0, 10, 10**6, 10, 10], 8, 1e-8) == 0
    assert choose_by_trial(candidates, [[0.03, 0.02], [0.03, 0.02]], [0] * 5, 8, 0.0) == 0


def test_a_pipeline_that_never_flushes_takes_the_balanced_split_at_one_micro_batch() -> None:
    """The 2-layer sleeping model: the balanced split (0.45 s + 0.45 s) against both layers on
    stage 0 (0.9 s + a head of 1 ms). A flushing step of one micro-batch is their sum either
    way, and 2 ms of noise decided; SpecTrain's steady state is paced by the slowest stage."""
    candidates = [[1], [2]]
    measured = [[0.452, 0.451], [0.9, 0.001]]
    outputs = [0, 10, 10]
    assert choose_by_trial(candidates, measured, outputs, 1, 0.0) == 1  # 0.901 < 0.903
    assert choose_by_trial(candidates, measured, outputs, 1, 0.0, flushing=False) == 0
    # with micro-batches a flushing pipeline weighs balance too
    assert choose_by_trial(candidates, measured, outputs, 8, 0.0) == 0


def test_a_trial_leaves_weights_buffers_gradients_and_random_state_as_they_were() -> None:
    torch.manual_seed(0)
    layers = [nn.Linear(8, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Dropout(0.5), nn.Linear(8, 2)]
    layers[0].weight.grad = torch.ones_like(layers[0].weight)
    state = {k: v.clone() for k, v in nn.ModuleList(layers).state_dict().items()}
    example = (torch.randn(4, 8),)
    rng = torch.get_rng_state()
    reports: list[list[float]] = []

    def gather(mine: list[float]) -> list[tuple[int, list[float]]]:
        reports.append(mine)
        return [(0, mine), (1, [2 * t for t in mine])]

    measured = trial_stage_seconds([[2], [4]], layers, example, stage=0, stages=2, gather=gather)
    assert len(reports) == 1 and len(reports[0]) == 2 and all(t > 0 for t in reports[0])
    assert measured == [[reports[0][0], 2 * reports[0][0]], [reports[0][1], 2 * reports[0][1]]]
    for key, value in nn.ModuleList(layers).state_dict().items():
        torch.testing.assert_close(value, state[key], msg=key)  # BatchNorm's running stats too
    torch.testing.assert_close(layers[0].weight.grad, torch.ones_like(layers[0].weight))
    assert layers[4].weight.grad is None
    assert torch.equal(torch.get_rng_state(), rng)


class _Wait(nn.Module):
    """A layer that takes ``seconds`` of wall-clock time (a sleep: the load that other tests
    put on a shared machine stretches it by a wake-up at most, not by a time slice per
    millisecond of work as it does a matrix product)."""

    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.seconds = seconds

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(self.seconds)
        return x


def _settle(rank: int, world_size: int) -> dict[str, Any]:
    """Real costs: 20 ms at layers 1 and 4, little elsewhere, so the even split (cut 3)
    balances. The profile is replaced by one that calls layer 5 the only heavy one: the
    projection cuts at 5 (both waits on stage 0, twice the even split's slowest stage); the
    trial must find the even split."""
    import lightning_parallel.pipeline.assembly as assembly
    from lightning_parallel.comm.ledger import process_ledger
    from lightning_parallel.pipeline.partition import partition
    from lightning_parallel.pipeline.topology import PipelineTopology

    torch.set_num_threads(1)
    torch.manual_seed(0)
    width = 32
    layers = [nn.Linear(width, width), _Wait(0.02), nn.ReLU()]
    layers += [nn.Linear(width, width), _Wait(0.02), nn.ReLU()]
    wrong = ModelProfile(
        tuple(LayerCost(0.001, 0.001 if k < 5 else 0.01, 0, 0, 0) for k in range(6)), 0
    )
    assembly.profile_layers = lambda *args, **kwargs: wrong  # type: ignore[assignment]
    boundaries, plan = assembly.choose_boundaries(
        layers,
        (torch.randn(16, width),),
        how="auto",
        stages=2,
        micro_batches=8,
        profile_repeats=3,
        memory_limit_bytes=None,
        schedule="1f1b",
        recompute="never",
        topology=PipelineTopology(world_size, 2),
        rank=rank,
        world_size=world_size,
        device=lambda: torch.device("cpu"),
    )
    return {
        "projection": list(partition(wrong, 2, 8).boundaries),
        "boundaries": boundaries,
        "plan": list(plan.boundaries) if plan else None,
        "chose_even": process_ledger().gauges.get("partition_trial_chose_even"),
    }


@pytest.mark.slow
def test_the_trial_overrules_a_wrong_profile_on_every_rank() -> None:
    results = run_distributed(_settle, 2, start_method="fork")
    for result in results:
        assert result["projection"] == [5]
        assert result["boundaries"] == result["plan"] == [3]
        assert result["chose_even"] == 1.0


def test_the_trial_charges_a_tied_tensor_its_split_separates() -> None:
    """Transformers' GPT-2 at 100 Mbit/s: the balanced split measured faster, but it put the
    embedding and the head (tied, 4 MB) on different stages, which SpecTrain then exchanged
    twice an update; the cut after the token ids keeps them on one stage and wins."""
    candidates = [[1], [3]]
    measured = [[0.001, 0.40], [0.15, 0.16]]
    outputs = [1_000, 10**6, 10**6, 10**6, 10**6]
    tied = ((4_000_000, (1, 4)),)
    link = 8e-8
    assert choose_by_trial(candidates, measured, outputs, 1, link, flushing=False) == 1
    assert choose_by_trial(candidates, measured, outputs, 1, link, False, tied) == 0
