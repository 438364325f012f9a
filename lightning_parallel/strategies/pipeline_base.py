"""The Lightning side every pipeline strategy shares: GroPipe, SpecTrain and the bench's peers.

:class:`PipelineStrategyBase` runs an unchanged ``LightningModule`` as ``world_size / stages``
data-parallel groups of ``stages`` pipeline stages. It owns what does not depend on the engine:

1. **placement**: the topology (which rank runs which stage of which group; the last stage of
   group 0 is global rank 0, where Lightning's loggers and progress bar live), the pipeline and
   data-parallel process groups, gloo side groups for host values and checkpoint bytes (the
   device rule of :mod:`lightning_parallel.comm.devices`), and per-group samplers;
2. **assembly**, before the first training batch (:meth:`on_train_batch_start`, so that the
   optimizer Lightning steps is already the rebuilt one) or at the first evaluation batch: the
   model becomes a layer chain, the boundaries are chosen and the rank *takes ownership* of
   its stage: the inherited :class:`~.pipeline_assembly.PipelineAssembly`;
3. **the user's code**: ``training_step``/``validation_step`` called with ``forward`` patched to
   return the pipeline's output on the last stage (the training step, ``backward`` and clipping
   by norm: the inherited :class:`~.pipeline_training.PipelineTraining`; evaluation as
   pipelined forwards: :class:`~.pipeline_evaluation.PipelineEvaluation`), logged values
   mirrored to every rank, ``reduce`` over a stage's data-parallel replicas;
4. **checkpoints** (always whole, or refused) and the whole model on rank 0 after ``fit``,
   whatever the launcher: the inherited :class:`~.pipeline_checkpoints.PipelineCheckpoints`.
   The other ranks hold their own stage only; the other stages' parameters are on ``meta``.

Extension points for a subclass (an engine): :meth:`prepare_module` (convert layers before the
optimizers exist), :meth:`gradient_sync` (the stage's cross-group gradient averaging, or
``None``), :meth:`stage_state` / :meth:`load_stage_state` (per-stage state to checkpoint, e.g.
a weight predictor), the training step's :meth:`train_micro_batches`, :meth:`gradient_norm`
and :meth:`hand_back_gradients`, and Lightning's own ``optimizer_step``.
"""

from __future__ import annotations

import collections
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch
import torch.distributed as dist
from pytorch_lightning.trainer.states import TrainerFn
from torch import Tensor, nn
from torch.distributed.constants import default_pg_timeout as DEFAULT_TIMEOUT
from typing_extensions import override

from lightning_parallel.comm.devices import side_group, to_group
from lightning_parallel.comm.modules import broadcast_module_states, reduce_tensor
from lightning_parallel.pipeline.assembly import check_arguments
from lightning_parallel.pipeline.device_moves import move_real
from lightning_parallel.pipeline.discovery import SplitTarget, named_target
from lightning_parallel.pipeline.export_split import FlatCall
from lightning_parallel.pipeline.ownership import TensorSlot
from lightning_parallel.pipeline.partition import PartitionPlan
from lightning_parallel.pipeline.patching import patched
from lightning_parallel.pipeline.stages import is_deferred
from lightning_parallel.pipeline.summary import point_metrics_at
from lightning_parallel.pipeline.timeline import TimelineEvent, gather_timeline, save_timeline
from lightning_parallel.pipeline.topology import (
    PipelineTopology,
    ProcessGroups,
    build_process_groups,
)
from lightning_parallel.strategies.pipeline_assembly import PipelineAssembly
from lightning_parallel.strategies.pipeline_training import check_trainable

__all__ = ["PipelineStrategyBase"]


class PipelineStrategyBase(PipelineAssembly):
    """The shared Lightning integration of the pipeline strategies (see the module docstring).

    Args:
        stages: pipeline stages per group, ``p``; the world size must be a multiple of it.
        micro_batches: micro-batches per batch, ``m``.
        partition: ``"auto"`` (profile every layer, or estimate it from shapes for a model built
            on ``meta``, split by dynamic programming, timed plans checked against the even
            split as whole stages), ``"estimate"`` (from shapes, FLOPs and bytes alone: the
            same partition on every run), ``"even"`` (same number of layers per stage), or the
            list of ``p−1`` boundaries.
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
    #: where each (group, stage) runs (an engine may number its ranks otherwise)
    topology_kind: type[PipelineTopology] = PipelineTopology

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
        module: str | None = None,
        split_points: Sequence[str] | None = None,
        start_method: str = "popen",
        timeout: timedelta | None = DEFAULT_TIMEOUT,
        **kwargs: Any,
    ) -> None:
        if timeline_steps < 1:
            raise ValueError(f"timeline_steps must be at least 1, got {timeline_steps}")
        check_arguments(
            stages,
            micro_batches,
            partition,
            memory_limit_bytes,
            profile_repeats,
            placement,
            split_points,
        )
        super().__init__(timeout=timeout, start_method=start_method, **kwargs)
        self.stages = stages
        self.micro_batches = micro_batches
        self.partition = partition if isinstance(partition, str) else [int(b) for b in partition]
        self.memory_limit_bytes = memory_limit_bytes
        self.profile_repeats = profile_repeats
        self.placement = placement
        self.timeline_path = timeline_path
        self.split_module = module
        self.split_points = None if split_points is None else list(split_points)
        self.timeline: collections.deque[list[TimelineEvent]] = collections.deque(
            maxlen=timeline_steps
        )
        self.partition_plan: PartitionPlan | None = None
        self._topology = None
        self._groups: ProcessGroups | None = None
        self._cpu_group = None
        self._pipeline = None
        self._boundaries = None
        self._layers: list[nn.Module] | None = None
        self._layer_slots: list[TensorSlot] = []  # the layers' slots of the model's tensors
        self._call: FlatCall | None = None  # how the exported layers are called
        self._target: SplitTarget | None = None
        self._resume = None
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
        return self.topology_kind(self.groups * self.stages, self.stages, self.placement)

    @property
    @override
    def group_index(self) -> int:
        return self._placement.group_of(self.global_rank)

    @property
    @override
    def stage_index(self) -> int:
        return self._placement.stage_of(self.global_rank)

    @override
    def check_world_size(self, world_size: int) -> None:
        # raised by Trainer(...), before any process starts
        self.topology_kind(world_size, self.stages, self.placement)

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        # the stages of a group must see the same batches: count replicas, not processes
        return {"num_replicas": self.groups, "rank": self.group_index}

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        topology = self.topology_kind(self.world_size, self.stages, self.placement)
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
            move_real(self.model, self.root_device)

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        assert self.accelerator is not None and self.model is not None
        module = self.lightning_module
        assert module is not None
        check_trainable(type(self).__name__, module, self.precision_plugin)
        self.accelerator.setup(trainer)
        self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        if self._groups is None:  # a single process without setup_environment (tests)
            self.setup_environment()
        fitting = trainer.state.fn == TrainerFn.FITTING
        if not self._deferred_on_any_rank():
            # processes started apart (popen, torchrun) initialize differently: start from
            # rank 0's (a stage materialized later is synchronized then)
            broadcast_module_states(self.model)
        if fitting:
            self._ended_stage_state = None  # this fit's engine state replaces the last one's
        self._target = None  # decided at the first step (a new run may bring a new module)
        if self.split_module:  # a wrong name fails here, before any stage is built
            named_target(module, self.split_module)
        self.prepare_module(module, fitting)
        assert self._groups is not None  # torchmetrics sync over a stage's replicas
        point_metrics_at(module, self._groups.data_parallel)
        if fitting:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        self.install_gradient_clipping()
        self._pipeline = None  # built at the first batch (the model input shows its shapes)

    def _deferred_on_any_rank(self) -> bool:
        """Whether some rank's model has tensors on ``meta`` (built deferred, or holding one
        stage after an earlier run while rank 0 holds the whole model): one answer for every
        rank, so that all or none of them broadcast."""
        assert self.model is not None
        deferred = torch.tensor([int(is_deferred(self.model))])
        if self.world_size > 1 and dist.is_available() and dist.is_initialized():
            dist.all_reduce(deferred, op=dist.ReduceOp.MAX, group=self._cpu_group)
        return bool(deferred.item())

    def prepare_module(self, module: pl.LightningModule, fitting: bool) -> None:
        """Convert layers before the optimizers exist (an engine's hook; default: nothing)."""

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

    # -- the end of fit ----------------------------------------------------------------------

    @override
    def on_train_end(self) -> None:
        super().on_train_end()  # the whole model on rank 0 (PipelineCheckpoints)
        if self.timeline_path is not None:
            self.write_timeline(Path(self.timeline_path))

    def write_timeline(self, path: Path) -> None:
        """Gather every rank's measured events of the last steps; rank 0 writes them."""
        events = [event for step in self.timeline for event in step]
        everything = gather_timeline(events, self.global_rank, self.world_size)
        if everything is not None:
            save_timeline(everything, path, self.timeline_title())

    def timeline_title(self) -> str:
        """The title of the timeline plot."""
        return f"{type(self).__name__}, p={self.stages}"

    @override
    def teardown(self) -> None:
        self.remove_gradient_clipping()
        module = self.lightning_module
        if module is None or not is_deferred(module):
            super().teardown()
            return
        # Lightning moves the module to the CPU, which meta tensors refuse: move what is real
        with patched(module, "cpu", lambda: move_real(module, torch.device("cpu"))):
            super().teardown()
