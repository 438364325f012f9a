"""SpecTrain: a pipeline that never flushes, with the weights each pass uses predicted.

``SpecTrainStrategy(stages=p)`` trains an unchanged ``LightningModule`` as ``world_size / p``
data-parallel pipelines of ``p`` stages ("Efficient and Robust Pipeline Design for Multi-GPU
DNN Training through Model Parallelism", published as SpecTrain, Chen et al. 2018). Unlike
``gropipe`` the pipeline is asynchronous: each micro-batch is one weight update, stages update
independently right after each backward, and micro-batches stay in flight from one
``training_step`` to the next (:mod:`lightning_parallel.pipeline.noflush`), so the pipeline
fills once per epoch instead of once per step. Stage ``k`` applies gradients ``N-k-1`` updates
stale; ``prediction`` chooses the correction
(:mod:`lightning_parallel.pipeline.noflush.predictors`), and by default a stale stage steps with
the share ρ of the optimizer's learning rate that keeps the synchronous stability margin
(``learning_rate_scale="staleness"``: a gradient τ = N-k-1 updates stale under momentum μ
tolerates a far smaller step, ρ = 0.071 for v2 at τ = 1, μ = 0.9; prediction alone does not
restore it).

It shares the Lightning integration of every pipeline here
(:class:`~lightning_parallel.strategies.pipeline_base.PipelineStrategyBase`): placement (the
last stage of group 0 is global rank 0), partitioning, stage ownership (a rank holds only its
stage), capture of the model input on stage 0, ``forward`` patched on the last stage so the
user's ``training_step`` computes the loss of the pipeline output, validation/test/predict as
pipelined forwards, per-group samplers, consolidated checkpoints that load under ``ddp`` or on
one device (each stage's predictor state in them too). What differs, per training step on
every rank:

1. split the batch into ``micro_batches`` units and run them through the no-flush runtime: for
   each unit, the forward of this unit and the backward of the one ``N-k-1`` units older, then
   the stage's update (gradients averaged across groups first, then Lightning's
   ``on_before_optimizer_step`` hooks and gradient clipping, then ``optimizer.step()``);
2. the last stage logs what ``training_step`` logged (one combined value per step) and the
   loss; an *asynchronous* allreduce in the pipeline group carries those values and each
   stage's staleness, prediction error and bubble to every rank, completed at the next step
   (no per-step synchronization of the stages: ranks other than the last stage see training
   values one step late; at the last batch of an epoch the exchange completes at once);
3. Lightning's own ``optimizer.step`` becomes a no-op (the runtime already updated).

The pipeline drains (no sample lost or counted twice) before validation, at the end of every
epoch, before a checkpoint and at the end of ``fit``. Gradient clipping by norm uses the norm
of the update's gradient over all stages as the runtime estimates it without waiting (exact on
stage 0; on stage k the share of stages k..N-1 is exact, the upstream share is taken from the
newest update whose total is known); by value is local. ``accumulate_grad_batches`` must be 1.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import pytorch_lightning as pl
import torch
import torch.distributed as dist
from pytorch_lightning.callbacks import Callback
from pytorch_lightning.trainer.states import TrainerFn
from torch import Tensor, nn
from torch.distributed.constants import default_pg_timeout as DEFAULT_TIMEOUT
from typing_extensions import override

from lightning_parallel.comm.devices import side_group
from lightning_parallel.comm.ledger import process_ledger
from lightning_parallel.compat import register_strategy
from lightning_parallel.compat.private import after_closure
from lightning_parallel.pipeline.assembly import Pipeline
from lightning_parallel.pipeline.grad_sync import PartitionGradientSync
from lightning_parallel.pipeline.microbatch import MicroBatchStep
from lightning_parallel.pipeline.noflush import (
    LearningRateForecast,
    NoFlushPipeline,
    ScheduledLearningRate,
    default_prediction,
    make_weight_predictor,
)
from lightning_parallel.pipeline.noflush.mirror import (
    AsyncMirror,
    Mirrored,
    publish_telemetry,
    telemetry_figures,
)
from lightning_parallel.pipeline.noflush.options import check_options, stage_learning_rate_scale
from lightning_parallel.pipeline.summary import LoggedValue, LogRecorder
from lightning_parallel.pipeline.tied import DelayedTiedSum
from lightning_parallel.strategies.pipeline_base import PipelineStrategyBase, patched

__all__: list[str] = []


class _DrainAtEpochEnd(Callback):
    """Drain the pipeline at the end of every training epoch."""

    def __init__(self, strategy: SpecTrainStrategy) -> None:
        self.strategy = strategy

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.strategy.drain()


class SpecTrainStrategy(PipelineStrategyBase):
    """Train any LightningModule as asynchronous no-flush pipelines with weight prediction.

    Args:
        stages: pipeline stages per group, ``N``; the world size must be a multiple of it.
        micro_batches: units per batch; every unit is one weight update (1: the batch is the
            unit, as in the paper).
        prediction: ``"auto"`` (default: ``"v2"`` under Adam/AdamW and with 2 stages,
            ``"none"`` for other optimizers with more stages: the measured winners, see
            ``docs/spectrain.md``),
            ``"v2"`` (forward and backward on the weights predicted ``N-k-1`` updates
            ahead), ``"v1"`` (the paper: forward ``⌊k/2⌋+N-k-1``, backward ``⌊k/2⌋`` ahead),
            ``"stash"`` (PipeDream weight stashing), ``"2bw"`` (double-buffered weights,
            one update per ``N`` units), ``"none"`` or ``None`` (stale weights).
        learning_rates: ``"schedule"`` (predict with the scheduler's own next learning rates
            when one is configured) or ``"constant"`` (``s·η``).
        direction: ``"auto"`` (Adam's update direction for Adam/AdamW, SGD's momentum buffer
            for SGD with momentum, else the smoothed gradient), ``"smoothed_gradient"``,
            ``"momentum_buffer"`` or ``"adam"``.
        gamma: smoothing of the gradient (default: the optimizer's momentum, else 0.9).
        learning_rate_scale: ``"staleness"`` (stage ``k`` multiplies its learning rate by the
            ratio of the largest stable step of heavy ball with its delay τ_k = N-k-1 and this
            ``prediction`` to the synchronous one, 1 on the last stage; 0.071 for v2 and 0.026
            for ``"none"`` at τ = 1 and momentum 0.9, see ``staleness_learning_rate_scale`` in
            :mod:`~lightning_parallel.pipeline.noflush.stability`), ``"none"``/``None``/1
            (every stage at the optimizer's rate) or a factor in (0, 1] for every stale stage.
        partition: ``"auto"``, ``"estimate"``, ``"even"`` or the ``N-1`` stage boundaries (see
            ``gropipe``).
        error_sample: coordinates per stage the online prediction error samples (0: off).
        timeline_path: write the measured timeline of the last ``timeline_steps`` steps there
            at the end of ``fit`` (``.json``, or ``.png`` for a plot).
        timeline_steps: steps of timeline kept.
        module: the submodule to split, by name; ``split_points``: the modules that start
            stages 1..p−1, instead of ``partition``. Both as for
            :class:`~lightning_parallel.strategies.gropipe.GroPipeStrategy`.
        start_method: ``"popen"``, ``"spawn"``, ``"fork"`` or ``"forkserver"``; nothing is
            launched when processes are started externally (torchrun, SLURM, the benchmark).
        **kwargs: Lightning's strategy arguments (``accelerator``, ``parallel_devices``,
            ``cluster_environment``, ``checkpoint_io``, ``precision_plugin``,
            ``process_group_backend``), passed on by :class:`ParallelStrategyBase`.
        timeout: collective timeout.
    """

    reports_communication = True
    step_activity = "no-flush pipeline"
    flushes = False

    def __init__(
        self,
        stages: int = 2,
        micro_batches: int = 1,
        prediction: str | None = "auto",
        learning_rates: str = "schedule",
        direction: str = "auto",
        gamma: float | None = None,
        learning_rate_scale: str | float | None = "staleness",
        partition: str | Sequence[int] = "auto",
        error_sample: int = 4096,
        timeline_path: str | None = None,
        timeline_steps: int = 3,
        module: str | None = None,
        split_points: Sequence[str] | None = None,
        start_method: str = "popen",
        timeout: timedelta | None = DEFAULT_TIMEOUT,
        **kwargs: Any,
    ) -> None:
        prediction, learning_rate_scale = check_options(
            prediction, learning_rates, direction, gamma, learning_rate_scale, error_sample
        )
        super().__init__(
            stages=stages,
            micro_batches=micro_batches,
            partition=partition,
            timeline_path=timeline_path,
            timeline_steps=timeline_steps,
            module=module,
            split_points=split_points,
            start_method=start_method,
            timeout=timeout,
            **kwargs,
        )
        self.prediction = prediction
        self.learning_rates = learning_rates
        self.direction = direction
        self.gamma = gamma
        self.learning_rate_scale = learning_rate_scale
        self.error_sample = error_sample
        self.last_mirrored: Mirrored | None = None
        self._noflush: NoFlushPipeline | None = None
        self._tied: DelayedTiedSum | None = None
        self._mirror: AsyncMirror | None = None
        self._mirror_groups: list[dist.ProcessGroup] | None = None
        self._loaded_state: dict[str, Any] | None = None
        self._callback = _DrainAtEpochEnd(self)
        self._timeline_from = 0

    @property
    def noflush(self) -> NoFlushPipeline | None:
        """This rank's no-flush stage runtime (built at the first training batch)."""
        return self._noflush

    # -- setup ---------------------------------------------------------------------------------

    @override
    def strategy_callbacks(self, trainer: pl.Trainer) -> list[Callback]:
        return [self._callback]

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        if self.stages > 1 and self._mirror_groups is None and self._topology is not None:
            # a gloo group of its own (host values), so the asynchronous exchange never queues
            # behind other work
            self._mirror_groups = [
                side_group(self._topology.pipeline_ranks(group))
                for group in range(self._topology.groups)
            ]

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        if trainer.state.fn == TrainerFn.FITTING and trainer.accumulate_grad_batches != 1:
            raise ValueError(
                "SpecTrainStrategy updates the weights after every micro-batch; "
                f"accumulate_grad_batches={trainer.accumulate_grad_batches} is not supported. "
                "Use accumulate_grad_batches=1 (prediction='2bw' accumulates N micro-batches "
                "per update)"
            )
        super().setup(trainer)
        if trainer.state.fn == TrainerFn.FITTING and len(self.optimizers) != 1:
            raise ValueError(
                f"SpecTrainStrategy needs exactly one optimizer, got {len(self.optimizers)}"
            )
        self._noflush, self._tied = None, None
        self._mirror = None

    @override
    def gradient_sync(self, parameters: list[nn.Parameter]) -> PartitionGradientSync | None:
        return None  # the no-flush runtime averages every update across groups itself

    @override
    def teardown(self) -> None:
        self._noflush, self._tied = None, None
        self._mirror = None
        super().teardown()

    def _forecast(self, optimizer: torch.optim.Optimizer, count: int) -> LearningRateForecast:
        trainer = self.lightning_module.trainer  # type: ignore[union-attr]
        configs = [c for c in trainer.lr_scheduler_configs if c.scheduler.optimizer is optimizer]
        if self.learning_rates == "constant" or len(configs) != 1:
            return LearningRateForecast(optimizer)
        config = configs[0]
        if isinstance(config.scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
            return LearningRateForecast(optimizer)
        per_step = count * max(int(config.frequency), 1)
        if config.interval == "epoch":
            per_step *= max(int(trainer.num_training_batches), 1)
        return ScheduledLearningRate(optimizer, config.scheduler, per_step)  # type: ignore[arg-type]

    def _ensure_noflush(self, count: int) -> NoFlushPipeline:
        if self._noflush is not None:
            return self._noflush
        assert self._pipeline is not None and self._groups is not None
        assert self._topology is not None
        module = self.lightning_module
        assert module is not None
        k = self.stage_index
        optimizer = self.optimizers[0]
        owned = self._pipeline.owned_parameters
        predictor = make_weight_predictor(
            self.prediction_in_use,
            owned,
            optimizer,
            stage=k,
            stages=self.stages,
            direction=self.direction,  # type: ignore[arg-type]
            gamma=self.gamma,
            learning_rates=self._forecast(optimizer, count),
            error_sample=self.error_sample or None,
            learning_rate_scale=stage_learning_rate_scale(self.learning_rate_scale, k, self.stages),
        )

        holders = self._pipeline.tied
        self._tied = tied = holders.delayed(self.stages, self.global_rank) if holders else None

        def before_update(parameters: list[nn.Parameter]) -> None:
            # Lightning's own pre-step work: hooks, then clipping (by norm: over all stages);
            # then a tied tensor: its owner gets the holders' sum, its copies the owner's value
            after_closure(self.precision_plugin, module, optimizer)
            if tied is not None:
                tied.exchange()

        self._noflush = NoFlushPipeline(
            self._pipeline.stages[k],
            stage=k,
            stages=self.stages,
            optimizer=optimizer,
            predictor=predictor,
            transport=self._pipeline.runtime.transport,
            data_parallel_group=self._groups.data_parallel if self.groups > 1 else None,
            before_update=before_update,
            record_timeline=True,
            rank=self.global_rank,
            parameters=owned,
            track_norms=bool(module.trainer.gradient_clip_val)
            and module.trainer.gradient_clip_algorithm in (None, "norm"),
        )
        loaded, self._loaded_state = self._loaded_state, None
        if loaded is not None and loaded.get("prediction") == self.prediction_in_use:
            self._noflush.load_state_dict(loaded["state"])
        if self.stages > 1:
            assert self._mirror_groups is not None
            self._mirror = AsyncMirror(
                self.stages,
                k,
                self._mirror_groups[self.group_index],
                self._topology.rank(self.group_index, self.stages - 1),
            )
        return self._noflush

    # -- the training step ---------------------------------------------------------------------

    @override
    def feeds_pipeline(self) -> bool:
        # one stage: the user's training_step calls the stage's forward itself
        return self.stage_index == 0 and self.stages > 1

    @override
    def train_micro_batches(
        self, pipeline: Pipeline, step: MicroBatchStep, inputs: list[tuple[Any, ...]] | None
    ) -> float:
        """Run the units through the no-flush runtime, then mirror the step's values."""
        module = self.lightning_module
        assert module is not None
        last = self.stage_index == self.stages - 1
        noflush = self._ensure_noflush(step.count)
        recorder = LogRecorder()

        def loss_fn(forward: Any, index: int) -> Tensor:
            recorder.start_micro_batch(step.weight(index))
            with (
                patched(self._body, "forward", self.stage_forward(forward)),
                patched(module, "log", recorder.log),
            ):
                result = module.training_step(step.micro[index], *step.hook_args)
            return step.loss_of(index, result, "SpecTrainStrategy")

        with self.precision_plugin.train_step_context():
            losses = noflush.step(
                step.count,
                inputs=inputs if self.feeds_pipeline() else None,
                loss_fn=loss_fn if last else None,
            )
        total = step.total
        loss = sum(float(v) * n / total for v, n in zip(losses, step.sizes)) if last else math.nan
        logged = recorder.combined() if last else []
        if last:
            self.replay(logged)
        self._exchange(loss, logged, module.trainer)
        self._keep_timeline()
        if not last:
            mirrored = self.last_mirrored.loss if self.last_mirrored is not None else 0.0
            loss = mirrored if math.isfinite(mirrored) else 0.0
        return loss

    def _exchange(self, loss: float, logged: list[LoggedValue], trainer: pl.Trainer) -> None:
        """Replay last step's mirrored values, then start this step's exchange."""
        assert self._noflush is not None
        telemetry = self._noflush.pop_telemetry()
        mine = telemetry_figures(telemetry)
        process_ledger().set_gauge("weight_bytes_peak", float(telemetry.weight_bytes_peak))
        if self._mirror is None:  # one stage: nothing to mirror
            self._publish(Mirrored(loss, logged, [mine]))
            return
        last = self.stage_index == self.stages - 1
        self._complete(replay=not last)
        self._mirror.launch(loss, logged, mine)
        if trainer.fit_loop.epoch_loop.batch_progress.is_last_batch:
            self._complete(replay=not last)

    def _complete(self, replay: bool) -> None:
        if self._mirror is None:
            return
        mirrored = self._mirror.complete()
        if mirrored is None:
            return
        if replay:
            self.replay(mirrored.logged)
        self._publish(mirrored)

    def _publish(self, mirrored: Mirrored) -> None:
        """Keep ``mirrored`` and put its telemetry in the ledger's gauges."""
        self.last_mirrored = mirrored
        publish_telemetry(mirrored, self.stages)

    def _keep_timeline(self) -> None:
        assert self._noflush is not None
        events = self._noflush.timeline
        self.timeline.append(events[self._timeline_from :])
        # keep memory bounded: forget what the deque no longer holds
        if len(events) > 100_000:
            del events[: len(events) - 10_000]
        self._timeline_from = len(events)

    @override
    def timeline_title(self) -> str:
        return f"SpecTrain, no flush, N={self.stages}, prediction={self.prediction_in_use}"

    @property
    def prediction_in_use(self) -> str:
        """The prediction option trained with: ``prediction``, ``"auto"`` resolved for the
        optimizer (:func:`~lightning_parallel.pipeline.noflush.default_prediction`)."""
        if self.prediction == "auto":
            optimizer = self.optimizers[0] if self.optimizers else None
            return default_prediction(optimizer, self.stages)
        return self.prediction

    @override
    def optimizer_step(
        self,
        optimizer: Any,
        closure: Any,
        model: pl.LightningModule | nn.Module | None = None,
        **kwargs: Any,
    ) -> Any:
        """Run the closure (``training_step``, which updates every unit); no extra step."""
        return closure()

    @override
    def gradient_norm(self, optimizer: Any) -> tuple[float, list[nn.Parameter]]:
        """The runtime's estimate of the norm over all stages (exact on stage 0; see
        :class:`~lightning_parallel.pipeline.noflush.norms.GlobalNormEstimate`), without a
        blocking collective: Lightning broadcasts from rank 0 at every step, so a per-update
        allreduce across stages that are at different updates would deadlock."""
        if self._noflush is None or not self._noflush.track_norms:
            raise RuntimeError(
                "gradient clipping by norm was not announced to the pipeline; set "
                "Trainer(gradient_clip_val=...) rather than clipping by norm from a hook"
            )
        return self._noflush.global_norm, self._noflush.parameters

    # -- draining ------------------------------------------------------------------------------

    def drain(self) -> None:
        """Finish every micro-batch in flight and the pending exchange (collective: every rank
        calls it at the same point)."""
        if self._noflush is not None:
            self._noflush.drain()
            self._complete(replay=False)
            if self._tied is not None:
                self._tied.settle()

    @override
    def on_validation_start(self) -> None:
        self.drain()
        super().on_validation_start()

    @override
    def on_train_end(self) -> None:
        self.drain()
        super().on_train_end()

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        self.drain()
        return super().lightning_module_state_dict()

    @override
    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        self.drain()
        return super().optimizer_state(optimizer)

    # -- strategy state in checkpoints ---------------------------------------------------------

    @override
    def stage_state(self) -> dict[str, Any]:
        """This stage's runtime and predictor state (the checkpoint keeps every stage's)."""
        self.drain()
        if self._noflush is None:
            return {}
        return {"prediction": self.prediction_in_use, "state": self._noflush.state_dict()}

    @override
    def load_stage_state(self, state: dict[str, Any]) -> None:
        """Resume the predictor state of :meth:`stage_state` (applied when the no-flush
        runtime is built, at the first training batch)."""
        if state:  # kept if it was saved under the prediction option in use (checked then)
            self._loaded_state = state


register_strategy(
    "spectrain",
    SpecTrainStrategy,
    "SpecTrain: no-flush asynchronous pipeline with weight prediction (v2, v1, stash, 2bw, "
    "none), data parallel across pipelines",
)
