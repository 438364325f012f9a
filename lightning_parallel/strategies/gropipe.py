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

The Lightning side shared with SpecTrain and the bench's pipeline peers (placement, assembly,
stage ownership, the user's step methods, logging, evaluation, checkpoints) is
:class:`~lightning_parallel.strategies.pipeline_base.PipelineStrategyBase`: the last stage of
group 0 is global rank 0 (Lightning's loggers and progress bar see the real values), and each
rank holds only its own stage's parameters, gradients and optimizer state.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import pytorch_lightning as pl
import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.constants import default_pg_timeout as DEFAULT_TIMEOUT
from typing_extensions import override

from lightning_parallel.comm.devices import to_group
from lightning_parallel.comm.ledger import process_ledger
from lightning_parallel.comm.modules import optimizers_to_device
from lightning_parallel.compat import register_strategy
from lightning_parallel.pipeline.assembly import Pipeline
from lightning_parallel.pipeline.batchnorm import convert_deferred_batch_norm, restore_batch_norm
from lightning_parallel.pipeline.grad_sync import SyncTiming
from lightning_parallel.pipeline.microbatch import MicroBatchStep
from lightning_parallel.pipeline.partition import projected_step
from lightning_parallel.pipeline.recompute import check_recompute_mode, is_recomputing
from lightning_parallel.pipeline.runtime import StepStatistics
from lightning_parallel.pipeline.schedule import SCHEDULES, Schedule, get_schedule
from lightning_parallel.pipeline.stages import pipeline_body
from lightning_parallel.pipeline.summary import LogRecorder, SummaryResult
from lightning_parallel.pipeline.weight_grad import (
    convert_deferred_weight_gradients,
    restore_linear,
)
from lightning_parallel.strategies.pipeline_base import PipelineStrategyBase

__all__: list[str] = []


class GroPipeStrategy(PipelineStrategyBase):
    """Train any LightningModule as ``world_size / stages`` data-parallel pipelines.

    Args:
        stages: pipeline stages per group, ``p``; the world size must be a multiple of it.
        micro_batches: micro-batches per batch, ``m`` (more => smaller bubble
            ``(p−1)/(m+p−1)``, smaller and less efficient micro-batches).
        schedule: ``"1f1b"`` (activations of at most ``p−k`` micro-batches on stage ``k``) or
            ``"gpipe"`` (fill-drain, all ``m``).
        partition: ``"auto"`` (profile every layer and split by exact dynamic programming,
            then time the plan and the even split as whole stages and keep the faster; a
            model built on ``meta`` in ``configure_model`` is estimated from its shapes),
            ``"estimate"`` (every model estimated from its shapes: FLOPs and bytes, the same
            partition on every run), ``"even"`` (same number of layers per stage), or the list
            of ``p−1`` boundaries
            (index of the first layer of stages 1..p−1).
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
        module: the submodule to split, by name (``"net"``, ``"model.backbone"``). By default
            ``self.layers`` if it is an ``nn.Sequential``, else the module that
            ``training_step`` calls with the batch, found on the first micro-batch
            (``self(x)``: the ``LightningModule``; ``self.net(x)``: ``net``). Parameters
            outside it belong to the last stage (see :mod:`lightning_parallel.pipeline.discovery`).
        split_points: the module that starts each of stages 1..p−1, by name relative to the
            split module (``["layer3"]``, ``["blocks.6"]``), instead of ``partition``; a stage
            starts at the first layer that runs the module's code.
        placement: ``"pipeline"`` (a group's stages on consecutive ranks: pipelines stay on a
            host, the data-parallel allreduce crosses hosts) or ``"stage"`` (a stage's
            replicas on consecutive ranks: the allreduce stays on a host, activations cross;
            better when gradients outweigh activations).
        start_method: ``"popen"`` (Lightning re-runs the script per process; the right choice
            with torchrun/SLURM), ``"spawn"``, ``"fork"`` or ``"forkserver"``. When processes
            are launched externally the strategy launches nothing, whatever this says.
        timeout: collective timeout.
        **kwargs: Lightning's strategy arguments (``accelerator``, ``parallel_devices``,
            ``cluster_environment``, ``checkpoint_io``, ``precision_plugin``,
            ``process_group_backend``), passed on by :class:`ParallelStrategyBase`.
    """

    schedule: Schedule  # always one (the base's may be None: a pipeline without a schedule)

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
        module: str | None = None,
        split_points: Sequence[str] | None = None,
        start_method: str = "popen",
        timeout: timedelta | None = DEFAULT_TIMEOUT,
        **kwargs: Any,
    ) -> None:
        if str(schedule).lower() not in SCHEDULES:
            raise ValueError(f"schedule must be one of {sorted(SCHEDULES)}, got {schedule!r}")
        check_recompute_mode(recompute)
        super().__init__(
            stages=stages,
            micro_batches=micro_batches,
            partition=partition,
            memory_limit_bytes=memory_limit_bytes,
            profile_repeats=profile_repeats,
            placement=placement,
            timeline_path=timeline_path,
            timeline_steps=timeline_steps,
            module=module,
            split_points=split_points,
            start_method=start_method,
            timeout=timeout,
            **kwargs,
        )
        self.schedule = get_schedule(schedule)
        self.recompute = recompute
        self.deferred_batch_norm = deferred_batch_norm
        self.defer_weight_gradients = defer_weight_gradients
        self.last_summary: SummaryResult | None = None
        self._replaced_batch_norm: dict[str, Any] = {}
        self._replaced_linear: dict[str, Any] = {}
        self._stash: dict[nn.Parameter, Tensor] = {}
        self._last_sync = SyncTiming()

    # -- setup and teardown ------------------------------------------------------------------

    @override
    def prepare_module(self, module: pl.LightningModule, fitting: bool) -> None:
        body = pipeline_body(module)
        if fitting and self.deferred_batch_norm:
            self._replaced_batch_norm = convert_deferred_batch_norm(body)
        if fitting and self.defer_weight_gradients:
            self._replaced_linear = convert_deferred_weight_gradients(body)

    @override
    def held_elsewhere(self) -> list[nn.Module]:
        return [*self._replaced_batch_norm.values(), *self._replaced_linear.values()]

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        super().setup(trainer)
        if self.optimizers:
            optimizers_to_device(self.optimizers, self.root_device)

    @override
    def teardown(self) -> None:
        module = self.lightning_module
        if module is not None and (self._replaced_batch_norm or self._replaced_linear):
            body = pipeline_body(module)
            by_name = {**self._replaced_batch_norm, **self._replaced_linear}
            originals = {body.get_submodule(name): layer for name, layer in by_name.items()}
            restore_batch_norm(body, self._replaced_batch_norm)
            restore_linear(body, self._replaced_linear)
            self.put_back_layers(originals)
        self._replaced_batch_norm, self._replaced_linear = {}, {}
        super().teardown()

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

    @override
    def train_micro_batches(
        self, pipeline: Pipeline, step: MicroBatchStep, inputs: list[tuple[Any, ...]] | None
    ) -> float:
        """Run the schedule, then exchange the step's summary and stash the gradients."""
        assert self.lightning_module is not None
        trainer = self.lightning_module.trainer
        hook_args, count = step.hook_args, step.count
        scale = 1.0 / trainer.accumulate_grad_batches
        recorder = LogRecorder()

        def loss_fn(index: int, output: Any) -> Tensor:
            live = None if is_recomputing() else recorder
            if live is not None:
                live.start_micro_batch(step.weight(index))
            result = self.user_step("training_step", step.micro[index], hook_args, output, live)
            loss = step.loss_of(index, result, "GroPipeStrategy")
            return loss * (step.weight(index) * scale)

        previous = self._take_gradients()
        if (
            hook_args
            and isinstance(hook_args[0], int)
            and hook_args[0] % trainer.accumulate_grad_batches == 0
        ):
            # the first batch of an accumulation window: Lightning zeroes the gradients right
            # after this step, so the last step's need not live beside the new ones
            previous = {}
        with self.precision_plugin.train_step_context():
            stats = self.run_schedule(pipeline, step.batch, count, inputs, loss_fn)
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
        self._last_sync = self.finish_gradients(pipeline)
        if pipeline.tied:  # the step's gradients of tied tensors, summed over their stages
            pipeline.tied.sum_gradients()
        self._stash = self._take_gradients()
        self._give_gradients(previous)
        self.record(summary, stats, count)
        self.replay(summary.logged)
        return summary.loss

    def run_schedule(
        self,
        pipeline: Pipeline,
        batch: Any,
        count: int,
        inputs: list[tuple[Any, ...]] | None,
        loss_fn: Callable[[int, Any], Tensor],
    ) -> StepStatistics:
        """Forward and backward of every micro-batch on this stage: the engine. A subclass (a
        bench peer) may run another one.

        Args:
            pipeline: this rank's part of the pipeline.
            batch: the whole batch.
            count: micro-batches.
            inputs: stage 0's model arguments per micro-batch (``None`` elsewhere).
            loss_fn: on the last stage, the loss of micro-batch ``j`` from its output.
        """
        runtime = pipeline.runtime
        return runtime.run_step(
            self.schedule.table(self.stages, count)[self.stage_index],
            count,
            inputs if runtime.is_first else None,
            loss_fn if runtime.is_last else None,
        )

    def finish_gradients(self, pipeline: Pipeline) -> SyncTiming:
        """Complete this stage's gradient averaging across groups (after the group's summary;
        an engine's hook)."""
        return pipeline.runtime.finish_gradient_sync()

    @override
    def hand_back_gradients(self) -> None:
        """Put back the gradients :meth:`train_micro_batches` stashed."""
        self._give_gradients(self._stash)
        self._stash = {}

    @override
    def gradient_norm(self, optimizer: Any) -> tuple[float, list[nn.Parameter]]:
        """The norm of the whole model: each stage's squared norm summed over the pipeline
        group."""
        assert self._groups is not None
        parameters = [p for p in self.precision_plugin.main_params(optimizer) if p.grad is not None]
        tied = self._pipeline.tied if self._pipeline is not None else None
        counted = [p for p in parameters if tied is None or tied.counted(p)]
        device = parameters[0].grad.device if parameters else self.root_device  # type: ignore[union-attr]
        squares = torch.zeros(1, dtype=torch.float64, device=device)
        for parameter in counted:  # a tied tensor once, on the first stage holding it
            assert parameter.grad is not None
            squares += parameter.grad.detach().double().pow(2).sum()
        if self.stages > 1:
            squares = to_group(squares, self._groups.pipeline)
            dist.all_reduce(squares, group=self._groups.pipeline)
        return math.sqrt(float(squares)), parameters

    # -- telemetry ---------------------------------------------------------------------------

    def record(self, summary: SummaryResult, stats: StepStatistics, count: int) -> None:
        """Put the step's bubble, stage times, step bound and allreduce figures in the ledger's
        gauges."""
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
        # what a flushing schedule cannot beat: m + p − 1 slots of the slowest stage's measured
        # micro-batch, plus the gradient allreduce left exposed (the stages wait in parallel)
        exposed = max(summary.exposed_seconds, default=0.0)
        bound = (count + self.stages - 1) * max(measured, default=0.0) + exposed
        ledger.set_gauge("pipeline_step_bound_seconds", bound)
        if bound > 0:
            ledger.set_gauge("pipeline_step_over_bound", max(summary.step_seconds) / bound)
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

    @override
    def timeline_title(self) -> str:
        return f"GroPipe, {self.schedule.name}, p={self.stages}"


register_strategy(
    "gropipe",
    GroPipeStrategy,
    "GroPipe: pipeline stages inside groups, data parallel across groups (micro-batches, "
    "auto partition, per-stage delayed allreduce)",
)
