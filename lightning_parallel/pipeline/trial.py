"""Settle the automatic partition by trial: time each candidate's stages as whole stages.

The partition's dynamic programme (:mod:`~lightning_parallel.pipeline.partition`) adds up
per-layer timings. Each of those is a small measurement (a ResNet-50 has 186 layers, most under
a millisecond on one core) taken while the other ranks profile beside it, and the sums carry the
noise of all of them: in one bench run the profile put ResNet-50's first stage at 32.7 ms a
micro-batch where the pipeline then measured 23.0. A cut chosen on such a projection can lose to
the plain even split. The trial measures what the projection only predicts:

1. the candidates are the partition's plan and the even split (and any split the caller adds),
   without repeats;
2. each rank runs the layers before its own stage of each candidate once without gradients
   to get that stage's real input; then, ``repeats`` rounds over the candidates in turn, all
   ranks start each candidate together (a barrier) and time forward + backward of their whole
   stage chained; each candidate keeps its fastest. Taking the candidates in turn rather than
   one after the other lets a burst of load from elsewhere on the machine slow one round of
   every candidate instead of every round of one;
3. the times are gathered (``all_gather_object``) and averaged per stage over the groups; a
   candidate's cost is the schedule's projected step
   (:func:`~lightning_parallel.pipeline.partition.projected_step`) of its measured stage times
   plus the link charge of its cuts (twice the cut bytes times the measured seconds per byte)
   and of the tied tensors its stages share
   (:func:`~lightning_parallel.pipeline.partition.tied_charge`);
   for a pipeline that never flushes (SpecTrain) the slowest charged stage, which paces its
   steady state: a flushing projection of one micro-batch is the sum of the stages, the same
   for every split, and left the choice to timing noise (the sleeping model of 2 layers ran
   its two layers on one stage, 0.91 s a step where the balanced split takes 0.61);
4. the candidate with the least cost wins (the partition's plan on a tie).

The forwards run as recomputations (:func:`~lightning_parallel.pipeline.recompute.recomputing`:
no deferred BatchNorm statistics are kept), buffers and gradients are put back afterwards, and
the random-number state is restored, so training starts as it would without the trial.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lightning_parallel.pipeline.partition import (
    link_charge,
    projected_step,
    split_edges,
    tied_charge,
    tied_exchanges,
)
from lightning_parallel.pipeline.profile import (
    backward_ones,
    call_layer,
    clock,
    received_input,
    timing_passes,
)

__all__: list[str] = []


def _run(layers: Sequence[nn.Module], start: int, end: int, inputs: Any) -> Any:
    value = inputs
    for index in range(start, end):
        value = call_layer(layers[index], value, index == 0)
    return value


def stage_input(layers: Sequence[nn.Module], example: tuple[Any, ...], start: int) -> Any:
    """What the layers before ``start`` give ``example``, computed without gradients."""
    if start == 0:
        return example
    with torch.no_grad():
        return _run(layers, 0, start, example)


def time_stage(layers: Sequence[nn.Module], received: Any, start: int, end: int) -> float:
    """Seconds of one chained forward + backward of ``layers[start:end]`` on ``received``."""
    inputs = received_input(received) if start > 0 else received
    began = clock()
    backward_ones(_run(layers, start, end, inputs))
    return clock() - began


def candidate_cost(
    seconds: Sequence[float],
    boundaries: Sequence[int],
    output_bytes: Sequence[int],
    micro_batches: int,
    link_seconds_per_byte: float,
    flushing: bool = True,
    tied: Sequence[tuple[int, Sequence[int]]] = (),
) -> float:
    """Projected step of a split from its measured stage times, each plus its cuts' link
    charge and its shared tied tensors' (``tied``: ``ModelProfile.tied``), as the partition
    charges them (:func:`~lightning_parallel.pipeline.partition.link_charge`,
    :func:`~lightning_parallel.pipeline.partition.tied_charge`); without ``flushing``, the
    slowest charged stage (see the module docstring)."""
    edges = split_edges(boundaries, len(output_bytes))
    exchanges = tied_exchanges(flushing, micro_batches)
    charged = [
        compute
        + link_charge(output_bytes, start, end, link_seconds_per_byte)
        + tied_charge(tied, start, end, link_seconds_per_byte, exchanges)
        for (start, end), compute in zip(edges, seconds)
    ]
    if not flushing:
        return max(charged)
    return projected_step(charged, micro_batches)[0]


def trial_stage_seconds(
    candidates: Sequence[Sequence[int]],
    layers: Sequence[nn.Module],
    example: tuple[Any, ...],
    *,
    stage: int,
    stages: int,
    repeats: int = 3,
    gather: Callable[[list[float]], list[tuple[int, list[float]]]] | None = None,
) -> list[list[float]]:
    """Every candidate's measured seconds per stage (``[candidate][stage]``).

    This rank times its own ``stage`` of every candidate, the candidates in turn ``repeats``
    times over; ``gather`` returns every rank's ``(stage, times)`` (default:
    ``all_gather_object`` over the world, after a barrier before each timing so that the ranks
    time together). A stage no rank timed raises ``ValueError``.
    """
    distributed = gather is None and dist.is_available() and dist.is_initialized()
    with timing_passes(layers) as parameters:
        edges = [split_edges(boundaries, len(layers))[stage] for boundaries in candidates]
        received = [stage_input(layers, example, start) for start, _ in edges]
        mine = [float("inf")] * len(candidates)
        for _ in range(repeats):
            for index, (start, end) in enumerate(edges):
                if distributed:
                    dist.barrier()
                mine[index] = min(mine[index], time_stage(layers, received[index], start, end))
                for parameter in parameters:
                    parameter.grad = None
    if gather is not None:
        reports = gather(mine)
    elif distributed:
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, (stage, mine))
        reports = gathered
    else:
        reports = [(stage, mine)]
    sums = [[0.0] * stages for _ in candidates]
    counts = [0] * stages
    for reported_stage, times in reports:
        counts[reported_stage] += 1
        for index, value in enumerate(times):
            sums[index][reported_stage] += value
    if not all(counts):
        raise ValueError(f"no rank timed stages {[k for k in range(stages) if not counts[k]]}")
    return [[total / counts[k] for k, total in enumerate(row)] for row in sums]


def choose_by_trial(
    candidates: Sequence[Sequence[int]],
    measured: Sequence[Sequence[float]],
    output_bytes: Sequence[int],
    micro_batches: int,
    link_seconds_per_byte: float,
    flushing: bool = True,
    tied: Sequence[tuple[int, Sequence[int]]] = (),
) -> int:
    """Index of the candidate with the least projected step (the first on a tie); see
    :func:`candidate_cost` for ``flushing`` and ``tied``."""
    costs = [
        candidate_cost(
            seconds,
            boundaries,
            output_bytes,
            micro_batches,
            link_seconds_per_byte,
            flushing,
            tied,
        )
        for boundaries, seconds in zip(candidates, measured)
    ]
    return min(range(len(costs)), key=costs.__getitem__)
