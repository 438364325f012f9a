"""The Lightning side every pipeline strategy shares: GroPipe, SpecTrain and the bench's peers.

:class:`PipelineStrategyBase` runs an unchanged ``LightningModule`` as ``world_size / stages``
data-parallel groups of ``stages`` pipeline stages. It owns what does not depend on the engine:

1. **placement**: the topology (which rank runs which stage of which group; the last stage of
   group 0 is global rank 0, where Lightning's loggers and progress bar live), the pipeline and
   data-parallel process groups, gloo side groups for host values and checkpoint bytes (the
   device rule of :mod:`lightning_parallel.comm.devices`), and per-group samplers;
2. **assembly**, before the first training batch (:meth:`on_train_batch_start`, so that the
   optimizer Lightning steps is already the rebuilt one) or at the first evaluation batch: the
   stage-0 model input is captured by calling the user's step with ``forward`` patched, the
   model becomes a layer chain (:mod:`~lightning_parallel.pipeline.stages`), the boundaries are
   chosen (profiled, or estimated from shapes for a model built on ``meta``), and the rank
   *takes ownership* of its stage (:mod:`~lightning_parallel.pipeline.ownership`): the other
   stages' tensors go to ``meta``, a deferred (meta) stage is materialized, and the optimizer
   is rebuilt over the owned parameters with its hyperparameters and schedulers kept;
3. **the user's code**: ``training_step``/``validation_step`` called with ``forward`` patched to
   return the pipeline's output on the last stage, logged values mirrored to every rank,
   ``reduce`` over a stage's data-parallel replicas, evaluation as pipelined forwards;
4. **checkpoints**: every rank contributes its own stage; the root receives the stages one at a
   time, memory-mapped from a spill folder, and writes one consolidated file that loads under
   any strategy (:mod:`~lightning_parallel.pipeline.consolidate`). Resuming loads the file
   memory-mapped and each rank copies its own stage's weights and optimizer state.

Extension points for a subclass (an engine): :meth:`prepare_module` (convert layers before the
optimizers exist), :meth:`gradient_sync` (the stage's cross-group gradient averaging, or
``None``), :meth:`stage_state` / :meth:`load_stage_state` (per-stage state to checkpoint, e.g.
a weight predictor), and Lightning's own ``training_step``/``backward``/``optimizer_step``.

After ``fit``, a rank holds its own stage only; the other stages' parameters are on ``meta``.
With the ``spawn``/``fork`` launchers rank 0 first gathers every stage (stage by stage), so that
the model handed back to the parent process is whole. Checkpoints are always whole.
"""

from __future__ import annotations

import collections
import inspect
import json
import tempfile
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any, ClassVar

import pytorch_lightning as pl
import torch
import torch.distributed as dist
from pytorch_lightning.plugins.precision import MixedPrecision
from pytorch_lightning.trainer.states import TrainerFn
from torch import Tensor, nn
from torch.distributed.constants import default_pg_timeout as DEFAULT_TIMEOUT
from torchmetrics import Metric
from typing_extensions import override

from lightning_parallel.comm.devices import broadcast_, side_group, to_group
from lightning_parallel.comm.ledger import process_ledger
from lightning_parallel.comm.modules import broadcast_module_states, reduce_tensor
from lightning_parallel.compat.types import StrPath
from lightning_parallel.files import save_atomically
from lightning_parallel.pipeline.checkpoint_layout import (
    load_whole_model_layout,
    merge_stages,
    whole_model_layout,
)
from lightning_parallel.pipeline.consolidate import gather_to_root, remove_spill
from lightning_parallel.pipeline.grad_sync import PartitionGradientSync
from lightning_parallel.pipeline.link import measure_link_seconds_per_byte
from lightning_parallel.pipeline.microbatch import merge_microbatches, split_microbatches
from lightning_parallel.pipeline.ownership import (
    Ownership,
    TensorNames,
    TiedAcrossStagesError,
    restrict_optimizer,
    stage_tensors_owned,
    take_ownership,
)
from lightning_parallel.pipeline.partition import PartitionError, PartitionPlan, partition
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
    layer_sequence,
    pipeline_body,
    split_stages,
)
from lightning_parallel.pipeline.summary import LoggedValue, LogRecorder, StepSummary
from lightning_parallel.pipeline.timeline import TimelineEvent, events_to_dicts, plot_timeline
from lightning_parallel.pipeline.topology import (
    PLACEMENTS,
    PipelineTopology,
    ProcessGroups,
    build_process_groups,
)
from lightning_parallel.pipeline.transport import StageTransport
from lightning_parallel.strategies.base import ParallelStrategyBase

__all__ = ["PipelineStrategyBase"]


class _InputCaptured(Exception):
    """Raised by the capturing ``forward`` to stop the user's step once the inputs are known."""

    def __init__(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        super().__init__("model input captured")
        self.args, self.kwargs = args, kwargs


@contextmanager
def patched(target: Any, name: str, replacement: Any) -> Iterator[None]:
    """Set an instance attribute for the block, then restore what was there."""
    had = name in vars(target)
    previous = vars(target).get(name)
    setattr(target, name, replacement)
    try:
        yield
    finally:
        if had:
            setattr(target, name, previous)
        else:
            delattr(target, name)


def _normal_tensors(value: Any) -> Any:
    """Clone tensors made under ``torch.inference_mode`` so autograd may use them."""
    if isinstance(value, Tensor):
        return value.clone() if value.is_inference() else value
    if isinstance(value, tuple):
        return tuple(_normal_tensors(v) for v in value)
    if isinstance(value, list):
        return [_normal_tensors(v) for v in value]
    if isinstance(value, dict):
        return {k: _normal_tensors(v) for k, v in value.items()}
    return value


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
    """

    stages: list[StageModule]
    boundaries: list[int]
    owned: list[Tensor]
    owned_names: list[str]
    runtime: StageRuntime
    summary: StepSummary
    plan: PartitionPlan | None
    released_bytes: int = 0
    owned_parameters: list[nn.Parameter] = field(init=False)
    name_of: dict[int, str] = field(init=False)

    def __post_init__(self) -> None:
        self.owned_parameters = [t for t in self.owned if isinstance(t, nn.Parameter)]
        self.name_of = {id(t): name for t, name in zip(self.owned, self.owned_names)}


class PipelineStrategyBase(ParallelStrategyBase):
    """The shared Lightning integration of the pipeline strategies (see the module docstring).

    Args:
        stages: pipeline stages per group, ``p``; the world size must be a multiple of it.
        micro_batches: micro-batches per batch, ``m``.
        partition: ``"auto"`` (profile every layer, or estimate it from shapes for a model built
            on ``meta``, and split by exact dynamic programming), ``"estimate"`` (estimate every
            layer from shapes, FLOPs and bytes, and split alike: the same partition on every
            run, where timings move it by noise), ``"even"`` (same number of layers per stage),
            or the list of ``p−1`` boundaries.
        memory_limit_bytes: most memory a stage may use, for ``partition="auto"`` and
            ``"estimate"``.
        profile_repeats: timed runs per layer for ``partition="auto"``.
        placement: ``"pipeline"`` (a group's stages on consecutive ranks) or ``"stage"`` (a
            stage's replicas on consecutive ranks).
        timeline_path: write the measured timeline of the last ``timeline_steps`` training
            steps there at the end of ``fit`` (``.json``, or ``.png`` for a plot).
        timeline_steps: steps of timeline kept in memory.
        start_method: ``"popen"``, ``"spawn"``, ``"fork"`` or ``"forkserver"``; nothing is
            launched when processes are started externally.
        timeout: a ``timedelta`` for every collective.
        **kwargs: Lightning's strategy arguments (``accelerator``, ``parallel_devices``,
            ``cluster_environment``, ``checkpoint_io``, ``precision_plugin``,
            ``process_group_backend``), passed on by :class:`ParallelStrategyBase`.
    """

    reports_communication = True
    wraps_in_ddp = False  # no DistributedDataParallel: its keywords are refused
    #: the rank keeps only its stage (an engine that needs the whole model says False)
    owns_stages: ClassVar[bool] = True

    def __init__(
        self,
        stages: int = 2,
        micro_batches: int = 4,
        partition: str | Sequence[int] = "auto",
        memory_limit_bytes: float | None = None,
        profile_repeats: int = 5,
        placement: str = "pipeline",
        timeline_path: str | None = None,
        timeline_steps: int = 3,
        start_method: str = "popen",
        timeout: timedelta | None = DEFAULT_TIMEOUT,
        **kwargs: Any,
    ) -> None:
        if timeline_steps < 1:
            raise ValueError(f"timeline_steps must be at least 1, got {timeline_steps}")
        if not isinstance(stages, int) or stages < 1:
            raise ValueError(f"stages must be a positive integer, got {stages!r}")
        if not isinstance(micro_batches, int) or micro_batches < 1:
            raise ValueError(f"micro_batches must be a positive integer, got {micro_batches!r}")
        if isinstance(partition, str):
            if partition not in ("auto", "estimate", "even"):
                raise ValueError(
                    f"partition must be 'auto', 'estimate', 'even' or a list of {stages - 1} "
                    f"boundaries, got {partition!r}"
                )
        elif len(partition) != stages - 1:
            raise ValueError(
                f"partition lists the first layer of stages 1..{stages - 1}: it needs "
                f"{stages - 1} boundaries, got {list(partition)}"
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
        super().__init__(timeout=timeout, start_method=start_method, **kwargs)
        self.stages = stages
        self.micro_batches = micro_batches
        self.partition = partition if isinstance(partition, str) else [int(b) for b in partition]
        self.memory_limit_bytes = memory_limit_bytes
        self.profile_repeats = profile_repeats
        self.placement = placement
        self.timeline_path = timeline_path
        self.timeline: collections.deque[list[TimelineEvent]] = collections.deque(
            maxlen=timeline_steps
        )
        self.partition_plan: PartitionPlan | None = None
        self._topology: PipelineTopology | None = None
        self._groups: ProcessGroups | None = None
        self._cpu_group: dist.ProcessGroup | None = None
        self._pipeline: Pipeline | None = None
        self._boundaries: list[int] | None = None
        self._layers: list[nn.Module] | None = None
        self._resume: dict[str, Any] | None = None
        self._names: dict[int, str] = {}
        self._replaced: dict[int, Tensor] = {}

    # -- placement ---------------------------------------------------------------------------

    @property
    def groups(self) -> int:
        """Data-parallel groups ``g = world_size / stages``."""
        return max(self.world_size // self.stages, 1)

    @property
    def _placement(self) -> PipelineTopology:
        # groups * stages is always a valid world size: usable before the processes exist
        return PipelineTopology(self.groups * self.stages, self.stages, self.placement)

    @property
    def group_index(self) -> int:
        return self._placement.group_of(self.global_rank)

    @property
    def stage_index(self) -> int:
        return self._placement.stage_of(self.global_rank)

    @override
    def check_world_size(self, world_size: int) -> None:
        # raised by Trainer(...), before any process starts
        PipelineTopology(world_size, self.stages, self.placement)

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        # the stages of a group must see the same batches: count replicas, not processes
        return {"num_replicas": self.groups, "rank": self.group_index}

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        topology = PipelineTopology(self.world_size, self.stages, self.placement)
        if self._topology != topology:
            self._topology = topology
            self._groups = build_process_groups(topology, self.global_rank)
            if self.world_size > 1:
                # checkpoint bytes are CPU tensors: a gloo group whatever the default backend
                self._cpu_group = side_group()

    # -- setup and teardown ------------------------------------------------------------------

    @contextmanager
    def model_sharded_context(self) -> Iterator[None]:
        """Modules built in ``configure_model`` are created on ``meta`` (no memory): each rank
        materializes only its own stage once the partition is known."""
        with torch.device("meta"):
            yield

    @override
    def model_to_device(self) -> None:
        assert self.model is not None
        if not is_deferred(self.model):
            self.model.to(self.root_device)
        else:  # the meta tensors are materialized on the device, stage by stage
            _move_real(self.model, self.root_device)

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        assert self.accelerator is not None and self.model is not None
        module = self.lightning_module
        assert module is not None
        if not module.automatic_optimization:
            raise ValueError(
                f"{type(self).__name__} needs automatic optimization: the pipeline runs forward "
                "and backward itself. Remove `self.automatic_optimization = False`"
            )
        if (
            isinstance(self.precision_plugin, MixedPrecision)
            and self.precision_plugin.scaler is not None
        ):
            raise ValueError(
                f"{type(self).__name__} does not support gradient scaling (precision='16-mixed' "
                "on CUDA); use precision='bf16-mixed' or '32-true'"
            )
        self.accelerator.setup(trainer)
        self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        if self._groups is None:  # a single process without setup_environment (tests)
            self.setup_environment()
        fitting = trainer.state.fn == TrainerFn.FITTING
        if not is_deferred(self.model):
            # processes started apart (popen, torchrun) initialize differently: start from
            # rank 0's (a stage materialized later is synchronized then)
            broadcast_module_states(self.model)
        self.prepare_module(module, fitting)
        self._point_metrics_at_replicas(module)
        if fitting:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        self._pipeline = None  # built at the first batch (the model input shows its shapes)

    def prepare_module(self, module: pl.LightningModule, fitting: bool) -> None:
        """Convert layers before the optimizers exist (an engine's hook; default: nothing)."""

    def put_back_layers(self, originals: Mapping[nn.Module, nn.Module]) -> None:
        """Refer to ``originals[m]`` wherever the layers kept for the next run refer to a
        replacement ``m`` (one walk over them): an engine calls it when it puts back layers it
        replaced for one run (GroPipe's deferred BatchNorm). The layers are kept across runs
        (a traced body cannot be traced again once other stages' tensors are released), so
        without this the next run (``validate`` after ``fit``) would build its stages from the
        replacements, whose tensors a device move (CUDA to the CPU and back) has left behind."""
        if self._layers is None or not originals:
            return
        self._layers = [originals.get(layer, layer) for layer in self._layers]
        for layer in self._layers:
            for parent in layer.modules():
                for name, child in parent._modules.items():
                    if child is not None and child in originals:
                        parent._modules[name] = originals[child]

    def held_elsewhere(self) -> list[nn.Module]:
        """Modules outside the model that refer to its tensors (layers an engine replaced and
        will put back); ownership moves their tensors too (an engine's hook; default: none)."""
        return []

    def _point_metrics_at_replicas(self, module: nn.Module) -> None:
        """torchmetrics sync over the data-parallel replicas of a stage, not the world (only the
        last stages update them: a world-wide sync would wait for the others forever)."""
        assert self._groups is not None
        for child in module.modules():
            if (
                hasattr(child, "process_group")
                and hasattr(child, "compute")
                and child.process_group is None
            ):
                child.process_group = self._groups.data_parallel

    # -- assembly ----------------------------------------------------------------------------

    @property
    def _body(self) -> nn.Module:
        assert self.lightning_module is not None
        return pipeline_body(self.lightning_module)

    def capture(self, hook: str, micro_batch: Any, hook_args: Sequence[Any]) -> tuple[Any, ...]:
        """The positional arguments the user's ``hook`` passes to the model's ``forward``."""
        module = self.lightning_module
        assert module is not None

        def capture(*args: Any, **kwargs: Any) -> Any:
            raise _InputCaptured(args, kwargs)

        with patched(self._body, "forward", capture), patched(module, "log", lambda *a, **k: None):
            try:
                getattr(module, hook)(micro_batch, *hook_args)
            except _InputCaptured as captured:
                if captured.kwargs:
                    raise ValueError(
                        f"the model's forward was called with keyword arguments "
                        f"{sorted(captured.kwargs)} in {hook}; a pipeline passes positional "
                        "arguments only: call self(x) / self.layers(x)"
                    ) from None
                return captured.args
        raise ValueError(
            f"{type(module).__name__}.{hook} never called the model's forward; a pipeline needs "
            "`self(x)` (or `self.layers(x)`) once per batch in every step method it runs"
        )

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        # build (and take ownership) before Lightning's closure runs, so that the optimizer it
        # steps is the one rebuilt over this stage's parameters
        super().on_train_batch_start(batch, batch_idx)
        if self._pipeline is None:
            module = self.lightning_module
            assert module is not None
            first = split_microbatches(batch, self.micro_batches)[0]
            # what Lightning passes: batch_idx only if training_step takes it
            takes_index = len(inspect.signature(module.training_step).parameters) > 1
            arguments = (batch_idx,) if takes_index else ()
            self.ensure_pipeline(self.capture("training_step", first, arguments))

    def ensure_pipeline(self, example_args: tuple[Any, ...]) -> Pipeline:
        """Build this rank's part of the pipeline (once) from one micro-batch's model input."""
        if self._pipeline is not None:
            return self._pipeline
        module = self.lightning_module
        assert module is not None and self._topology is not None and self._groups is not None
        body = self._body
        with torch.inference_mode(False), torch.enable_grad():
            example = _normal_tensors(example_args)
            if body is not module and not is_deferred(module):
                _check_forward_is_layers(module, body, example)
            if self._layers is None:
                self._layers = layer_sequence(body, example)
            layers = self._layers
            boundaries, plan = self._choose_boundaries(layers, example)
        stages = split_stages(layers, boundaries)
        k = self.stage_index
        # every tensor's name before any is replaced: the user's optimizer refers to these
        self._names = TensorNames.of(module).name_of()
        try:
            if self.owns_stages:
                ownership = take_ownership(
                    module, stages, k, self.root_device, also=self.held_elsewhere()
                )
            else:
                owned = stage_tensors_owned(module, stages, k)
                ownership = Ownership(owned, [self._names[id(t)] for t in owned], {}, 0, False)
        except (TiedAcrossStagesError, ValueError) as error:
            raise PipelineSplitError(str(error)) from error
        owned, owned_names, released = ownership.owned, ownership.names, ownership.released_bytes
        self._replaced = ownership.replaced
        if ownership.materialized:
            self._sync_materialized(owned)
        runtime, summary = self._build_runtime(stages, owned)
        self._boundaries, self.partition_plan = boundaries, plan
        for index, boundary in enumerate(boundaries):  # which split ran, in every record
            process_ledger().set_gauge(f"partition_boundary_{index}", float(boundary))
        self._pipeline = Pipeline(
            stages, boundaries, owned, owned_names, runtime, summary, plan, released
        )
        self._apply_resume(self._pipeline)
        trainer = getattr(module, "_trainer", None)
        if trainer is not None and trainer.state.fn == TrainerFn.FITTING and self.optimizers:
            self._restrict_optimizers(self._pipeline)
        return self._pipeline

    def _sync_materialized(self, owned: Sequence[Tensor]) -> None:
        """A stage materialized from ``meta`` starts alike on its data-parallel replicas."""
        assert self._groups is not None and self._topology is not None
        if self.groups > 1 and self._groups.data_parallel is not None:
            source = self._topology.rank(0, self.stage_index)
            group = self._groups.data_parallel
            with torch.no_grad():
                for tensor in owned:
                    broadcast_(tensor, source, group)

    def _build_runtime(
        self, stages: list[StageModule], owned: list[Tensor]
    ) -> tuple[StageRuntime, StepSummary]:
        assert self._topology is not None and self._groups is not None
        topology, groups, k = self._topology, self._groups, self.stage_index
        transport = None
        if self.stages > 1:
            transport = StageTransport(
                k,
                topology.pipeline_ranks(self.group_index),
                groups.pipeline,
                self.root_device,
                backward_group=groups.pipeline_backward,
                bookkeeping_group=groups.bookkeeping,
            )
        parameters = [t for t in owned if isinstance(t, nn.Parameter)]
        runtime = StageRuntime(
            stages[k],
            k,
            self.stages,
            transport,
            recompute=getattr(self, "recompute", "never"),
            gradient_sync=self.gradient_sync(parameters),
            batch_norm_group=groups.data_parallel,
            reduce_batch_norm=topology.groups > 1,
            rank=self.global_rank,
        )
        summary = StepSummary(
            self.stages,
            k,
            groups.bookkeeping if groups.bookkeeping is not None else groups.pipeline,
            topology.rank(self.group_index, self.stages - 1),
        )
        return runtime, summary

    def gradient_sync(self, parameters: list[nn.Parameter]) -> PartitionGradientSync | None:
        """The stage's gradient averaging across groups (an engine's hook; default: GroPipe's
        per-partition delayed allreduce)."""
        assert self._groups is not None and self._topology is not None
        return PartitionGradientSync(parameters, self._groups.data_parallel, self._topology.groups)

    def _restrict_optimizers(self, pipeline: Pipeline) -> None:
        """Rebuild every optimizer over this stage's parameters; repoint its schedulers."""
        if not self.owns_stages:
            return
        owned_ids = {id(t) for t in pipeline.owned}
        rebuilt = []
        for optimizer in self.optimizers:
            inner = getattr(optimizer, "_optimizer", optimizer)
            keep: dict[int, nn.Parameter] = {}
            for group in inner.param_groups:
                for parameter in group["params"]:
                    current = self._replaced.get(id(parameter), parameter)
                    if id(current) in owned_ids:
                        keep[id(parameter)] = current  # type: ignore[assignment]
            restricted = restrict_optimizer(inner, keep)
            # the name of every parameter of the user's optimizer, group by group: the layout
            # of its state in checkpoints
            restricted._lp_parameter_names = [  # type: ignore[attr-defined]
                [self._names[id(p)] for p in group["params"]] for group in inner.param_groups
            ]
            for config in self.lr_scheduler_configs:
                if config.scheduler.optimizer is inner:
                    config.scheduler.optimizer = restricted
            # the user's optimizer lets go of every tensor: whoever still holds it must not
            # keep the released stages alive
            inner.param_groups.clear()
            inner.state.clear()
            rebuilt.append(restricted)
        self.optimizers = rebuilt
        self._apply_resume_optimizers()

    def _choose_boundaries(
        self, layers: Sequence[nn.Module], example: tuple[Any, ...]
    ) -> tuple[list[int], PartitionPlan | None]:
        if self._boundaries is not None:
            return self._boundaries, self.partition_plan
        if isinstance(self.partition, list):
            check_boundaries(self.partition, len(layers))
            return list(self.partition), None
        if self.partition == "even" or self.stages == 1:
            return even_boundaries(len(layers), self.stages), None
        # estimated from shapes (the same on every rank and run), or timed
        deferred = self.partition == "estimate" or any(is_deferred(layer) for layer in layers)
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
                    repeats=self.profile_repeats,
                    micro_batches=self.micro_batches,
                )
            )
        except (PartitionError, PipelineSplitError) as error:
            mine = str(error)
        profiles: list[Any] = [mine]
        if not deferred and dist.is_available() and dist.is_initialized() and self.world_size > 1:
            profiles = [None] * self.world_size
            dist.all_gather_object(profiles, mine)
        errors = [p for p in profiles if isinstance(p, str)]
        if errors:
            raise PartitionError(errors[0])
        link = 0.0
        if not deferred and len(profiles) > 1 and self._topology is not None:
            # the cut's transfers count beside compute (pipeline.link)
            pipelines = [self._topology.pipeline_ranks(g) for g in range(self.groups)]
            link = measure_link_seconds_per_byte(pipelines, self.global_rank, self.root_device)
            process_ledger().set_gauge("link_seconds_per_megabyte", link * 2**20)
        plan = partition(
            mean_profile(profiles),
            self.stages,
            self.micro_batches,
            schedule=getattr(getattr(self, "schedule", None), "name", "1f1b"),
            recompute=getattr(self, "recompute", "never"),
            memory_limit_bytes=self.memory_limit_bytes,
            link_seconds_per_byte=link,
        )
        return list(plan.boundaries), plan

    # -- the user's code ---------------------------------------------------------------------

    def user_step(
        self,
        hook: str,
        micro_batch: Any,
        hook_args: Sequence[Any],
        output: Any,
        recorder: LogRecorder | None,
    ) -> Any:
        """Call the user's step method with ``forward`` returning the pipeline's ``output``."""
        module = self.lightning_module
        assert module is not None
        log = recorder.log if recorder is not None else (lambda *a, **k: None)
        with patched(self._body, "forward", lambda *a, **k: output), patched(module, "log", log):
            return getattr(module, hook)(micro_batch, *hook_args)

    def replay(self, logged: Sequence[LoggedValue]) -> None:
        """Log on this rank what the last stage logged (its own metric objects there)."""
        module = self.lightning_module
        assert module is not None
        for value in logged:
            options = dict(value.options)
            if value.metric is not None:
                module.log(value.name, value.metric, **options)
            else:
                options.pop("metric_attribute", None)
                module.log(
                    value.name, torch.tensor(value.value, device=self.root_device), **options
                )

    def _evaluation_step(self, hook: str, context: Callable[[], Any], args: tuple[Any, ...]) -> Any:
        batch, hook_args = args[0], args[1:]
        micro = split_microbatches(batch, self.micro_batches)
        first = self.stage_index == 0
        inputs = None
        if first or self._pipeline is None:
            inputs = [
                self.capture(hook, part, hook_args) for part in (micro if first else micro[:1])
            ]
        pipeline = self.ensure_pipeline(inputs[0] if inputs else ())
        runtime = pipeline.runtime
        with context():
            stats = runtime.run_forward_only(len(micro), inputs if first else None)
        result = None
        recorder = LogRecorder()
        if runtime.is_last:
            merged = merge_microbatches([stats.outputs[j] for j in range(len(micro))])
            with context():
                result = self.user_step(hook, batch, hook_args, merged, recorder)
        summary = pipeline.summary.exchange(logged=recorder.combined() if runtime.is_last else ())
        self.replay(summary.logged)
        return result

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        self.set_activity("validation (pipelined forward)")
        return self._evaluation_step(
            "validation_step", self.precision_plugin.val_step_context, args
        )

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._evaluation_step("test_step", self.precision_plugin.test_step_context, args)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._evaluation_step(
            "predict_step", self.precision_plugin.predict_step_context, args
        )

    # -- collectives Lightning asks for ------------------------------------------------------

    @override
    def reduce(self, tensor: Any, group: Any | None = None, reduce_op: Any | None = "mean") -> Any:
        """Reduce over the data-parallel replicas of this stage (values are mirrored inside a
        pipeline, so a world-wide mean would count each replica ``p`` times)."""
        if not isinstance(tensor, Tensor):
            return tensor
        if group is None and self._groups is not None:
            group = self._groups.data_parallel
        return reduce_tensor(tensor, group, reduce_op=reduce_op)

    @override
    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        value = torch.tensor(int(decision), device=self.root_device)
        if dist.is_available() and dist.is_initialized():
            value = to_group(value)
            dist.all_reduce(value)
        return bool(value == self.world_size) if all else bool(value)

    # -- checkpoints -------------------------------------------------------------------------

    def _owners(self) -> list[int]:
        assert self._topology is not None
        return [self._topology.rank(0, stage) for stage in range(self.stages)]

    def stage_state(self) -> dict[str, Any]:
        """Per-stage state an engine keeps in checkpoints, beside weights and optimizer state
        (default: none). Every rank returns its own stage's; the checkpoint holds every
        stage's under ``"pipeline"``."""
        return {}

    def load_stage_state(self, state: dict[str, Any]) -> None:
        """Resume what :meth:`stage_state` returned for this rank's stage."""

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """This rank's own stage (the other stages arrive in :meth:`save_checkpoint`)."""
        module = self.lightning_module
        assert module is not None
        return {k: v for k, v in module.state_dict().items() if not v.is_meta}

    @override
    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        """This rank's part of the optimizer state, in the layout of the user's optimizer over
        the whole model (:mod:`~lightning_parallel.pipeline.checkpoint_layout`)."""
        inner = getattr(optimizer, "_optimizer", optimizer)
        names = getattr(inner, "_lp_parameter_names", None)
        if names is None or self._pipeline is None:
            return inner.state_dict()
        return whole_model_layout(inner, names, self._pipeline.name_of)

    @override
    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: StrPath, storage_options: Any | None = None
    ) -> None:
        """Every stage's pieces to rank 0, one at a time; rank 0 writes one whole checkpoint."""
        if self._pipeline is None or self.world_size == 1 or not self.owns_stages:
            if self.is_global_zero:
                self._write(checkpoint, filepath, storage_options)
            return
        pieces = {
            "state_dict": checkpoint.get("state_dict", {}),
            "optimizer_states": [
                s.get("state", {}) for s in checkpoint.get("optimizer_states", [])
            ],
            "stage": self.stage_state(),
        }
        spill = None
        if self.is_global_zero:
            spill = Path(tempfile.mkdtemp(prefix=".lp-stages-", dir=_local_folder(filepath)))
        try:
            gathered = gather_to_root(
                pieces if self.group_index == 0 else None,
                self._owners(),
                root=0,
                spill=spill,
                group=self._cpu_group,
            )
            if gathered is not None:  # rank 0
                order = list(self.lightning_module.state_dict())  # type: ignore[union-attr]
                merged = merge_stages(checkpoint, gathered, order)
                merged["pipeline"] = {
                    "boundaries": list(self._pipeline.boundaries),
                    "stages": [part["stage"] for part in gathered],
                }
                self._write(merged, filepath, storage_options)
        finally:
            remove_spill(spill)
        self.barrier("pipeline checkpoint written")

    def _write(self, checkpoint: dict[str, Any], filepath: StrPath, storage_options: Any) -> None:
        if "://" in str(filepath) or storage_options is not None:
            self.checkpoint_io.save_checkpoint(
                checkpoint, filepath, storage_options=storage_options
            )
        else:
            save_atomically(checkpoint, filepath)

    @override
    def load_checkpoint(
        self, checkpoint_path: StrPath, *args: Any, **kwargs: Any
    ) -> dict[str, Any]:
        if "://" in str(checkpoint_path):
            checkpoint = super().load_checkpoint(checkpoint_path, *args, **kwargs)
        else:
            # memory-mapped: a rank copies its own stage and touches nothing else
            checkpoint = torch.load(
                checkpoint_path, map_location="cpu", mmap=True, weights_only=False
            )
        pipeline = checkpoint.get("pipeline")
        if pipeline and self._boundaries is None and len(pipeline["boundaries"]) == self.stages - 1:
            self._boundaries = [int(b) for b in pipeline["boundaries"]]  # resume the same split
        self._resume = {"checkpoint": checkpoint}
        return checkpoint

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        module = self.lightning_module
        assert module is not None
        if self._pipeline is not None or not is_deferred(module):
            full = checkpoint["state_dict"]
            if self._pipeline is not None:  # keep the other stages on meta
                owned = set(self._pipeline.owned_names)
                full = {k: v for k, v in full.items() if k in owned}
            module.load_state_dict(full, strict=strict and self._pipeline is None)
        # else: applied to the owned tensors once the stage is materialized (_apply_resume)

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        # applied by name to the rebuilt optimizer (_apply_resume_optimizers)
        self._resume = {**(self._resume or {}), "optimizers": checkpoint["optimizer_states"]}
        if self._pipeline is not None:
            self._apply_resume_optimizers()

    def _apply_resume(self, pipeline: Pipeline) -> None:
        checkpoint = (self._resume or {}).get("checkpoint")
        if checkpoint is None:
            return
        module = self.lightning_module
        assert module is not None
        saved = checkpoint.get("state_dict", {})
        with torch.no_grad():
            for name, tensor in zip(pipeline.owned_names, pipeline.owned):
                if name in saved:
                    tensor.copy_(saved[name])
        split = checkpoint.get("pipeline") or {}
        if split.get("boundaries") == pipeline.boundaries and len(split["stages"]) == self.stages:
            self.load_stage_state(split["stages"][self.stage_index])
        self._resume = {k: v for k, v in (self._resume or {}).items() if k != "checkpoint"}

    def _apply_resume_optimizers(self) -> None:
        states = (self._resume or {}).get("optimizers")
        if states is None or self._pipeline is None:
            return
        for optimizer, saved in zip(self.optimizers, states):
            inner = getattr(optimizer, "_optimizer", optimizer)
            names = getattr(inner, "_lp_parameter_names", None)
            if names is None:
                inner.load_state_dict(saved)
            else:
                load_whole_model_layout(inner, saved, names, self._pipeline.name_of)
        self._resume = {k: v for k, v in (self._resume or {}).items() if k != "optimizers"}

    # -- the end of fit ----------------------------------------------------------------------

    @override
    def on_train_end(self) -> None:
        super().on_train_end()
        if self.returns_model_to_parent and self.owns_stages:
            self.gather_model_on_rank_zero()
        if self.timeline_path is not None:
            self.write_timeline(Path(self.timeline_path))

    def write_timeline(self, path: Path) -> None:
        """Gather every rank's measured events of the last steps; rank 0 writes them."""
        events = [event for step in self.timeline for event in step]
        gathered: list[Any] = [events]
        if self.world_size > 1:
            gathered = [None] * self.world_size
            dist.all_gather_object(gathered, events)
        if self.global_rank != 0:
            return
        everything = [event for rank_events in gathered for event in rank_events]
        path.parent.mkdir(parents=True, exist_ok=True)
        if path.suffix == ".png":
            plot_timeline(everything, path, title=self.timeline_title())
        else:
            path.write_text(json.dumps(events_to_dicts(everything)))

    def timeline_title(self) -> str:
        """The title of the timeline plot."""
        return f"{type(self).__name__}, p={self.stages}"

    def gather_model_on_rank_zero(self) -> None:
        """Give rank 0 every stage's weights, one stage at a time (collective). Rank 0 then
        holds the whole model (what the spawn/fork launchers hand back to the parent)."""
        if self._pipeline is None or self.world_size == 1:
            return
        module = self.lightning_module
        assert module is not None
        spill = Path(tempfile.mkdtemp(prefix=".lp-model-")) if self.is_global_zero else None
        try:
            gathered = gather_to_root(
                self.lightning_module_state_dict() if self.group_index == 0 else None,
                self._owners(),
                root=0,
                spill=spill,
                group=self._cpu_group,
            )
            if gathered is not None:
                whole = {k: v.clone() for part in gathered for k, v in part.items()}
                module.load_state_dict(whole, strict=False, assign=True)
        finally:
            remove_spill(spill)

    @override
    def teardown(self) -> None:
        self._pipeline = None
        module = self.lightning_module
        if module is None or not is_deferred(module):
            super().teardown()
            return
        # Lightning moves the module to the CPU, which meta tensors refuse: move what is real
        with patched(module, "cpu", lambda: _move_real(module, torch.device("cpu"))):
            super().teardown()


def _check_forward_is_layers(module: nn.Module, body: nn.Module, example: tuple[Any, ...]) -> None:
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


def _move_real(model: nn.Module, device: torch.device) -> nn.Module:
    """``model.to(device)`` for every tensor that is not on the meta device, torchmetrics'
    states included (Lightning's ``model.to`` moves them; a metric left on the CPU fails its
    first update with CUDA inputs)."""
    with torch.no_grad():
        for module in model.modules():
            for slots in (module._parameters, module._buffers):
                for name, tensor in list(slots.items()):
                    if tensor is None or tensor.is_meta or tensor.device == device:
                        continue
                    moved = tensor.to(device)
                    if isinstance(tensor, nn.Parameter):
                        moved = nn.Parameter(moved, requires_grad=tensor.requires_grad)
                    slots[name] = moved  # type: ignore[assignment]
        for module in model.modules():
            # its states are neither parameters nor buffers (a metric built on meta, in
            # configure_model, cannot move: it stays, as its meta tensors do)
            if isinstance(module, Metric) and not _has_meta_tensors(module):
                module.to(device)
    return model


def _has_meta_tensors(metric: Metric) -> bool:
    """Whether a torchmetrics metric holds a meta tensor: a parameter, buffer or state."""
    states = [getattr(metric, name, None) for name in metric._defaults]
    tensors = [t for s in states for t in (s if isinstance(s, list) else [s])]
    return is_deferred(metric) or any(isinstance(t, Tensor) and t.is_meta for t in tensors)


def _local_folder(filepath: StrPath) -> str | None:
    if "://" in str(filepath):
        return None
    folder = Path(filepath).parent
    folder.mkdir(parents=True, exist_ok=True)
    return str(folder)
