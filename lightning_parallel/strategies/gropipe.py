"""GroPipe: pipeline parallelism inside groups of ranks, data parallelism across groups.

``GroPipeStrategy(stages=p, micro_batches=m)`` trains an unchanged ``LightningModule`` on
``g·p`` processes: ``g = world_size / p`` groups each run the model as a ``p``-stage pipeline,
and the groups average gradients stage by stage (GroPipe, "Research On Acceleration Method Of
Deep Convolutional Neural Networks Based On Hybrid Parallelism"; IEEE TC 2025). Supported:
automatic optimization, any optimizer and LR scheduler, ``self.log`` (values mirrored to every
rank), torchmetrics, gradient clipping (by value, or by norm across stages), gradient
accumulation, ``ModelCheckpoint``/``EarlyStopping``, validation/test/predict (pipelined
forwards), checkpoints that load under any strategy. The network is ``self.layers`` (an
``nn.Sequential`` with ``forward(x) == self.layers(x)``) or a ``forward`` torch.fx can trace.

Every training step (the automatic-optimization closure calls ``training_step``, then
``zero_grad``, then ``backward``):

1. split the batch into ``m`` micro-batches; stage 0 learns the model inputs by calling the
   user's ``training_step`` with ``forward`` patched to capture its arguments;
2. run this rank's row of the schedule table (GPipe or 1F1B) through the stage runtime; on the
   last stage each micro-batch's loss is the user's ``training_step`` on that micro-batch with
   ``forward`` patched to return the pipeline's output, weighted by ``n_j/N``;
3. each stage starts its gradient allreduce across groups as soon as its last backward is done;
4. one allreduce in the group spreads the loss, the logged values and the stage timings;
   then the stage's gradient allreduce completes (what is still pending is *exposed*);
5. the gradients are stashed (the closure's ``zero_grad`` would wipe them) and put back in
   ``backward``; logged values are replayed through ``self.log`` on every rank.

The last stage of group 0 is global rank 0: Lightning's loggers and progress bar see the real
values. Every rank holds the whole model but only updates its stage; checkpoints, the end of
``fit`` and spawn/fork results gather every stage from its owner first.
"""

from __future__ import annotations

import collections
import json
import math
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch
import torch.distributed as dist
from pytorch_lightning.plugins.precision import MixedPrecision
from pytorch_lightning.trainer.states import TrainerFn
from torch import Tensor, nn
from torch.distributed.constants import default_pg_timeout as DEFAULT_TIMEOUT
from typing_extensions import override

from lightning_parallel.comm.ledger import process_ledger
from lightning_parallel.comm.modules import (
    broadcast_module_states,
    optimizers_to_device,
    reduce_tensor,
)
from lightning_parallel.compat import register_strategy
from lightning_parallel.pipeline.batchnorm import convert_deferred_batch_norm, restore_batch_norm
from lightning_parallel.pipeline.consolidate import (
    broadcast_optimizer_state,
    broadcast_stage_state,
    stage_tensors,
)
from lightning_parallel.pipeline.grad_sync import PartitionGradientSync, SyncTiming
from lightning_parallel.pipeline.microbatch import (
    batch_size,
    merge_microbatches,
    split_microbatches,
)
from lightning_parallel.pipeline.partition import (
    PartitionError,
    PartitionPlan,
    partition,
    projected_step,
)
from lightning_parallel.pipeline.profile import (
    ModelProfile,
    mean_profile,
    profile_layers,
    tensors_of,
)
from lightning_parallel.pipeline.recompute import check_recompute_mode, is_recomputing
from lightning_parallel.pipeline.runtime import StageRuntime, StepStatistics
from lightning_parallel.pipeline.schedule import SCHEDULES, get_schedule
from lightning_parallel.pipeline.stages import (
    PipelineSplitError,
    StageModule,
    check_boundaries,
    even_boundaries,
    layer_sequence,
    pipeline_body,
    split_stages,
)
from lightning_parallel.pipeline.summary import LoggedValue, LogRecorder, StepSummary, SummaryResult
from lightning_parallel.pipeline.timeline import TimelineEvent, events_to_dicts, plot_timeline
from lightning_parallel.pipeline.topology import (
    PLACEMENTS,
    PipelineTopology,
    ProcessGroups,
    build_process_groups,
)
from lightning_parallel.pipeline.transport import StageTransport
from lightning_parallel.pipeline.weight_grad import (
    convert_deferred_weight_gradients,
    restore_linear,
)
from lightning_parallel.strategies.base import ParallelStrategyBase

__all__: list[str] = []


class _InputCaptured(Exception):
    """Raised by the capturing ``forward`` to stop the user's step once the inputs are known."""

    def __init__(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        super().__init__("model input captured")
        self.args, self.kwargs = args, kwargs


@contextmanager
def _patched(target: Any, name: str, replacement: Any) -> Iterator[None]:
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
class _Pipeline:
    """Everything built once the first batch shows the model's input."""

    stages: list[StageModule]
    boundaries: list[int]
    owned: list[list[Tensor]]
    owned_parameters: list[list[nn.Parameter]]
    runtime: StageRuntime
    summary: StepSummary
    plan: PartitionPlan | None


class GroPipeStrategy(ParallelStrategyBase):
    """Train any LightningModule as ``world_size / stages`` data-parallel pipelines.

    Args:
        stages: pipeline stages per group, ``p``; the world size must be a multiple of it.
        micro_batches: micro-batches per batch, ``m`` (more => smaller bubble
            ``(p−1)/(m+p−1)``, smaller and less efficient micro-batches).
        schedule: ``"1f1b"`` (activations of at most ``p−k`` micro-batches on stage ``k``) or
            ``"gpipe"`` (fill-drain, all ``m``).
        partition: ``"auto"`` (profile every layer on rank 0 and split by exact dynamic
            programming), ``"even"`` (same number of layers per stage), or the list of
            ``p−1`` boundaries (index of the first layer of stages 1..p−1).
        recompute: ``"never"``, ``"except_last"`` or ``"always"`` (keep stage inputs only and
            recompute activations in backward: less memory, one more forward).
        deferred_batch_norm: replace BatchNorm layers by deferred BatchNorm during training
            (running statistics over the whole global mini-batch).
        defer_weight_gradients: compute each linear layer's weight gradient once per step over
            all micro-batches instead of once per micro-batch (same sum; far less memory
            traffic for large layers at small micro-batch sizes).
        memory_limit_bytes: most memory a stage may use, for ``partition="auto"``.
        profile_repeats: timed runs per layer for ``partition="auto"``.
        timeline_path: write the measured timeline of the last ``timeline_steps`` training
            steps there at the end of ``fit`` (``.json``, or ``.png`` for a plot).
        timeline_steps: steps of timeline kept in memory.
        placement: ``"pipeline"`` (a group's stages on consecutive ranks: pipelines stay on a
            host, the data-parallel allreduce crosses hosts) or ``"stage"`` (a stage's
            replicas on consecutive ranks: the allreduce stays on a host, activations cross;
            better when gradients outweigh activations).
        start_method: ``"popen"`` (Lightning re-runs the script per process; the right choice
            with torchrun/SLURM), ``"spawn"``, ``"fork"`` or ``"forkserver"``. When processes
            are launched externally the strategy launches nothing, whatever this says.
        **kwargs: Lightning's strategy arguments (``accelerator``, ``parallel_devices``,
            ``cluster_environment``, ``checkpoint_io``, ``precision_plugin``,
            ``process_group_backend``), passed on by :class:`ParallelStrategyBase`.
        timeout: collective timeout.
    """

    strategy_name = "gropipe"
    reports_communication = True
    wraps_in_ddp = False  # no DistributedDataParallel: its keywords are refused

    def __init__(
        self,
        stages: int = 2,
        micro_batches: int = 4,
        schedule: str = "1f1b",
        partition: str | Sequence[int] = "auto",
        recompute: str = "never",
        deferred_batch_norm: bool = True,
        defer_weight_gradients: bool = True,
        memory_limit_bytes: float | None = None,
        profile_repeats: int = 5,
        timeline_path: str | None = None,
        timeline_steps: int = 3,
        placement: str = "pipeline",
        start_method: str = "popen",
        timeout: timedelta | None = DEFAULT_TIMEOUT,
        **kwargs: Any,
    ) -> None:
        if not isinstance(stages, int) or stages < 1:
            raise ValueError(f"stages must be a positive integer, got {stages!r}")
        if not isinstance(micro_batches, int) or micro_batches < 1:
            raise ValueError(f"micro_batches must be a positive integer, got {micro_batches!r}")
        if str(schedule).lower() not in SCHEDULES:
            raise ValueError(f"schedule must be one of {sorted(SCHEDULES)}, got {schedule!r}")
        if isinstance(partition, str):
            if partition not in ("auto", "even"):
                raise ValueError(
                    f"partition must be 'auto', 'even' or a list of {stages - 1} boundaries, "
                    f"got {partition!r}"
                )
        elif len(partition) != stages - 1:
            raise ValueError(
                f"partition lists the first layer of stages 1..{stages - 1}: it needs "
                f"{stages - 1} boundaries, got {list(partition)}"
            )
        check_recompute_mode(recompute)
        if profile_repeats < 1:
            raise ValueError(f"profile_repeats must be at least 1, got {profile_repeats}")
        if timeline_steps < 1:
            raise ValueError(f"timeline_steps must be at least 1, got {timeline_steps}")
        if placement not in PLACEMENTS:
            raise ValueError(
                f"placement must be one of {PLACEMENTS} ('stage' keeps each stage's data-parallel "
                f"allreduce on one host), got {placement!r}"
            )
        super().__init__(
            timeout=timeout,
            start_method=start_method,
            **kwargs,
        )
        self.stages = stages
        self.micro_batches = micro_batches
        self.schedule = get_schedule(schedule)
        self.partition = partition if isinstance(partition, str) else [int(b) for b in partition]
        self.recompute = recompute
        self.deferred_batch_norm = deferred_batch_norm
        self.defer_weight_gradients = defer_weight_gradients
        if memory_limit_bytes is not None and not memory_limit_bytes > 0:
            raise ValueError(
                f"memory_limit_bytes must be > 0 (or None: no limit), got {memory_limit_bytes!r}"
            )
        self.memory_limit_bytes = memory_limit_bytes
        self.profile_repeats = profile_repeats
        self.timeline_path = timeline_path
        self.placement = placement
        self.timeline: collections.deque[list[TimelineEvent]] = collections.deque(
            maxlen=timeline_steps
        )
        self.partition_plan: PartitionPlan | None = None
        self.last_summary: SummaryResult | None = None
        self._topology: PipelineTopology | None = None
        self._groups: ProcessGroups | None = None
        self._pipeline: _Pipeline | None = None
        self._boundaries: list[int] | None = None
        self._replaced_batch_norm: dict[str, Any] = {}
        self._replaced_linear: dict[str, Any] = {}
        self._stash: dict[nn.Parameter, Tensor] = {}
        self._last_sync = SyncTiming()

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

    def setup_environment(self) -> None:
        super().setup_environment()
        topology = PipelineTopology(self.world_size, self.stages, self.placement)
        if self._topology != topology:
            self._topology = topology
            self._groups = build_process_groups(topology, self.global_rank)

    # -- setup and teardown ------------------------------------------------------------------

    def setup(self, trainer: pl.Trainer) -> None:
        assert self.accelerator is not None and self.model is not None
        module = self.lightning_module
        assert module is not None
        if not module.automatic_optimization:
            raise ValueError(
                "GroPipeStrategy needs automatic optimization: the pipeline runs forward and "
                "backward itself. Remove `self.automatic_optimization = False`"
            )
        if (
            isinstance(self.precision_plugin, MixedPrecision)
            and self.precision_plugin.scaler is not None
        ):
            raise ValueError(
                "GroPipeStrategy does not support gradient scaling (precision='16-mixed' on "
                "CUDA); use precision='bf16-mixed' or '32-true'"
            )
        self.accelerator.setup(trainer)
        self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        if self._groups is None:  # a single process without setup_environment (tests)
            self.setup_environment()
        fitting = trainer.state.fn == TrainerFn.FITTING
        # processes started apart (popen, torchrun) initialize differently: start from rank 0's
        broadcast_module_states(self.model)
        if fitting and self.deferred_batch_norm:
            self._replaced_batch_norm = convert_deferred_batch_norm(pipeline_body(module))
        if fitting and self.defer_weight_gradients:
            self._replaced_linear = convert_deferred_weight_gradients(pipeline_body(module))
        self._point_metrics_at_replicas(module)
        if fitting:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        if fitting:
            optimizers_to_device(self.optimizers, self.root_device)
        self._pipeline = None
        setattr(self.precision_plugin, "clip_grad_by_norm", self._clip_grad_by_norm)  # noqa: B010

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

    def teardown(self) -> None:
        module = self.lightning_module
        if module is not None and self._replaced_batch_norm:
            restore_batch_norm(pipeline_body(module), self._replaced_batch_norm)
            self._replaced_batch_norm = {}
        if module is not None and self._replaced_linear:
            restore_linear(pipeline_body(module), self._replaced_linear)
            self._replaced_linear = {}
        if "clip_grad_by_norm" in vars(self.precision_plugin):
            delattr(self.precision_plugin, "clip_grad_by_norm")
        self._pipeline = None
        super().teardown()

    # -- building the pipeline on the first batch --------------------------------------------

    @property
    def _body(self) -> nn.Module:
        assert self.lightning_module is not None
        return pipeline_body(self.lightning_module)

    def _capture(self, hook: str, micro_batch: Any, hook_args: Sequence[Any]) -> tuple[Any, ...]:
        module = self.lightning_module
        assert module is not None

        def capture(*args: Any, **kwargs: Any) -> Any:
            raise _InputCaptured(args, kwargs)

        with (
            _patched(self._body, "forward", capture),
            _patched(module, "log", lambda *a, **k: None),
        ):
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

    def _ensure_pipeline(self, example_args: tuple[Any, ...]) -> _Pipeline:
        if self._pipeline is not None:
            return self._pipeline
        module = self.lightning_module
        assert module is not None and self._topology is not None and self._groups is not None
        body = self._body
        with torch.inference_mode(False), torch.enable_grad():
            example = _normal_tensors(example_args)
            if body is not module:
                self._check_forward_is_layers(module, body, example)
            layers = layer_sequence(body, example)
            boundaries, plan = self._choose_boundaries(layers, example)
        stages = split_stages(layers, boundaries)
        staged = {id(t) for stage in stages for t in stage_tensors(stage)}
        # parameters and buffers outside the split body (used in training_step) go with the
        # last stage, which is where training_step runs
        extra = [t for t in [*module.parameters(), *module.buffers()] if id(t) not in staged]
        owned = [stage_tensors(stage) for stage in stages]
        owned[-1] = owned[-1] + [t for t in extra if id(t) not in {id(x) for x in owned[-1]}]
        owned_parameters = [
            [t for t in tensors if isinstance(t, nn.Parameter)] for tensors in owned
        ]
        topology, groups, k = self._topology, self._groups, self.stage_index
        transport = None
        if self.stages > 1:
            transport = StageTransport(
                k, topology.pipeline_ranks(self.group_index), groups.pipeline, self.root_device
            )
        sync = PartitionGradientSync(owned_parameters[k], groups.data_parallel, topology.groups)
        runtime = StageRuntime(
            stages[k],
            k,
            self.stages,
            transport,
            recompute=self.recompute,
            gradient_sync=sync,
            batch_norm_group=groups.data_parallel,
            reduce_batch_norm=topology.groups > 1,
            rank=self.global_rank,
        )
        summary = StepSummary(
            self.stages, k, groups.pipeline, topology.rank(self.group_index, self.stages - 1)
        )
        self._boundaries, self.partition_plan = boundaries, plan
        for index, boundary in enumerate(boundaries):  # which split ran, in every record
            process_ledger().set_gauge(f"partition_boundary_{index}", float(boundary))
        self._pipeline = _Pipeline(
            stages, boundaries, owned, owned_parameters, runtime, summary, plan
        )
        return self._pipeline

    @staticmethod
    def _check_forward_is_layers(
        module: nn.Module, body: nn.Module, example: tuple[Any, ...]
    ) -> None:
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
        # "auto": every rank profiles at the same time, so that the timings see what training
        # will see (the other ranks computing beside it, sharing cores and memory bandwidth);
        # the per-layer times are averaged over ranks and every rank partitions the same way
        try:
            mine: ModelProfile | str = profile_layers(
                layers, example, repeats=self.profile_repeats, micro_batches=self.micro_batches
            )
        except (PartitionError, PipelineSplitError) as error:
            mine = str(error)
        profiles: list[Any] = [mine]
        if dist.is_available() and dist.is_initialized() and self.world_size > 1:
            profiles = [None] * self.world_size
            dist.all_gather_object(profiles, mine)
        errors = [p for p in profiles if isinstance(p, str)]
        if errors:
            raise PartitionError(errors[0])
        plan = partition(
            mean_profile(profiles),
            self.stages,
            self.micro_batches,
            schedule=self.schedule.name,
            recompute=self.recompute,
            memory_limit_bytes=self.memory_limit_bytes,
        )
        return list(plan.boundaries), plan

    # -- the training step -------------------------------------------------------------------

    def _take_gradients(self) -> dict[nn.Parameter, Tensor]:
        assert self.lightning_module is not None
        taken = {}
        for parameter in self.lightning_module.parameters():
            if parameter.grad is not None:
                taken[parameter] = parameter.grad
                parameter.grad = None
        return taken

    @staticmethod
    def _give_gradients(gradients: dict[nn.Parameter, Tensor]) -> None:
        for parameter, gradient in gradients.items():
            parameter.grad = gradient if parameter.grad is None else parameter.grad + gradient

    def _user_step(
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
        with _patched(self._body, "forward", lambda *a, **k: output), _patched(module, "log", log):
            return getattr(module, hook)(micro_batch, *hook_args)

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        module = self.lightning_module
        assert module is not None
        trainer = module.trainer
        batch, hook_args = args[0], args[1:]
        self.set_activity(f"pipeline schedule (stage {self.stage_index} of {self.stages})")
        micro = split_microbatches(batch, self.micro_batches)
        sizes = [batch_size(part) for part in micro]
        total = sum(sizes)
        count = len(micro)
        first = self.stage_index == 0
        inputs = None
        if first or self._pipeline is None:  # others capture once, to build the pipeline
            inputs = [
                self._capture("training_step", part, hook_args)
                for part in (micro if first else micro[:1])
            ]
        pipeline = self._ensure_pipeline(inputs[0] if inputs else ())
        scale = 1.0 / trainer.accumulate_grad_batches
        recorder = LogRecorder()
        results: dict[int, Any] = {}

        def loss_fn(index: int, output: Any) -> Tensor:
            live = None if is_recomputing() else recorder
            if live is not None:
                live.start_micro_batch(sizes[index] / total)
            result = self._user_step("training_step", micro[index], hook_args, output, live)
            results[index] = result
            loss = result.get("loss") if isinstance(result, dict) else result
            if not isinstance(loss, Tensor):
                raise ValueError(
                    "training_step must return the loss tensor (or a dict with 'loss') for every "
                    "micro-batch under GroPipeStrategy; skipping a step is not supported"
                )
            return loss * (sizes[index] / total * scale)

        previous = self._take_gradients()
        with self.precision_plugin.train_step_context():
            stats = self._run_training(pipeline, batch, count, inputs, loss_fn)
        loss = float(sum(float(v) for v in stats.losses.values())) / scale
        summary = pipeline.summary.exchange(
            loss,
            stats.busy_seconds,
            stats.step_seconds,
            self._last_sync.duration,
            self._last_sync.exposed,
            recorder.combined() if pipeline.runtime.is_last else (),
            stats.wait_seconds,
        )
        self._last_sync = self._finish_gradients(pipeline)
        self._stash = self._take_gradients()
        self._give_gradients(previous)
        self._record(summary, stats, count)
        self._replay(summary.logged)
        loss_tensor = torch.tensor(summary.loss, device=self.root_device)
        last = results.get(count - 1)
        if isinstance(last, dict):
            return {**{k: v for k, v in last.items() if k != "loss"}, "loss": loss_tensor}
        return loss_tensor

    def _run_training(
        self,
        pipeline: _Pipeline,
        batch: Any,
        count: int,
        inputs: list[tuple[Any, ...]] | None,
        loss_fn: Callable[[int, Any], Tensor],
    ) -> StepStatistics:
        """Forward and backward of every micro-batch on this stage (the engine; a subclass may
        run another one). ``inputs``: stage 0's model arguments per micro-batch."""
        runtime = pipeline.runtime
        return runtime.run_step(
            self.schedule.table(self.stages, count)[self.stage_index],
            count,
            inputs if runtime.is_first else None,
            loss_fn if runtime.is_last else None,
        )

    def _finish_gradients(self, pipeline: _Pipeline) -> SyncTiming:
        """Complete this stage's gradient averaging across groups (after the group's summary)."""
        return pipeline.runtime.finish_gradient_sync()

    def backward(self, closure_loss: Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> Tensor:
        """Hand back the gradients the pipeline computed in ``training_step``."""
        module = self.lightning_module
        assert module is not None
        closure_loss = self.precision_plugin.pre_backward(closure_loss, module)
        self._give_gradients(self._stash)
        self._stash = {}
        return self.precision_plugin.post_backward(closure_loss, module)

    def _clip_grad_by_norm(self, optimizer: Any, clip_val: float) -> None:
        """``clip_grad_norm_`` with the norm of the whole model: each stage's squared norm is
        summed over the pipeline group."""
        assert self._groups is not None
        parameters = [p for p in self.precision_plugin.main_params(optimizer) if p.grad is not None]
        device = parameters[0].grad.device if parameters else self.root_device  # type: ignore[union-attr]
        squares = torch.zeros(1, dtype=torch.float64, device=device)
        for parameter in parameters:
            assert parameter.grad is not None
            squares += parameter.grad.detach().double().pow(2).sum()
        if self.stages > 1:
            dist.all_reduce(squares, group=self._groups.pipeline)
        coefficient = float(clip_val) / (math.sqrt(float(squares)) + 1e-6)
        if coefficient < 1.0:
            for parameter in parameters:
                assert parameter.grad is not None
                parameter.grad.mul_(coefficient)

    # -- evaluation --------------------------------------------------------------------------

    def _evaluation_step(self, hook: str, context: Callable[[], Any], args: tuple[Any, ...]) -> Any:
        batch, hook_args = args[0], args[1:]
        micro = split_microbatches(batch, self.micro_batches)
        first = self.stage_index == 0
        inputs = None
        if first or self._pipeline is None:
            inputs = [
                self._capture(hook, part, hook_args) for part in (micro if first else micro[:1])
            ]
        pipeline = self._ensure_pipeline(inputs[0] if inputs else ())
        runtime = pipeline.runtime
        with context():
            stats = runtime.run_forward_only(len(micro), inputs if first else None)
        result = None
        recorder = LogRecorder()
        if runtime.is_last:
            merged = merge_microbatches([stats.outputs[j] for j in range(len(micro))])
            with context():
                result = self._user_step(hook, batch, hook_args, merged, recorder)
        summary = pipeline.summary.exchange(logged=recorder.combined() if runtime.is_last else ())
        self._replay(summary.logged)
        return result

    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._evaluation_step(
            "validation_step", self.precision_plugin.val_step_context, args
        )

    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._evaluation_step("test_step", self.precision_plugin.test_step_context, args)

    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._evaluation_step(
            "predict_step", self.precision_plugin.predict_step_context, args
        )

    # -- logging and telemetry ---------------------------------------------------------------

    def _replay(self, logged: Sequence[LoggedValue]) -> None:
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

    def _record(self, summary: SummaryResult, stats: StepStatistics, count: int) -> None:
        self.last_summary = summary
        self.timeline.append(list(stats.events))
        ledger = process_ledger()
        ledger.set_gauge("bubble_fraction", summary.bubble_fraction)
        ledger.set_gauge("bubble_wait_fraction", summary.wait_fraction)
        plan = self.partition_plan
        projected = (self.stages - 1) / (count + self.stages - 1)
        if plan is not None and count == plan.micro_batches:
            projected = plan.bubble_fraction
        ledger.set_gauge("bubble_fraction_projected", projected)
        measured = [busy / count for busy in summary.busy_seconds]
        # the partitioner's formula on the measured stage times: tells the schedule's own
        # behaviour apart from a profile taken in other conditions (load, frequency)
        ledger.set_gauge("bubble_fraction_model", projected_step(measured, count)[1])
        for stage, busy in enumerate(summary.busy_seconds):
            ledger.set_gauge(f"stage{stage}_seconds_measured", busy / count)
            if plan is not None:
                ledger.set_gauge(f"stage{stage}_seconds_projected", plan.stage_seconds[stage])
        ledger.set_gauge("peak_activation_bytes", float(stats.peak_activation_bytes))
        if self.groups > 1:
            synced, exposed = sum(summary.sync_seconds), sum(summary.exposed_seconds)
            ledger.set_gauge("allreduce_seconds", synced)
            ledger.set_gauge("allreduce_exposed_seconds", exposed)
            if synced > 0:
                ledger.set_gauge("allreduce_hidden_fraction", max(0.0, 1.0 - exposed / synced))

    # -- collectives Lightning asks for ------------------------------------------------------

    def reduce(self, tensor: Any, group: Any | None = None, reduce_op: Any | None = "mean") -> Any:
        """Reduce over the data-parallel replicas of this stage (values are mirrored inside a
        pipeline, so a world-wide mean would count each replica ``p`` times)."""
        if not isinstance(tensor, Tensor):
            return tensor
        if group is None and self._groups is not None:
            group = self._groups.data_parallel
        return reduce_tensor(tensor, group, reduce_op=reduce_op)

    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        value = torch.tensor(int(decision), device=self.root_device)
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(value)
        return bool(value == self.world_size) if all else bool(value)

    # -- a consolidated model and checkpoint -------------------------------------------------

    def _owners(self) -> list[int]:
        assert self._topology is not None
        return [self._topology.rank(0, stage) for stage in range(self.stages)]

    def consolidate(self) -> None:
        """Give every rank every stage's current weights (collective: all ranks call it)."""
        if self._pipeline is None or self.world_size == 1:
            return
        broadcast_stage_state(self._pipeline.owned, self._owners(), self.stage_index)

    def lightning_module_state_dict(self) -> dict[str, Any]:
        self.consolidate()
        return super().lightning_module_state_dict()

    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        if self._pipeline is not None and self.world_size > 1:
            inner = getattr(optimizer, "_optimizer", optimizer)
            broadcast_optimizer_state(
                inner, self._pipeline.owned_parameters, self._owners(), self.stage_index
            )
        return super().optimizer_state(optimizer)

    def on_train_end(self) -> None:
        self.consolidate()
        if self.timeline_path is not None:
            self._write_timeline(Path(self.timeline_path))

    def _write_timeline(self, path: Path) -> None:
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
            plot_timeline(everything, path, title=f"GroPipe, {self.schedule.name}, p={self.stages}")
        else:
            path.write_text(json.dumps(events_to_dicts(everything)))


register_strategy(
    "gropipe",
    GroPipeStrategy,
    "GroPipe: pipeline stages inside groups, data parallel across groups (micro-batches, "
    "auto partition, per-stage delayed allreduce)",
)
