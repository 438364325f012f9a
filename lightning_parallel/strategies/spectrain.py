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
one device (each stage's predictor state in them too). What differs is the training step:
:class:`~lightning_parallel.strategies.spectrain_training.SpecTrainTraining` (its module
docstring gives it per step on every rank: the units through the no-flush runtime, the
mirrored values, no extra optimizer step, clipping by norm over all stages).

This module holds the strategy's options (checked by
:func:`~lightning_parallel.pipeline.noflush.options.check_options` before any process starts),
what it refuses at setup and where the pipeline must be empty. The pipeline drains (no sample
lost or counted twice) before validation, at the end of every epoch, before a checkpoint and at
the end of ``fit``. ``accumulate_grad_batches`` must be 1 and there must be one optimizer.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import pytorch_lightning as pl
from pytorch_lightning.callbacks import Callback
from pytorch_lightning.trainer.states import TrainerFn
from torch.distributed.constants import default_pg_timeout as DEFAULT_TIMEOUT
from typing_extensions import override

from lightning_parallel.compat import register_strategy
from lightning_parallel.pipeline.noflush.options import check_options
from lightning_parallel.strategies.spectrain_training import SpecTrainTraining

__all__: list[str] = []


class _DrainAtEpochEnd(Callback):
    """Drain the pipeline at the end of every training epoch."""

    def __init__(self, strategy: SpecTrainStrategy) -> None:
        self.strategy = strategy

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.strategy.drain()


class SpecTrainStrategy(SpecTrainTraining):
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
    sigterm_read_late = True

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
        self.last_mirrored = None
        self._noflush = None
        self._tied = None
        self._mirror = None
        self._mirror_groups = None
        self._loaded_state = None
        self._callback = _DrainAtEpochEnd(self)
        self._timeline_from = 0

    # -- setup ---------------------------------------------------------------------------------

    @override
    def strategy_callbacks(self, trainer: pl.Trainer) -> list[Callback]:
        return [self._callback]

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
    def teardown(self) -> None:
        self._noflush, self._tied = None, None
        self._mirror = None
        super().teardown()

    @override
    def timeline_title(self) -> str:
        return f"SpecTrain, no flush, N={self.stages}, prediction={self.prediction_in_use}"

    # -- where the pipeline must be empty ------------------------------------------------------

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
