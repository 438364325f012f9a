"""SpecTrain's training step: the no-flush runtime under Lightning's automatic optimization.

:class:`SpecTrainTraining` is the engine half of
:class:`~lightning_parallel.strategies.spectrain.SpecTrainStrategy`: the hooks of
:class:`~lightning_parallel.strategies.pipeline_training.PipelineTraining` it fills in and what
they need.

1. **the runtime**, built at the first training batch (the stage exists then): the stage's
   weight predictor for the option in use (predicting with the scheduler's own next learning
   rates when one is configured), a
   :class:`~lightning_parallel.pipeline.noflush.NoFlushPipeline` over the stage that runs
   Lightning's pre-step work before each update, the predictor state of a resumed checkpoint,
   and the :class:`~lightning_parallel.pipeline.noflush.mirror.AsyncMirror` of the pipeline
   group (on a gloo group of its own);
2. **the step**, on every rank:

   a. split the batch into ``micro_batches`` units and run them through the no-flush runtime:
      for each unit, the forward of this unit and the backward of the one ``N-k-1`` units
      older, then the stage's update (gradients averaged across groups first, then
      Lightning's ``on_before_optimizer_step`` hooks and gradient clipping, then
      ``optimizer.step()``);
   b. the last stage logs what ``training_step`` logged (one combined value per step) and the
      loss; an *asynchronous* allreduce in the pipeline group carries those values and each
      stage's staleness, prediction error and bubble to every rank, completed at the next step
      (no per-step synchronization of the stages: ranks other than the last stage see training
      values one step late; at the last batch of an epoch the exchange completes at once);
   c. Lightning's own ``optimizer.step`` becomes a no-op (the runtime already updated);

3. **clipping by norm** uses the norm of the update's gradient over all stages as the runtime
   estimates it without waiting (exact on stage 0; on stage k the share of stages k..N-1 is
   exact, the upstream share is taken from the newest update whose total is known); by value
   is local;
4. **draining** (:meth:`~SpecTrainTraining.drain`): every micro-batch in flight is finished
   and the pending exchange completed; the strategy calls it wherever the pipeline must be
   empty.
"""

from __future__ import annotations

import math
from typing import Any

import pytorch_lightning as pl
import torch
import torch.distributed as dist
from torch import Tensor, nn
from typing_extensions import override

from lightning_parallel.comm.devices import side_group
from lightning_parallel.comm.ledger import process_ledger
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
from lightning_parallel.pipeline.noflush.options import stage_learning_rate_scale
from lightning_parallel.pipeline.patching import patched
from lightning_parallel.pipeline.summary import LoggedValue, LogRecorder
from lightning_parallel.pipeline.tied import DelayedTiedSum
from lightning_parallel.strategies.pipeline_base import PipelineStrategyBase

__all__: list[str] = []


class SpecTrainTraining(PipelineStrategyBase):
    """SpecTrain's runtime, training step, clipping norm and draining (see the module
    docstring); the options are those of
    :class:`~lightning_parallel.strategies.spectrain.SpecTrainStrategy`, which sets them."""

    #: the prediction option (``"auto"`` or one of the predictors')
    prediction: str
    #: ``"schedule"`` or ``"constant"``: the learning rates a prediction assumes
    learning_rates: str
    #: what a prediction moves along (``"auto"``: by optimizer)
    direction: str
    #: smoothing of the gradient (``None``: the optimizer's momentum, else 0.9)
    gamma: float | None
    #: ``"staleness"`` or a factor on every stale stage's learning rate
    learning_rate_scale: str | float
    #: coordinates per stage the online prediction error samples (0: off)
    error_sample: int
    #: what the last completed exchange carried (every rank)
    last_mirrored: Mirrored | None
    #: this rank's stage runtime, built at the first training batch
    _noflush: NoFlushPipeline | None
    #: the exchange of tensors tied across stages, one update late
    _tied: DelayedTiedSum | None
    #: the asynchronous exchange of the step's values in the pipeline group
    _mirror: AsyncMirror | None
    #: per data-parallel group, the gloo group its pipeline's exchange runs on
    _mirror_groups: list[dist.ProcessGroup] | None
    #: the checkpointed stage state to apply when the runtime is built
    _loaded_state: dict[str, Any] | None
    #: how many of the runtime's timeline events the strategy's timeline already holds
    _timeline_from: int

    @property
    def noflush(self) -> NoFlushPipeline | None:
        """This rank's no-flush stage runtime (built at the first training batch)."""
        return self._noflush

    @property
    def prediction_in_use(self) -> str:
        """The prediction option trained with: ``prediction``, ``"auto"`` resolved for the
        optimizer (:func:`~lightning_parallel.pipeline.noflush.default_prediction`)."""
        if self.prediction == "auto":
            optimizer = self.optimizers[0] if self.optimizers else None
            return default_prediction(optimizer, self.stages)
        return self.prediction

    # -- setup ---------------------------------------------------------------------------------

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
    def gradient_sync(self, parameters: list[nn.Parameter]) -> PartitionGradientSync | None:
        return None  # the no-flush runtime averages every update across groups itself

    # -- the no-flush runtime ------------------------------------------------------------------

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
