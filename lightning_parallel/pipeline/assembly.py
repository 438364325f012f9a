"""A rank's part of the pipeline: boundaries chosen, its stage taken, its runtime built.

What a pipeline strategy does once the first batch shows the model's input, without Lightning
(:func:`check_arguments` checks the strategy's arguments first, at construction):

1. :func:`check_forward_is_layers`: the model's ``forward`` must be exactly its layer chain
   (the pipeline splits the chain, so anything else ``forward`` does would be lost);
2. :func:`choose_boundaries`: given boundaries, an even split, or a partition
   (:mod:`~lightning_parallel.pipeline.partition`) of per-layer costs: estimated from shapes
   (``"estimate"``, or a model built on ``meta``: the same on every rank and run), or timed on
   every rank at once (``"auto"``: the timings see what training will see, the other ranks
   computing beside it) and averaged over ranks, with the measured cost of a byte on the link
   between stages, so that every rank partitions the same way; for ``"auto"`` the plan and
   the even split are then timed as whole stages (:mod:`~lightning_parallel.pipeline.trial`)
   and the faster kept;
3. :func:`assemble`: the rank *takes ownership* of its stage
   (:mod:`~lightning_parallel.pipeline.ownership`: the other stages' tensors go to ``meta``, a
   stage built on ``meta`` is materialized and broadcast to its data-parallel replicas), and
   builds the stage's transport to its neighbours, its
   :class:`~lightning_parallel.pipeline.runtime.StageRuntime` and the end-of-step
   :class:`~lightning_parallel.pipeline.summary.StepSummary` of its pipeline group;
4. :class:`Pipeline`: what the rank holds then (every stage's module, its owned tensors and
   their names, the runtime and the summary).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_parallel.comm.devices import broadcast_
from lightning_parallel.comm.ledger import process_ledger
from lightning_parallel.pipeline.grad_sync import PartitionGradientSync
from lightning_parallel.pipeline.link import measure_link_seconds_per_byte
from lightning_parallel.pipeline.ownership import (
    Ownership,
    TiedAcrossStagesError,
    stage_tensors,
    stage_tensors_owned,
    take_ownership,
)
from lightning_parallel.pipeline.partition import (
    PartitionError,
    PartitionPlan,
    partition,
    plan_for,
)
from lightning_parallel.pipeline.profile import (
    ModelProfile,
    estimate_layers,
    mean_profile,
    profile_layers,
    tensors_of,
)
from lightning_parallel.pipeline.runtime import StageRuntime
from lightning_parallel.pipeline.stages import (
    PipelineSplitError,
    StageModule,
    check_boundaries,
    even_boundaries,
    is_deferred,
)
from lightning_parallel.pipeline.summary import StepSummary
from lightning_parallel.pipeline.tied import TiedWeights, tied_stages
from lightning_parallel.pipeline.topology import PLACEMENTS, PipelineTopology, ProcessGroups
from lightning_parallel.pipeline.transport import StageTransport
from lightning_parallel.pipeline.trial import choose_by_trial, trial_stage_seconds

__all__: list[str] = []


@dataclass
class Pipeline:
    """This rank's part of the pipeline, built once the first batch shows the model's input.

    Attributes:
        stages: every stage's module (only this rank's holds real tensors).
        boundaries: index of the first layer of stages 1..p-1.
        owned: this rank's parameters and buffers (its stage's; the last stage also owns the
            module's tensors outside the split body).
        owned_names: the model's name of each owned tensor.
        runtime: the flush engine (training for GroPipe, evaluation for every strategy).
        summary: the end-of-step exchange inside the pipeline group.
        plan: the partition plan (``None`` for given or even boundaries).
        released_bytes: bytes of the other stages' tensors this rank let go.
        tied: the tensors this stage shares with other stages (kept equal; empty if none).
    """

    stages: list[StageModule]
    boundaries: list[int]
    owned: list[Tensor]
    owned_names: list[str]
    runtime: StageRuntime
    summary: StepSummary
    plan: PartitionPlan | None
    released_bytes: int = 0
    tied: TiedWeights | None = None
    owned_parameters: list[nn.Parameter] = field(init=False)
    name_of: dict[int, str] = field(init=False)

    def __post_init__(self) -> None:
        self.owned_parameters = [t for t in self.owned if isinstance(t, nn.Parameter)]
        self.name_of = {id(t): name for t, name in zip(self.owned, self.owned_names)}


def check_arguments(
    stages: int,
    micro_batches: int,
    how: str | Sequence[int],
    memory_limit_bytes: float | None,
    profile_repeats: int,
    placement: str,
    split_points: Sequence[str] | None = None,
) -> None:
    """Raise ``ValueError``, naming the fix, for a pipeline strategy's argument out of range
    (``how`` is its ``partition``): at construction, before any process starts."""
    if split_points is not None:
        if len(split_points) != stages - 1 or not all(
            isinstance(point, str) and point for point in split_points
        ):
            raise ValueError(
                f"split_points names the module that starts each of stages 1..{stages - 1}: it "
                f"needs {stages - 1} module names, got {list(split_points)!r}"
            )
        if how != "auto":
            raise ValueError(
                f"give partition={how!r} or split_points={list(split_points)!r}, not both"
            )
    if not isinstance(stages, int) or stages < 1:
        raise ValueError(f"stages must be a positive integer, got {stages!r}")
    if not isinstance(micro_batches, int) or micro_batches < 1:
        raise ValueError(f"micro_batches must be a positive integer, got {micro_batches!r}")
    if isinstance(how, str):
        if how not in ("auto", "estimate", "even"):
            raise ValueError(
                f"partition must be 'auto', 'estimate', 'even' or a list of {stages - 1} "
                f"boundaries, got {how!r}"
            )
    elif len(how) != stages - 1:
        raise ValueError(
            f"partition lists the first layer of stages 1..{stages - 1}: it needs "
            f"{stages - 1} boundaries, got {list(how)}"
        )
    if profile_repeats < 1:
        raise ValueError(f"profile_repeats must be at least 1, got {profile_repeats}")
    if placement not in PLACEMENTS:
        raise ValueError(
            f"placement must be one of {PLACEMENTS} ('stage' keeps each stage's data-parallel "
            f"allreduce on one host), got {placement!r}"
        )
    if memory_limit_bytes is not None and not memory_limit_bytes > 0:
        raise ValueError(
            f"memory_limit_bytes must be > 0 (or None: no limit), got {memory_limit_bytes!r}"
        )


def normal_tensors(value: Any) -> Any:
    """Clone tensors made under ``torch.inference_mode`` so autograd may use them."""
    if isinstance(value, Tensor):
        return value.clone() if value.is_inference() else value
    if isinstance(value, tuple):
        return tuple(normal_tensors(v) for v in value)
    if isinstance(value, list):
        return [normal_tensors(v) for v in value]
    if isinstance(value, dict):
        return {k: normal_tensors(v) for k, v in value.items()}
    return value


def check_forward_is_layers(module: nn.Module, body: nn.Module, example: tuple[Any, ...]) -> None:
    """Raise :class:`PipelineSplitError` unless ``module(*example)`` equals ``body(*example)``
    (compared in eval mode, without gradients; every module's mode is restored)."""
    modes = {m: m.training for m in module.modules()}
    module.eval()
    try:
        with torch.no_grad():
            expected, split = module(*example), body(*example)
            same = all(
                torch.allclose(a, b, rtol=1e-5, atol=1e-6)
                for a, b in zip(tensors_of(expected), tensors_of(split), strict=True)
            )
    except ValueError:  # not the same number of outputs
        same = False
    finally:
        for child, training in modes.items():
            child.training = training
    if not same:
        raise PipelineSplitError(
            f"{type(module).__name__}.forward(x) differs from self.layers(x); the pipeline "
            "splits self.layers, so forward must be exactly `return self.layers(x)` (move "
            "other computation into layers, or into training_step after the forward)"
        )


def choose_boundaries(
    layers: Sequence[nn.Module],
    example: tuple[Any, ...],
    *,
    how: str | list[int],
    stages: int,
    micro_batches: int,
    profile_repeats: int,
    memory_limit_bytes: float | None,
    schedule: str,
    recompute: str,
    topology: PipelineTopology | None,
    rank: int,
    world_size: int,
    device: Callable[[], torch.device],
    flushing: bool = True,
) -> tuple[list[int], PartitionPlan | None]:
    """The first layer of stages 1..p-1, and the partition plan that chose them (``None`` for
    given or even boundaries). Collective over the world for ``how="auto"`` with real weights.

    Args:
        how: the strategy's ``partition``: ``"auto"``, ``"estimate"``, ``"even"`` or the
            boundaries.
        schedule: the schedule's name and ``recompute`` its recomputation mode, as the
            partitioner models them.
        topology: the pipelines (for the link measurement between their stages).
        rank: this rank's global rank, ``world_size`` the number of ranks.
        device: this rank's device, asked for only to measure the link (a strategy not set up
            has none).
        flushing: whether the pipeline flushes every step (GroPipe) or never (SpecTrain): how
            the trial weighs a split (:func:`~lightning_parallel.pipeline.trial.candidate_cost`).
    """
    if isinstance(how, list):
        check_boundaries(how, len(layers))
        return list(how), None
    if how == "even" or stages == 1:
        return even_boundaries(len(layers), stages), None
    # estimated from shapes (the same on every rank and run), or timed
    deferred = how == "estimate" or any(is_deferred(layer) for layer in layers)
    # "auto": every rank profiles at the same time, so that the timings see what training
    # will see (the other ranks computing beside it, sharing cores and memory bandwidth);
    # the per-layer times are averaged over ranks and every rank partitions the same way.
    # A deferred model has no weights to time: its costs are estimated from shapes alike
    # on every rank.
    try:
        mine: ModelProfile | str = (
            estimate_layers(layers, example)
            if deferred
            else profile_layers(
                layers,
                example,
                repeats=profile_repeats,
                micro_batches=micro_batches,
            )
        )
    except (PartitionError, PipelineSplitError) as error:
        mine = str(error)
    profiles: list[Any] = [mine]
    if not deferred and dist.is_available() and dist.is_initialized() and world_size > 1:
        profiles = [None] * world_size
        dist.all_gather_object(profiles, mine)
    errors = [p for p in profiles if isinstance(p, str)]
    if errors:
        raise PartitionError(errors[0])
    link = 0.0
    if not deferred and len(profiles) > 1 and topology is not None:
        # the cut's transfers count beside compute (pipeline.link)
        pipelines = [topology.pipeline_ranks(g) for g in range(topology.groups)]
        link = measure_link_seconds_per_byte(pipelines, rank, device())
        process_ledger().set_gauge("link_seconds_per_megabyte", link * 2**20)
    profile = mean_profile(profiles)
    plan = partition(
        profile,
        stages,
        micro_batches,
        schedule=schedule,
        recompute=recompute,
        memory_limit_bytes=memory_limit_bytes,
        link_seconds_per_byte=link,
        flushing=flushing,
    )
    if not deferred and len(profiles) > 1 and topology is not None:
        # the projection settled by timing whole stages (pipeline.trial)
        even = plan_for(profile, even_boundaries(len(layers), stages), micro_batches, schedule,
                        recompute, link_seconds_per_byte=link, flushing=flushing)  # fmt: skip
        candidates = [list(plan.boundaries)]
        fits = memory_limit_bytes is None or max(even.stage_memory_bytes) <= memory_limit_bytes
        if fits and list(even.boundaries) not in candidates:
            candidates.append(list(even.boundaries))
        if len(candidates) > 1:
            measured = trial_stage_seconds(
                candidates, layers, example, stage=topology.stage_of(rank), stages=stages,
                repeats=profile_repeats,
            )  # fmt: skip
            outputs = [cost.output_bytes for cost in profile.layers]
            chosen = choose_by_trial(
                candidates, measured, outputs, micro_batches, link, flushing, profile.tied
            )
            process_ledger().set_gauge("partition_trial_chose_even", float(chosen == 1))
            if chosen:
                plan = even
    return list(plan.boundaries), plan


def assemble(
    module: nn.Module,
    stages: list[StageModule],
    boundaries: list[int],
    plan: PartitionPlan | None,
    names: Mapping[int, str],
    *,
    release: bool,
    held_elsewhere: Callable[[], list[nn.Module]],
    topology: PipelineTopology,
    groups: ProcessGroups,
    rank: int,
    device: torch.device,
    recompute: str,
    gradient_sync: Callable[[list[nn.Parameter]], PartitionGradientSync | None],
) -> tuple[Pipeline, dict[int, Tensor]]:
    """This rank's :class:`Pipeline` over ``stages`` (split at ``boundaries``, chosen by
    ``plan``), and ``id(tensor before) -> tensor now`` for the owned tensors materializing
    replaced (:class:`~lightning_parallel.pipeline.ownership.Ownership`).

    Args:
        module: the whole model; ``names`` is ``id(tensor) -> name`` for its tensors.
        release: take ownership of the stage (the other stages' tensors go to ``meta``, a meta
            stage is materialized on ``device`` and then broadcast to its data-parallel
            replicas); else the stage's tensors stay as they are.
        held_elsewhere: the modules outside ``module`` that refer to its tensors (called only
            to release).
        topology: the placement, ``groups`` its process groups, ``rank`` this rank's global
            rank in it.
        recompute: the runtime's recomputation mode.
        gradient_sync: the stage's gradient averaging across groups, from its parameters.

    A tensor used by several stages (tied weights) is held by each of them
    (:attr:`Pipeline.tied`, :mod:`~lightning_parallel.pipeline.tied`).

    Raises:
        PipelineSplitError: a meta tensor that cannot be materialized.
    """
    stage = topology.stage_of(rank)
    shared = tied_stages([stage_tensors(s) for s in stages])
    tied_names = {names[key]: where for key, where in shared.items()}
    try:
        if release:
            ownership = take_ownership(
                module, stages, stage, device, also=held_elsewhere(), tie=True
            )
        else:
            owned = stage_tensors_owned(module, stages, stage, tie=True)
            ownership = Ownership(owned, [names[id(t)] for t in owned], {}, 0, False)
    except (TiedAcrossStagesError, ValueError) as error:
        raise PipelineSplitError(str(error)) from error
    owned = ownership.owned
    if ownership.materialized and topology.groups > 1 and groups.data_parallel is not None:
        # a stage materialized from meta starts alike on its data-parallel replicas
        source = topology.rank(0, stage)
        with torch.no_grad():
            for tensor in owned:
                broadcast_(tensor, source, groups.data_parallel)
    held = {n: t for n, t in zip(ownership.names, owned) if n in tied_names}
    tied = TiedWeights(tied_names, held, topology, rank) if tied_names else None
    if tied is not None:
        tied.synchronize()
    group, count = topology.group_of(rank), topology.stages
    transport = None
    if count > 1:
        transport = StageTransport(
            stage,
            topology.pipeline_ranks(group),
            groups.pipeline,
            device,
            backward_group=groups.pipeline_backward,
            bookkeeping_group=groups.bookkeeping,
        )
    parameters = [t for t in owned if isinstance(t, nn.Parameter)]
    runtime = StageRuntime(
        stages[stage],
        stage,
        count,
        transport,
        recompute=recompute,
        gradient_sync=gradient_sync(parameters),
        batch_norm_group=groups.data_parallel,
        reduce_batch_norm=topology.groups > 1,
        rank=rank,
    )
    summary = StepSummary(
        count,
        stage,
        groups.bookkeeping if groups.bookkeeping is not None else groups.pipeline,
        topology.rank(group, count - 1),
    )
    for index, boundary in enumerate(boundaries):  # which split ran, in every record
        process_ledger().set_gauge(f"partition_boundary_{index}", float(boundary))
    pipeline = Pipeline(
        stages,
        boundaries,
        owned,
        ownership.names,
        runtime,
        summary,
        plan,
        ownership.released_bytes,
        tied,
    )
    return pipeline, ownership.replaced
