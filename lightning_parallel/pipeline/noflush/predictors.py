"""Choose the weights a pipeline stage uses for each micro-batch: predicted, stashed or stale.

In a pipeline that never flushes (:mod:`~.runtime`), stage ``k`` of ``N`` runs the forward of
a micro-batch, then ``N-k-1`` updates happen at that stage (the backwards of micro-batches
already in flight) before the micro-batch's own gradient comes back and is applied. The
gradient is therefore computed on weights that are ``N-k-1`` updates old. A
:class:`WeightPredictor` decides which weights the forward and the backward of each micro-batch
see; the runtime loads them into the stage's parameters (``parameter.data``) for the duration of
that pass.

=======  ==========================================  ==========================================
option   forward / backward weights                  extra memory at stage k (copies of the
                                                     stage's weights)
=======  ==========================================  ==========================================
none     live / live (stale, PipeDream without       0
         stashing)
stash    live / the forward's version (PipeDream     N-k-1 snapshots (taken lazily, only when
         weight stashing)                            an update would overwrite a version still
                                                     in flight)
2bw      live / the forward's version, an update     1 snapshot (0 at the last stage); the
         every N micro-batches (PipeDream-2BW)       gradient accumulates in ``.grad``
v2       predicted s=N-k-1 / the same predicted      N-k predictions in flight (0 at the last
         weights (SpecTrain, consistent)             stage)
v1       predicted s=floor(k/2)+N-k-1 /              1 transient prediction
         predicted s=floor(k/2) (SpecTrain paper)
=======  ==========================================  ==========================================

v1 and v2 need a direction: SGD's momentum buffer and Adam's moments cost nothing (the
optimizer keeps them); ``direction="smoothed_gradient"`` (the paper's own ``v``, for other
optimizers) adds one copy. :meth:`WeightPredictor.peak_bytes` measures what a predictor really held.

Weight prediction (Chen et al., "Efficient and Robust Parallel DNN Training through Model
Parallelism on Multi-GPU Platform", 2018, SpecTrain):

1. After every update t keep the smoothed gradient ``v_t = gamma·v_{t-1} + (1-gamma)·g_t``.
2. Before a pass that will be applied ``s`` updates later predict
   ``Ŵ_{t+s} = W_t - s·η·v_{t-1}``.

Our additions:

3. Schedule-aware: replace ``s·η`` by ``Σ_{j<s} η_{t+j}``, the learning-rate scheduler's own
   future values (:class:`~.forecast.ScheduledLearningRate` simulates a copy of the scheduler).
4. Adam-aware: replace ``v`` by Adam's update direction ``m̂/(√v̂+ε)`` (plus ``λ·W`` for
   decoupled weight decay), :class:`~.directions.AdamDirection`.
5. Online prediction error (:class:`~.error.PredictionErrorMeter`): when a micro-batch's
   gradient is applied, the distance between the weights its forward used and the live weights,
   relative to the live weights, next to the same distance for the unpredicted (stale) weights.
6. Delay-scaled step (``learning_rate_scale="staleness"`` in :func:`make_weight_predictor`, any
   option): a stage whose gradients are τ updates stale steps with ``ρ·η``, ρ the ratio of the
   largest stable step of heavy ball with that delay (and this correction) to the synchronous
   one (:func:`~.stability.staleness_learning_rate_scale`): 0.071 for v2 and 0.026 without
   prediction at τ = 1, μ = 0.9. Prediction alone cannot restore the margin: on a quadratic at
   μ = 0.9, τ = 1 it raises the stable ``η·h`` from 0.10 to 0.27, where a synchronous update
   tolerates 3.8.

torch's ``SGD(momentum=μ, dampening=d)`` steps by ``η·buf`` with ``buf = (1-d)/(1-μ)·v`` when
``gamma = μ``: the paper's ``s·η·v`` then undershoots by ``1/(1-μ)`` (10x at μ=0.9), so
:class:`~.directions.SmoothedGradient` multiplies by that step scale.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

import torch
from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_parallel.pipeline.noflush.directions import (
    Direction,
    SmoothedGradient,
)
from lightning_parallel.pipeline.noflush.error import PredictionErrorMeter
from lightning_parallel.pipeline.noflush.forecast import LearningRateForecast, ScheduledLearningRate
from lightning_parallel.pipeline.noflush.weights import Weights, tensor_bytes

__all__: list[str] = []

PredictionMode = Literal["v2", "v1", "stash", "2bw", "none"]
PREDICTION_MODES: tuple[str, ...] = ("v2", "v1", "stash", "2bw", "none")


class WeightPredictor:
    """Decide the weights of one stage for the forward and the backward of each micro-batch.

    This base is ``prediction="none"``: both passes use the live weights. Subclasses override
    :meth:`forward_weights` / :meth:`backward_weights`. The runtime calls, per micro-batch b:
    ``forward_weights(b)`` → forward → ... → ``backward_weights(b)`` → backward →
    ``release(b)``; and around every optimizer update ``before_update()`` / ``after_update()``.

    Every option can also shrink the stage's step (``learning_rate_scale``, see
    :func:`~.stability.staleness_learning_rate_scale`): around each update the optimizer's
    learning rates are multiplied by the scale (``before_update``) and restored
    (``after_update``), so a learning-rate scheduler still sees and sets the unscaled values.

    Args:
        parameters: the stage's trainable parameters.
        stage: this stage's index k (0-based).
        stages: the number of stages N.
        meter: optional online prediction-error meter.
        optimizer: the optimizer updating the stage (needed when ``learning_rate_scale != 1``).
        learning_rate_scale: factor in (0, 1] on the learning rate of this stage's updates.
    """

    name = "none"
    update_period = 1  # micro-batches per optimizer update

    def __init__(
        self,
        parameters: Sequence[nn.Parameter],
        *,
        stage: int,
        stages: int,
        meter: PredictionErrorMeter | None = None,
        optimizer: Optimizer | None = None,
        learning_rate_scale: float = 1.0,
    ) -> None:
        if not 0 <= stage < stages:
            raise ValueError(f"stage must be in [0, {stages}), got {stage}")
        self.parameters = [p for p in parameters if p.requires_grad]
        self.stage = stage
        self.stages = stages
        self.meter = meter
        self.updates = 0
        self.stage_bytes = tensor_bytes(self.parameters)
        self._peak = 0
        self.optimizer = optimizer
        if not 0.0 < learning_rate_scale <= 1.0:
            raise ValueError(
                "learning_rate_scale must be a factor in (0, 1] (make_weight_predictor also "
                f"takes 'staleness'), got {learning_rate_scale!r}"
            )
        self.learning_rate_scale = float(learning_rate_scale)
        if self.learning_rate_scale != 1.0 and optimizer is None:
            raise ValueError(
                "learning_rate_scale != 1 needs the optimizer whose learning rates it scales"
            )
        self._unscaled: list[Any] | None = None
        self._init_state()

    def _init_state(self) -> None:
        """Set up what a subclass keeps per micro-batch (called at the end of ``__init__``)."""

    @property
    def staleness(self) -> int:
        """Updates applied at this stage between a micro-batch's forward and its own update."""
        return self.stages - self.stage - 1

    def forward_weights(self, micro_batch: int) -> Weights:
        """Weights for the forward of ``micro_batch`` (None: live)."""
        self._record(micro_batch, None)
        return None

    def backward_weights(self, micro_batch: int) -> Weights:
        """Weights for the backward of ``micro_batch`` (None: live)."""
        return None

    def release(self, micro_batch: int) -> None:
        """The backward of ``micro_batch`` is done: resolve its error and free its weights."""
        if self.meter is not None:
            self.meter.resolve(micro_batch)

    def before_update(self) -> None:
        """The live weights are about to change: scale the learning rates for this update."""
        if self.learning_rate_scale != 1.0 and self.optimizer is not None:
            groups = self.optimizer.param_groups
            self._unscaled = [group["lr"] for group in groups]
            for group, lr in zip(groups, self._unscaled):
                group["lr"] = lr * self.learning_rate_scale

    def after_update(self) -> None:
        """The live weights changed; ``.grad`` still holds the gradient applied."""
        if self._unscaled is not None and self.optimizer is not None:
            for group, lr in zip(self.optimizer.param_groups, self._unscaled):
                group["lr"] = lr
            self._unscaled = None
        self.updates += 1

    def held_bytes(self) -> int:
        """Bytes this predictor holds now beyond the live weights."""
        return 0

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint needs to resume exactly (taken with no micro-batch in flight)."""
        return {"updates": self.updates}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`."""
        self.updates = int(state["updates"])

    def peak_bytes(self) -> int:
        """Most bytes held at once (transient predictions included)."""
        return max(self._peak, self.held_bytes())

    def _note(self, transient: int = 0) -> None:
        self._peak = max(self._peak, self.held_bytes() + transient)

    def _record(self, micro_batch: int, used: Weights) -> None:
        if self.meter is not None:
            self.meter.record(micro_batch, used)


class WeightStashing(WeightPredictor):
    """PipeDream weight stashing: the backward uses the weights its forward used.

    A version is snapshotted only when an update is about to overwrite it while a micro-batch
    that used it is still in flight, so stage k holds at most N-k-1 snapshots.
    """

    name = "stash"

    def _init_state(self) -> None:
        self._version_of: dict[int, int] = {}
        self._snapshots: dict[int, list[Tensor]] = {}

    def forward_weights(self, micro_batch: int) -> Weights:
        self._version_of[micro_batch] = self.updates
        self._record(micro_batch, None)
        return None

    def backward_weights(self, micro_batch: int) -> Weights:
        version = self._version_of[micro_batch]
        return None if version == self.updates else self._snapshots[version]

    def release(self, micro_batch: int) -> None:
        super().release(micro_batch)
        self._version_of.pop(micro_batch)
        alive = set(self._version_of.values())
        for version in [v for v in self._snapshots if v not in alive]:
            del self._snapshots[version]

    def before_update(self) -> None:
        super().before_update()
        if self.updates in self._version_of.values() and self.updates not in self._snapshots:
            self._snapshots[self.updates] = [p.detach().clone() for p in self.parameters]
            self._note()

    def held_bytes(self) -> int:
        return len(self._snapshots) * self.stage_bytes


class DoubleBufferedWeights(WeightStashing):
    """PipeDream-2BW: one update per N micro-batches (gradients accumulated), so at most two
    versions are ever in use: the live one for new forwards and the previous one for backwards
    of micro-batches that started before the update.
    """

    name = "2bw"

    def _init_state(self) -> None:
        super()._init_state()
        self.update_period = self.stages

    @property
    def staleness(self) -> int:
        return 1 if self.stages - self.stage - 1 > 0 else 0


class SpecTrainPrediction(WeightPredictor):
    """SpecTrain: run passes on the weights predicted for when the gradient will be applied.

    ``version="v2"`` (consistent): forward on ``Ŵ`` with s = N-k-1, the same ``Ŵ`` for the
    backward. ``version="v1"`` (the paper): forward s = ⌊k/2⌋+N-k-1, backward s = ⌊k/2⌋ predicted
    again from the live weights at backward time.

    Args:
        parameters: the stage's trainable parameters.
        stage: this stage's index k.
        stages: the number of stages N.
        direction: a :class:`~.directions.SmoothedGradient` or
            :class:`~.directions.AdamDirection`.
        learning_rates: forecast of the next learning rates
            (:class:`~.forecast.ScheduledLearningRate` for the schedule-aware prediction).
        version: "v2" or "v1".
        meter: optional online prediction-error meter.
        groups: param-group index of each parameter (-1 = not optimized).
        optimizer: the optimizer updating the stage (needed when ``learning_rate_scale != 1``).
        learning_rate_scale: factor on this stage's learning rate (see :class:`WeightPredictor`);
            the prediction moves by the scaled rates, as the updates will.
    """

    def __init__(
        self,
        parameters: Sequence[nn.Parameter],
        *,
        stage: int,
        stages: int,
        direction: Direction,
        learning_rates: LearningRateForecast,
        version: Literal["v2", "v1"] = "v2",
        meter: PredictionErrorMeter | None = None,
        groups: Sequence[int] | None = None,
        optimizer: Optimizer | None = None,
        learning_rate_scale: float = 1.0,
    ) -> None:
        super().__init__(
            parameters,
            stage=stage,
            stages=stages,
            meter=meter,
            optimizer=optimizer,
            learning_rate_scale=learning_rate_scale,
        )
        if version not in ("v1", "v2"):
            raise ValueError(f"version must be 'v1' or 'v2', got {version!r}")
        self.name = version
        self.version = version
        self.direction = direction
        self.learning_rates = learning_rates
        self.groups = list(groups) if groups is not None else [0] * len(self.parameters)
        staleness = stages - stage - 1
        half = stage // 2 if version == "v1" else 0
        self.forward_horizon = half + staleness
        self.backward_horizon = half
        self._stored: dict[int, list[Tensor]] = {}

    def predict(self, horizon: int) -> list[Tensor]:
        """``Ŵ = W - ρ·(Σ_{j<horizon} η_{t+j})·direction`` for every parameter (ρ: the
        stage's learning-rate scale)."""
        sums = [self.learning_rate_scale * eta for eta in self.learning_rates.sums(horizon)]
        predicted = []
        with torch.no_grad():
            for i, p in enumerate(self.parameters):
                group = self.groups[i]
                eta = sums[group] if group >= 0 else 0.0
                direction, factor = self.direction.direction(i, p.detach())
                predicted.append(torch.add(p.detach(), direction, alpha=-eta * factor))
        return predicted

    def forward_weights(self, micro_batch: int) -> Weights:
        if self.forward_horizon == 0:
            self._record(micro_batch, None)
            return None
        predicted = self.predict(self.forward_horizon)
        self._record(micro_batch, predicted)
        if self.version == "v2":
            self._stored[micro_batch] = predicted
            self._note()
        else:
            self._note(transient=self.stage_bytes)
        return predicted

    def backward_weights(self, micro_batch: int) -> Weights:
        if self.version == "v2":
            return self._stored.get(micro_batch)
        if self.backward_horizon == 0:
            return None
        self._note(transient=self.stage_bytes)
        return self.predict(self.backward_horizon)

    def release(self, micro_batch: int) -> None:
        super().release(micro_batch)
        self._stored.pop(micro_batch, None)

    def after_update(self) -> None:
        self.direction.observe([p.grad for p in self.parameters])
        self.learning_rates.note_update()
        super().after_update()

    def held_bytes(self) -> int:
        return len(self._stored) * self.stage_bytes + self.direction.nbytes()

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        if isinstance(self.direction, SmoothedGradient):
            state["velocity"] = [v.clone() for v in self.direction.velocity]
        if isinstance(self.learning_rates, ScheduledLearningRate):
            state["done_in_period"] = self.learning_rates._done_in_period
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        if isinstance(self.direction, SmoothedGradient) and "velocity" in state:
            for v, saved in zip(self.direction.velocity, state["velocity"]):
                v.copy_(saved)
        if isinstance(self.learning_rates, ScheduledLearningRate) and "done_in_period" in state:
            self.learning_rates._done_in_period = int(state["done_in_period"])
