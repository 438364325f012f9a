"""Split a layer sequence into balanced stages: exact dynamic programming under a memory cap.

GroPipe partitions the model by a performance projection: per-layer costs measured on a sample
batch (:mod:`~lightning_parallel.pipeline.profile`) predict each stage's time per micro-batch,
and the split that minimizes the slowest stage wins, because a synchronous pipeline runs at the
pace of its slowest stage. A greedy split (fill a stage until it exceeds the average) can miss
the optimum; dynamic programming cannot:

1. stage ``k`` holding layers ``i .. j-1`` takes ``t_k = Σ (f_l + b_l) + r·Σ f_l + 2s·B_k`` per
   micro-batch, ``r`` being the recomputed share of micro-batches, ``B_k`` the bytes at its
   cuts (its input and its output), each crossing twice (the activation forward, its gradient
   back), and ``s`` the measured seconds per byte of the links between stages (0 when not
   measured). Both stages a cut joins pay for it: the sender copies and sends, the receiver
   waits and copies, and under 1F1B a micro-batch's round trip over the cut lies on the
   critical path. Charged to the sender alone (``s·B_k`` of the bytes it sends), the model
   chose a ResNet-50 cut that balanced compute (19.6 and 21.0 ms a micro-batch) but moved
   0.66 MB each way, 0.77x the samples/s of a cut with 24.4 and 16.2 ms and 0.26 MB. A
   stage that holds some but not all uses of a tied tensor (``ModelProfile.tied``: a
   language model's embedding and head) also pays ``e·T·s`` for its ``T`` bytes
   (:func:`tied_charge`): the holders exchange it ``e = 1/m`` times a micro-batch when the
   pipeline flushes (one sum of its gradient a step) and ``e = 2`` when it never does (the sum
   and the owner's value at every update). Without it the partitioner split transformers'
   GPT-2 (4 layers, width 256) between its embedding and its head at 100 Mbit/s, and
   SpecTrain stepped in 0.90 s where the cut after the token ids steps in 0.31 (both
   measured, 30 steps);
2. its memory is ``c·Σ P_l`` for parameters (``c`` counts weights, gradients and optimizer
   state) plus activations: ``n_k·A`` without recomputation, ``n_k·In + A`` with it
   (``except_last``: ``(n_k−1)·In + 2A`` while ``n_k ≥ 2``), where ``A = Σ A_l``, ``In`` is the
   stage's input, and ``n_k`` the micro-batches in flight: ``m`` for GPipe, ``min(m, p−k)``
   for 1F1B;
3. ``T[k][j] = min over i of max(T[k−1][i], t(k, i, j))`` over splits whose stages all fit the
   memory cap; ``T[p−1][n]`` is the optimum, found in ``O(p·n²)``;
4. near-ties are settled by parameters, not by timing noise: among the splits whose every stage
   takes at most ``(1 + tolerance)·T*``, the same recursion picks the one whose largest stage
   holds the fewest parameter bytes. Cuts of nearly equal cost (either side of an activation
   in a stack of identical blocks) would otherwise swap places with timing noise from run to
   run, and the training arithmetic with them. Noise larger than the tolerance still moves
   the split: pass explicit boundaries where runs must repeat exactly.

The projection of a flushing schedule with per-micro-batch stage times ``t_k``:
step time ``S = Σ_k t_k + (m−1)·max_k t_k`` (fill, then the slowest stage paces the rest),
and bubble ``1 − m·Σ_k t_k / (p·S)``, which is ``(p−1)/(m+p−1)`` for equal stages.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from lightning_parallel.pipeline.profile import LayerCost, ModelProfile
from lightning_parallel.pipeline.recompute import check_recompute_mode, recompute_fraction

__all__: list[str] = []


class PartitionError(ValueError):
    """No split satisfies the constraints; the message says which limit to change."""


@dataclass(frozen=True)
class PartitionPlan:
    """A split into stages with its projected costs."""

    boundaries: tuple[int, ...]
    stage_seconds: tuple[float, ...]
    stage_memory_bytes: tuple[float, ...]
    micro_batches: int
    step_seconds: float
    bubble_fraction: float

    @property
    def stages(self) -> int:
        return len(self.stage_seconds)

    @property
    def slowest_stage_seconds(self) -> float:
        return max(self.stage_seconds)

    def describe(self) -> str:
        """A small table of the plan, one line per stage."""
        edges = [0, *self.boundaries]
        lines = [f"{'stage':>5} {'first layer':>11} {'ms/micro-batch':>14} {'memory MB':>10}"]
        for k, (seconds, memory) in enumerate(zip(self.stage_seconds, self.stage_memory_bytes)):
            lines.append(f"{k:>5} {edges[k]:>11} {seconds * 1e3:>14.3f} {memory / 2**20:>10.2f}")
        lines.append(
            f"projected step {self.step_seconds * 1e3:.2f} ms, bubble {self.bubble_fraction:.3f}"
        )
        return "\n".join(lines)


def projected_step(stage_seconds: Sequence[float], micro_batches: int) -> tuple[float, float]:
    """Projected step time and bubble fraction of a flushing schedule (see module docstring)."""
    stages = len(stage_seconds)
    step = sum(stage_seconds) + (micro_batches - 1) * max(stage_seconds)
    if step <= 0:
        return 0.0, (stages - 1) / (micro_batches + stages - 1)
    bubble = 1.0 - micro_batches * sum(stage_seconds) / (stages * step)
    return step, bubble


def in_flight(schedule: str, stage: int, stages: int, micro_batches: int) -> int:
    """Micro-batches whose activations stage ``stage`` holds at its peak under ``schedule``."""
    if schedule == "gpipe":
        return micro_batches
    if schedule == "1f1b":
        return min(micro_batches, stages - stage)
    raise ValueError(f"schedule must be 'gpipe' or '1f1b', got {schedule!r}")


class _CostModel:
    """Prefix sums over layer costs: stage time and memory in O(1)."""

    def __init__(
        self,
        profile: ModelProfile,
        stages: int,
        micro_batches: int,
        schedule: str,
        recompute: str,
        parameter_factor: float,
        link_seconds_per_byte: float = 0.0,
        flushing: bool = True,
    ) -> None:
        layers: Sequence[LayerCost] = profile.layers
        self.link = link_seconds_per_byte
        self.tied_exchanges = tied_exchanges(flushing, micro_batches)
        self.profile, self.stages, self.micro_batches = profile, stages, micro_batches
        self.schedule, self.recompute = schedule, recompute
        self.parameter_factor = parameter_factor
        self.share = recompute_fraction(recompute, micro_batches)
        self.time = _prefix([c.seconds + self.share * c.forward_seconds for c in layers])
        self.activations = _prefix([float(c.activation_bytes) for c in layers])
        self.parameters = _prefix([float(c.parameter_bytes) for c in layers])
        self.output_bytes = [c.output_bytes for c in layers]

    def seconds(self, stage: int, start: int, end: int) -> float:
        compute = self.time[end] - self.time[start]
        if not self.link:
            return compute
        return (
            compute
            + link_charge(self.output_bytes, start, end, self.link)
            + tied_charge(self.profile.tied, start, end, self.link, self.tied_exchanges)
        )

    def parameter_bytes(self, stage: int, start: int, end: int) -> float:
        return self.parameters[end] - self.parameters[start]

    def memory(self, stage: int, start: int, end: int) -> float:
        layers = self.profile.layers
        held = in_flight(self.schedule, stage, self.stages, self.micro_batches)
        activations = self.activations[end] - self.activations[start]
        stage_input = float(
            self.profile.input_bytes if start == 0 else layers[start - 1].output_bytes
        )
        if self.recompute == "never":
            activation_memory = held * activations
        elif self.recompute == "always" or held < 2:
            activation_memory = held * stage_input + activations
        else:  # except_last: the last micro-batch keeps its activations while another recomputes
            activation_memory = (held - 1) * stage_input + 2 * activations
        return (
            self.parameter_factor * (self.parameters[end] - self.parameters[start])
            + activation_memory
        )


def link_charge(output_bytes: Sequence[int], start: int, end: int, link: float) -> float:
    """Seconds per micro-batch that a stage holding layers ``start .. end-1`` is charged for
    its cuts: their bytes (its input from the previous stage, its output to the next; layer
    ``l`` outputs ``output_bytes[l]``) cross twice, activations forward and gradients back, at
    ``link`` seconds per byte."""
    cut = (output_bytes[start - 1] if start > 0 else 0) + (
        output_bytes[end - 1] if end < len(output_bytes) else 0
    )
    return 2 * link * cut


def tied_exchanges(flushing: bool, micro_batches: int) -> float:
    """Times a micro-batch that the stages holding a tied tensor exchange its bytes: once a
    step (its gradient summed, ``1/m``) in a flushing pipeline, twice an update (the sum, then
    the owner's value) in one that never flushes."""
    return 1.0 / max(1, micro_batches) if flushing else 2.0


def tied_charge(
    tied: Sequence[tuple[int, Sequence[int]]], start: int, end: int, link: float, exchanges: float
) -> float:
    """Seconds per micro-batch that a stage holding layers ``start .. end-1`` is charged for
    the tied tensors it shares with other stages (a use inside, a use outside):
    ``exchanges`` times their bytes at ``link`` seconds per byte."""
    shared = sum(
        nbytes
        for nbytes, where in tied
        if any(start <= i < end for i in where) and not all(start <= i < end for i in where)
    )
    return exchanges * link * shared


def split_edges(boundaries: Sequence[int], layer_count: int) -> list[tuple[int, int]]:
    """``(start, end)`` of every stage of a split."""
    edges = [0, *boundaries, layer_count]
    return [(edges[k], edges[k + 1]) for k in range(len(edges) - 1)]


def _prefix(values: Sequence[float]) -> list[float]:
    sums = [0.0]
    for value in values:
        sums.append(sums[-1] + value)
    return sums


def _minimax(
    layer_count: int,
    stages: int,
    cost: Callable[[int, int, int], float],
    feasible: Callable[[int, int, int], bool],
    allowed: set[int],
) -> tuple[float, list[int]] | None:
    """Boundaries minimizing ``max_k cost(k, i_k, j_k)`` over feasible splits, by DP."""
    best: list[list[float]] = [[math.inf] * (layer_count + 1) for _ in range(stages)]
    choice: list[list[int]] = [[-1] * (layer_count + 1) for _ in range(stages)]
    for end in range(1, layer_count + 1):
        if (end == layer_count or end in allowed) and feasible(0, 0, end):
            best[0][end] = cost(0, 0, end)
    for stage in range(1, stages):
        for end in range(stage + 1, layer_count + 1):
            if end != layer_count and end not in allowed:
                continue
            for start in range(stage, end):
                if start not in allowed or best[stage - 1][start] == math.inf:
                    continue
                if not feasible(stage, start, end):
                    continue
                value = max(best[stage - 1][start], cost(stage, start, end))
                if value < best[stage][end]:
                    best[stage][end], choice[stage][end] = value, start
    if best[stages - 1][layer_count] == math.inf:
        return None
    boundaries, end = [], layer_count
    for stage in range(stages - 1, 0, -1):
        end = choice[stage][end]
        boundaries.append(end)
    return best[stages - 1][layer_count], sorted(boundaries)


def plan_for(
    profile: ModelProfile,
    boundaries: Sequence[int],
    micro_batches: int,
    schedule: str = "1f1b",
    recompute: str = "never",
    parameter_factor: float = 3.0,
    link_seconds_per_byte: float = 0.0,
    flushing: bool = True,
) -> PartitionPlan:
    """The projected costs of a given split (an explicit one, or a peer's)."""
    stages = len(boundaries) + 1
    model = _CostModel(
        profile, stages, micro_batches, schedule, recompute, parameter_factor,
        link_seconds_per_byte, flushing,
    )  # fmt: skip
    edges = split_edges(boundaries, len(profile))
    seconds = tuple(model.seconds(k, *edge) for k, edge in enumerate(edges))
    memory = tuple(model.memory(k, *edge) for k, edge in enumerate(edges))
    step, bubble = projected_step(seconds, micro_batches)
    return PartitionPlan(tuple(boundaries), seconds, memory, micro_batches, step, bubble)


def partition(
    profile: ModelProfile,
    stages: int,
    micro_batches: int,
    schedule: str = "1f1b",
    recompute: str = "never",
    memory_limit_bytes: float | None = None,
    parameter_factor: float = 3.0,
    allowed_boundaries: Sequence[int] | None = None,
    tolerance: float = 0.05,
    link_seconds_per_byte: float = 0.0,
    flushing: bool = True,
) -> PartitionPlan:
    """The split of ``profile``'s layers into ``stages`` stages with the fastest slowest stage.

    Args:
        profile: per-layer costs (:func:`~lightning_parallel.pipeline.profile.profile_layers`).
        stages: number of stages ``p``.
        micro_batches: micro-batches per step ``m``.
        schedule: ``"gpipe"`` or ``"1f1b"`` (decides the micro-batches in flight).
        recompute: ``"never"``, ``"except_last"`` or ``"always"``.
        memory_limit_bytes: most memory a stage may use; ``None`` for no limit.
        parameter_factor: bytes held per parameter byte (weights + gradients + optimizer
            state: 3 for SGD with momentum, 4 for Adam).
        allowed_boundaries: cut positions to choose from (default: all).
        tolerance: splits whose slowest stage is within this fraction of the fastest count as
            ties; the tie whose largest stage holds the fewest parameter bytes wins (0: the
            fastest projection alone decides).
        link_seconds_per_byte: seconds per byte on the links between stages
            (:func:`~lightning_parallel.pipeline.link.measure_link_seconds_per_byte`); each
            stage's time per micro-batch then adds twice the bytes at its cuts (activations
            forward, gradients back) times this, and a stage sharing a tied tensor
            :func:`tied_charge`. 0: compute alone.
        flushing: whether the pipeline flushes every step (GroPipe) or never (SpecTrain):
            how often tied tensors are exchanged (:func:`tied_exchanges`).

    Raises:
        PartitionError: more stages than layers, or no split fits ``memory_limit_bytes`` (the
            message gives the least memory any split needs).
    """
    check_recompute_mode(recompute)
    if tolerance < 0:
        raise ValueError(f"tolerance must be >= 0, got {tolerance}")
    layer_count = len(profile)
    if stages < 1 or stages > layer_count:
        raise PartitionError(
            f"cannot split {layer_count} layers into {stages} stages; use 1..{layer_count} stages"
        )
    allowed = set(range(1, layer_count)) if allowed_boundaries is None else set(allowed_boundaries)
    model = _CostModel(
        profile, stages, micro_batches, schedule, recompute, parameter_factor,
        link_seconds_per_byte, flushing,
    )  # fmt: skip

    def fits(stage: int, start: int, end: int) -> bool:
        return memory_limit_bytes is None or model.memory(stage, start, end) <= memory_limit_bytes

    found = _minimax(layer_count, stages, model.seconds, fits, allowed)
    if found is None:
        least = _minimax(layer_count, stages, model.memory, lambda *_: True, allowed)
        need = f"{least[0] / 2**20:.1f} MiB" if least else "an unknown amount"
        raise PartitionError(
            f"no split of {layer_count} layers into {stages} stages fits {memory_limit_bytes} "
            f"bytes per stage (the best split needs {need}); raise the memory limit, use "
            "recompute='always', more stages, fewer micro-batches or schedule='1f1b'"
        )
    boundaries = found[1]
    if tolerance > 0:
        bound = found[0] * (1.0 + tolerance)

        def near(stage: int, start: int, end: int) -> bool:
            return fits(stage, start, end) and model.seconds(stage, start, end) <= bound

        balanced = _minimax(layer_count, stages, model.parameter_bytes, near, allowed)
        if balanced is not None:  # the fastest split itself is always a candidate
            boundaries = balanced[1]
    return plan_for(
        profile, boundaries, micro_batches, schedule, recompute, parameter_factor,
        link_seconds_per_byte, flushing,
    )  # fmt: skip
