"""Choose the weights a pipeline stage uses for each micro-batch: predicted, stashed or stale.

In a pipeline that never flushes (:mod:`lightning_parallel.pipeline.noflush`), stage ``k`` of
``N`` runs the forward of a micro-batch, then ``N-k-1`` updates happen at that stage (the
backwards of micro-batches already in flight) before the micro-batch's own gradient comes back
and is applied. The gradient is therefore computed on weights that are ``N-k-1`` updates old.
A :class:`WeightPredictor` decides which weights the forward and the backward of each micro-batch
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
   future values (:class:`ScheduledLearningRate` simulates a copy of the scheduler).
4. Adam-aware: replace ``v`` by Adam's update direction ``m̂/(√v̂+ε)`` (plus ``λ·W`` for
   decoupled weight decay), :class:`AdamDirection`.
5. Online prediction error (:class:`PredictionErrorMeter`): when a micro-batch's gradient is
   applied, the distance between the weights its forward used and the live weights, relative to
   the live weights, next to the same distance for the unpredicted (stale) weights.
6. Delay-scaled step (``learning_rate_scale="staleness"`` in :func:`make_weight_predictor`, any
   option): a stage whose gradients are τ updates stale steps with ``ρ·η``, ρ the ratio of the
   largest stable step of heavy ball with that delay (and this correction) to the synchronous
   one (:func:`staleness_learning_rate_scale`): 0.071 for v2 and 0.026 without prediction at
   τ = 1, μ = 0.9. Prediction alone cannot restore the margin: on a quadratic at μ = 0.9,
   τ = 1 it raises the stable ``η·h`` from 0.10 to 0.27, where a synchronous update
   tolerates 3.8.

torch's ``SGD(momentum=μ, dampening=d)`` steps by ``η·buf`` with ``buf = (1-d)/(1-μ)·v`` when
``gamma = μ``: the paper's ``s·η·v`` then undershoots by ``1/(1-μ)`` (10x at μ=0.9), so
:class:`SmoothedGradient` multiplies by that step scale.
"""

from __future__ import annotations

import copy
import math
import warnings
from collections.abc import Sequence
from typing import Any, Literal

import torch
from torch import Tensor, nn
from torch.optim import Optimizer

__all__: list[str] = []

PredictionMode = Literal["v2", "v1", "stash", "2bw", "none"]
PREDICTION_MODES: tuple[str, ...] = ("v2", "v1", "stash", "2bw", "none")
Weights = list[Tensor] | None  # None: the live weights


def _nbytes(tensors: Sequence[Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _group_index(parameters: Sequence[nn.Parameter], optimizer: Optimizer | None) -> list[int]:
    """Index of the optimizer param group of each parameter (-1: not optimized, never moves)."""
    if optimizer is None:
        return [0] * len(parameters)
    where = {id(p): g for g, group in enumerate(optimizer.param_groups) for p in group["params"]}
    return [where.get(id(p), -1) for p in parameters]


def _delayed_radius(rates: Tensor, staleness: int, momentum: float, predicted: bool) -> Tensor:
    """Spectral radius, per ``a = η·h``, of heavy ball on ``f = h·x²/2`` with delayed gradients.

    State ``(x_t, ..., x_{t-τ-1}, η·buf_{t-1})``; the gradient applied at t is taken at
    ``x̂ = x_{t-τ} + c·τ·(x_{t-τ} - x_{t-τ-1})`` (c = 1: SpecTrain's prediction along the last
    step, c = 0: the stale weights).
    """
    tau, c = staleness, 1.0 if predicted else 0.0
    size = tau + 3
    maps = torch.zeros(len(rates), size, size, dtype=torch.float64)
    a = rates.to(torch.float64)
    # η·buf_t = μ·η·buf_{t-1} + a·x̂ ; x_{t+1} = x_t - η·buf_t
    maps[:, 0, 0] = 1.0
    maps[:, 0, tau] -= a * (1.0 + c * tau)
    maps[:, 0, tau + 1] += a * c * tau
    maps[:, 0, size - 1] -= momentum
    maps[:, size - 1, tau] += a * (1.0 + c * tau)
    maps[:, size - 1, tau + 1] -= a * c * tau
    maps[:, size - 1, size - 1] = momentum
    for j in range(1, tau + 2):
        maps[:, j, j - 1] = 1.0
    return torch.linalg.eigvals(maps).abs().amax(dim=-1)


def staleness_learning_rate_scale(
    staleness: int, momentum: float = 0.0, predicted: bool = False
) -> float:
    """Shrink a stale stage's learning rate to the share of the stable step its delay leaves.

    1. Heavy ball (``buf ← μ·buf + g``, ``x ← x - η·buf``) on a quadratic of curvature ``h`` is
       stable while ``η·h < 2(1+μ)``: the learning rate was tuned for that margin (sharpness
       rises until it is used up, "edge of stability").
    2. With the gradient ``τ`` updates stale the bound falls: for plain SGD to
       ``2·sin(π/(2(2τ+1)))`` (1 for τ = 1), and momentum makes it far worse, ``1-μ`` for
       τ = 1, 38 times below the synchronous bound at μ = 0.9: asynchrony acts as extra
       momentum (Mitliagkas et al. 2016, "Asynchrony begets momentum"). SpecTrain's prediction
       along the last step (``predicted``) widens it, 2.7 times at μ = 0.9, but stays 14 times
       short.
    3. Scale the stage's learning rate by the ratio of the two bounds, ``ρ = a*(τ, μ) / 2(1+μ)``
       with ``a*`` the largest ``η·h`` for which the delayed recursion's spectral radius stays
       below 1 (found numerically), so the stale stage keeps the synchronous stability margin
       (PipeMare, Yang et al. 2021, likewise shrinks each stage's step with its delay). 1 when
       τ = 0; 1/2 for τ = 1 without momentum; 0.026 (stale) and 0.071 (predicted) for τ = 1 at
       μ = 0.9.

    Args:
        staleness: updates between a micro-batch's forward and its own update at this stage.
        momentum: heavy-ball momentum μ (SGD's ``momentum``, Adam's ``β1``; the ratio does not
            depend on dampening).
        predicted: whether the pass runs on weights predicted along the momentum direction.
    """
    if staleness < 0:
        raise ValueError(f"staleness must be >= 0, got {staleness}")
    if not 0.0 <= momentum < 1.0:
        raise ValueError(f"momentum must be in [0, 1), got {momentum}")
    if staleness == 0:
        return 1.0
    synchronous = 2.0 * (1.0 + momentum)
    grid = torch.linspace(0.0, synchronous, 2049)[1:]
    unstable = (_delayed_radius(grid, staleness, momentum, predicted) >= 1.0).nonzero()
    if len(unstable) == 0:
        return 1.0
    first = int(unstable[0])
    low, high = (float(grid[first - 1]) if first else 0.0), float(grid[first])
    for _ in range(40):
        middle = (low + high) / 2.0
        radius = _delayed_radius(torch.tensor([middle]), staleness, momentum, predicted)
        low, high = (middle, high) if float(radius[0]) < 1.0 else (low, middle)
    return low / synchronous


class LearningRateForecast:
    """Sum the learning rates of the next updates; this base assumes they stay as they are now.

    Args:
        optimizer: the optimizer whose param groups hold ``lr``.
    """

    def __init__(self, optimizer: Optimizer) -> None:
        self.optimizer = optimizer

    def sums(self, horizon: int) -> list[float]:
        """Per param group, ``Σ_{j<horizon} η_{t+j}`` over the next ``horizon`` updates."""
        return [horizon * float(group["lr"]) for group in self.optimizer.param_groups]

    def note_update(self) -> None:
        """Called by the runtime after each optimizer update."""


ConstantLearningRate = LearningRateForecast


class ScheduledLearningRate(LearningRateForecast):
    """Sum the learning rates the scheduler will really give over the next updates.

    A copy of the scheduler, bound to a stand-in optimizer with the same param-group values, is
    stepped ahead; the real scheduler and optimizer are never touched. Works for every
    ``LRScheduler`` whose next value depends only on its own state (not ``ReduceLROnPlateau``).

    Args:
        optimizer: the optimizer the scheduler drives.
        scheduler: the learning-rate scheduler (stepped by someone else, e.g. Lightning).
        updates_per_scheduler_step: optimizer updates between two scheduler steps
            (micro-batches per step times the scheduler's frequency; the updates of one epoch
            for ``interval="epoch"``).
    """

    def __init__(
        self,
        optimizer: Optimizer,
        scheduler: torch.optim.lr_scheduler.LRScheduler,
        updates_per_scheduler_step: int = 1,
    ) -> None:
        super().__init__(optimizer)
        if updates_per_scheduler_step < 1:
            raise ValueError(
                f"updates_per_scheduler_step must be >= 1, got {updates_per_scheduler_step}"
            )
        if not isinstance(scheduler, torch.optim.lr_scheduler.LRScheduler) or isinstance(
            scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau
        ):
            raise TypeError(
                f"{type(scheduler).__name__} cannot be simulated ahead (its next value depends on "
                "metrics); use learning_rates='constant' for it"
            )
        self.scheduler = scheduler
        self.updates_per_scheduler_step = updates_per_scheduler_step
        self._seen_epoch = scheduler.last_epoch
        self._done_in_period = 0
        self._future: list[list[float]] = []

    def _sync(self) -> None:
        if self.scheduler.last_epoch != self._seen_epoch:
            self._seen_epoch = self.scheduler.last_epoch
            self._done_in_period = 0
            self._future = []

    def note_update(self) -> None:
        self._sync()
        self._done_in_period += 1

    def future(self, steps: int) -> list[list[float]]:
        """Learning rates per param group now and after each of the next ``steps`` steps."""
        self._sync()
        if len(self._future) <= steps:
            self._future = _simulate(self.scheduler, self.optimizer, steps)
        return self._future[: steps + 1]

    def sums(self, horizon: int) -> list[float]:
        if horizon <= 0:
            return [0.0] * len(self.optimizer.param_groups)
        self._sync()
        per = self.updates_per_scheduler_step
        # the update j from now falls in scheduler period (done + j) // per (0 = current lr)
        periods = [(self._done_in_period + j) // per for j in range(horizon)]
        table = self.future(max(periods))
        return [sum(table[p][g] for p in periods) for g in range(len(table[0]))]


def _simulate(
    scheduler: torch.optim.lr_scheduler.LRScheduler, optimizer: Optimizer, steps: int
) -> list[list[float]]:
    stand_in = torch.optim.SGD([torch.zeros(1)], lr=1.0)
    stand_in.param_groups = [
        {**{k: v for k, v in group.items() if k != "params"}, "params": [torch.zeros(1)]}
        for group in optimizer.param_groups
    ]
    clone = object.__new__(type(scheduler))
    clone.__dict__.update(copy.deepcopy(scheduler.__dict__, {id(optimizer): stand_in}))
    rates = [[float(g["lr"]) for g in stand_in.param_groups]]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(steps):
            clone.step()
            rates.append([float(g["lr"]) for g in stand_in.param_groups])
    return rates


class SmoothedGradient:
    """The paper's direction, ``v_t = gamma·v_{t-1} + (1-gamma)·g_t``, times the step scale.

    Args:
        parameters: the stage's trainable parameters.
        gamma: smoothing factor gamma (the paper uses the momentum coefficient).
        step_scale: how far one update moves per unit of ``η·v`` (``(1-d)/(1-μ)`` for torch's
            ``SGD(momentum=μ, dampening=d)``, 1 for plain SGD).
    """

    def __init__(self, parameters: Sequence[Tensor], gamma: float, step_scale: float = 1.0) -> None:
        if not 0.0 <= gamma < 1.0:
            raise ValueError(f"gamma must be in [0, 1), got {gamma}")
        self.gamma = gamma
        self.step_scale = step_scale
        self.velocity = [
            torch.zeros_like(p, memory_format=torch.preserve_format) for p in parameters
        ]

    def observe(self, gradients: Sequence[Tensor | None]) -> None:
        """Fold the gradients of the update just applied into ``v``."""
        pairs = [(v, g.detach()) for v, g in zip(self.velocity, gradients) if g is not None]
        if pairs:
            velocity, grads = [v for v, _ in pairs], [g for _, g in pairs]
            torch._foreach_mul_(velocity, self.gamma)
            torch._foreach_add_(velocity, grads, alpha=1.0 - self.gamma)

    def direction(self, index: int, parameter: Tensor) -> tuple[Tensor, float]:
        """Displacement per unit learning rate of parameter ``index``, as (tensor, factor):
        the update subtracts ``factor·tensor`` (no copy is made)."""
        return self.velocity[index], self.step_scale

    def nbytes(self) -> int:
        return _nbytes(self.velocity)


class MomentumBuffer:
    """torch SGD's own momentum buffer as the direction: the paper's ``v`` at no memory cost.

    For ``SGD(momentum=μ, dampening=d)`` and ``gamma = μ``, ``buf_t = (1-d)/(1-μ)·v_t`` (the
    same recursion; equal from the first update when ``d = 0``), so reading the buffer gives
    :class:`SmoothedGradient`'s direction without keeping ``v``.

    Args:
        parameters: the stage's trainable parameters.
        optimizer: a ``torch.optim.SGD`` with momentum.
    """

    def __init__(self, parameters: Sequence[nn.Parameter], optimizer: Optimizer) -> None:
        if not isinstance(optimizer, torch.optim.SGD):
            raise TypeError(
                "direction='momentum_buffer' needs torch.optim.SGD, got "
                f"{type(optimizer).__name__}; use direction='smoothed_gradient'"
            )
        self.parameters = list(parameters)
        self.optimizer = optimizer

    def observe(self, gradients: Sequence[Tensor | None]) -> None:
        """Nothing to keep: the optimizer updates its buffer."""

    def direction(self, index: int, parameter: Tensor) -> tuple[Tensor, float]:
        """The momentum buffer of parameter ``index`` (zeros before the first update)."""
        buffer = self.optimizer.state.get(self.parameters[index], {}).get("momentum_buffer")
        return (torch.zeros_like(parameter), 1.0) if buffer is None else (buffer, 1.0)

    def nbytes(self) -> int:
        return 0


class AdamDirection:
    """Adam's own update direction ``m̂/(√v̂+ε)`` (+ ``λ·W`` when weight decay is decoupled).

    Reads the optimizer's state, so it costs no memory of its own.

    Args:
        parameters: the stage's trainable parameters.
        optimizer: a ``torch.optim.Adam`` or ``AdamW``.
    """

    def __init__(self, parameters: Sequence[nn.Parameter], optimizer: Optimizer) -> None:
        if not isinstance(optimizer, torch.optim.Adam):
            raise TypeError(
                f"direction='adam' needs torch.optim.Adam or AdamW, got {type(optimizer).__name__};"
                " use direction='smoothed_gradient'"
            )
        self.parameters = list(parameters)
        self.optimizer = optimizer
        self.groups = _group_index(self.parameters, optimizer)

    def observe(self, gradients: Sequence[Tensor | None]) -> None:
        """Nothing to keep: Adam's moments are the smoothed statistics."""

    def direction(self, index: int, parameter: Tensor) -> tuple[Tensor, float]:
        """Adam's displacement per unit learning rate of parameter ``index``, factor 1."""
        p = self.parameters[index]
        state = self.optimizer.state.get(p, {})
        if "exp_avg" not in state or self.groups[index] < 0:
            return torch.zeros_like(parameter), 1.0
        group = self.optimizer.param_groups[self.groups[index]]
        beta1, beta2 = group["betas"]
        step = float(state["step"])
        second = state["max_exp_avg_sq"] if group.get("amsgrad", False) else state["exp_avg_sq"]
        m_hat = state["exp_avg"] / (1.0 - beta1**step)
        v_hat = second / (1.0 - beta2**step)
        direction = m_hat / (v_hat.sqrt() + group["eps"])
        decoupled = group.get(
            "decoupled_weight_decay", isinstance(self.optimizer, torch.optim.AdamW)
        )
        if decoupled and group["weight_decay"]:
            direction = direction + group["weight_decay"] * parameter
        if group.get("maximize", False):
            direction = -direction
        return direction, 1.0

    def nbytes(self) -> int:
        return 0


Direction = SmoothedGradient | MomentumBuffer | AdamDirection


class PredictionErrorMeter:
    """Measure, per micro-batch, how far the weights its forward used were from the weights
    its gradient is applied to.

    1. At the forward of micro-batch b record a fixed random sample of coordinates of the
       weights the forward used (``Ŵ``) and of the live weights then (``W_t``).
    2. When b's gradient is applied (live weights ``W``) add
       ``‖Ŵ-W‖/‖W‖`` (prediction error) and ``‖W_t-W‖/‖W‖`` (the stale error that no correction
       would have had) on the sample; exact when the stage has at most ``sample_size`` elements.

    Args:
        parameters: the stage's trainable parameters.
        sample_size: coordinates kept per record.
        seed: seed of the coordinate sample.
    """

    def __init__(
        self, parameters: Sequence[Tensor], sample_size: int = 4096, seed: int = 0
    ) -> None:
        self.parameters = list(parameters)
        total = sum(p.numel() for p in self.parameters)
        generator = torch.Generator().manual_seed(seed)
        self.indices: list[Tensor | None] = []
        for p in self.parameters:
            if total <= sample_size:
                self.indices.append(None)
            else:
                keep = max(1, math.ceil(p.numel() * sample_size / total))
                chosen = torch.randperm(p.numel(), generator=generator)[:keep]
                self.indices.append(chosen.sort().values.to(p.device))
        self._open: dict[int, tuple[Tensor, Tensor]] = {}
        self.prediction_error_sum = 0.0
        self.stale_error_sum = 0.0
        self.count = 0

    def sample(self, tensors: Sequence[Tensor] | None) -> Tensor:
        """Concatenated sampled coordinates of ``tensors`` (the live parameters when None)."""
        source = self.parameters if tensors is None else tensors
        parts = []
        for t, idx in zip(source, self.indices):
            flat = t.detach().reshape(-1)
            # index_select: several times faster than flat[idx] on CPU
            part = flat.clone() if idx is None else flat.index_select(0, idx)
            parts.append(part.to(torch.float32))
        return torch.cat(parts) if parts else torch.zeros(0)

    def record(self, micro_batch: int, used: Weights) -> None:
        """Remember the weights the forward of ``micro_batch`` used."""
        live = self.sample(None)
        self._open[micro_batch] = (live if used is None else self.sample(used), live)

    def resolve(self, micro_batch: int) -> None:
        """Compare the recorded weights with the live weights now (b's gradient is applied)."""
        used, at_forward = self._open.pop(micro_batch)
        live = self.sample(None)
        norm = float(live.norm()) or 1.0
        self.prediction_error_sum += float((used - live).norm()) / norm
        self.stale_error_sum += float((at_forward - live).norm()) / norm
        self.count += 1

    def pop_means(self) -> tuple[float, float] | None:
        """Mean (prediction error, stale error) since the last call; None if nothing resolved."""
        if self.count == 0:
            return None
        means = (self.prediction_error_sum / self.count, self.stale_error_sum / self.count)
        self.prediction_error_sum = self.stale_error_sum = 0.0
        self.count = 0
        return means


class WeightPredictor:
    """Decide the weights of one stage for the forward and the backward of each micro-batch.

    This base is ``prediction="none"``: both passes use the live weights. Subclasses override
    :meth:`forward_weights` / :meth:`backward_weights`. The runtime calls, per micro-batch b:
    ``forward_weights(b)`` → forward → ... → ``backward_weights(b)`` → backward →
    ``release(b)``; and around every optimizer update ``before_update()`` / ``after_update()``.

    Every option can also shrink the stage's step (``learning_rate_scale``, see
    :func:`staleness_learning_rate_scale`): around each update the optimizer's learning rates
    are multiplied by the scale (``before_update``) and restored (``after_update``), so a
    learning-rate scheduler still sees and sets the unscaled values.

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
        self.stage_bytes = _nbytes(self.parameters)
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
        direction: a :class:`SmoothedGradient` or :class:`AdamDirection`.
        learning_rates: forecast of the next learning rates (:class:`ScheduledLearningRate` for
            the schedule-aware prediction).
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


def _heavy_ball_momentum(optimizer: Optimizer | None) -> float:
    """The momentum μ of the optimizer's first param group (SGD's ``momentum``, Adam's β1)."""
    if optimizer is None or not optimizer.param_groups:
        return 0.0
    group = optimizer.param_groups[0]
    if "betas" in group:
        return float(group["betas"][0])
    return float(group.get("momentum", 0.0) or 0.0)


def make_weight_predictor(
    mode: str,
    parameters: Sequence[nn.Parameter],
    optimizer: Optimizer | None,
    *,
    stage: int,
    stages: int,
    direction: Literal["auto", "smoothed_gradient", "momentum_buffer", "adam"] = "auto",
    gamma: float | None = None,
    learning_rates: LearningRateForecast | None = None,
    error_sample: int | None = 4096,
    learning_rate_scale: float | str = 1.0,
) -> WeightPredictor:
    """Build the predictor of one stage for ``mode`` in ``"v2" | "v1" | "stash" | "2bw" | "none"``.

    Args:
        mode: the weight-correction option.
        parameters: the stage's parameters (frozen ones are ignored).
        optimizer: the optimizer updating them (needed by v1/v2).
        stage: this stage's index k.
        stages: the number of stages N.
        direction: "adam" for Adam's update direction, "smoothed_gradient" for the paper's
            ``v`` (one extra copy), "momentum_buffer" for SGD's own buffer (the same direction
            when ``gamma`` is the momentum, no copy); "auto" picks "adam" for Adam/AdamW,
            "momentum_buffer" for SGD with momentum (and ``gamma`` unset or equal to it), else
            "smoothed_gradient".
        gamma: smoothing factor; default the optimizer's momentum, else 0.9.
        learning_rates: forecast of the next learning rates; default the current ones.
        error_sample: coordinates sampled by the prediction-error meter; None disables it.
        learning_rate_scale: factor on the stage's learning rate, or ``"staleness"`` for the
            share of the stable step the stage's delay leaves under the optimizer's momentum
            and this correction (:func:`staleness_learning_rate_scale`; 1 on the last stage).
    """
    if mode not in PREDICTION_MODES:
        raise ValueError(f"prediction must be one of {PREDICTION_MODES}, got {mode!r}")
    trainable = [p for p in parameters if p.requires_grad]
    meter = PredictionErrorMeter(trainable, error_sample) if error_sample else None
    if learning_rate_scale == "staleness":
        delay = (1 if stage < stages - 1 else 0) if mode == "2bw" else stages - stage - 1
        learning_rate_scale = staleness_learning_rate_scale(
            delay, _heavy_ball_momentum(optimizer), predicted=mode in ("v1", "v2")
        )
    elif isinstance(learning_rate_scale, str):
        raise ValueError(
            f"learning_rate_scale must be 'staleness' or a factor in (0, 1], got "
            f"{learning_rate_scale!r}"
        )
    common: dict[str, Any] = {
        "stage": stage,
        "stages": stages,
        "meter": meter,
        "optimizer": optimizer,
        "learning_rate_scale": learning_rate_scale,
    }
    if mode == "none":
        return WeightPredictor(trainable, **common)
    if mode == "stash":
        return WeightStashing(trainable, **common)
    if mode == "2bw":
        return DoubleBufferedWeights(trainable, **common)
    if optimizer is None:
        raise ValueError(f"prediction={mode!r} needs the optimizer to read learning rates from")
    groups = _group_index(trainable, optimizer)
    half = stage // 2 if mode == "v1" else 0
    # a stage that never predicts (the last one under v2) keeps no smoothed gradient
    predicted = trainable if half + stages - stage - 1 > 0 else []
    first = optimizer.param_groups[0]
    momentum = float(first.get("momentum", 0.0) or 0.0)
    if direction == "auto":
        if isinstance(optimizer, torch.optim.Adam):
            direction = "adam"
        elif (
            isinstance(optimizer, torch.optim.SGD)
            and momentum > 0
            and gamma in (None, momentum)
            and len({g.get("momentum") for g in optimizer.param_groups}) == 1
        ):
            direction = "momentum_buffer"
        else:
            direction = "smoothed_gradient"
    chosen: Direction
    if direction == "adam":
        chosen = AdamDirection(predicted, optimizer)
    elif direction == "momentum_buffer":
        chosen = MomentumBuffer(predicted, optimizer)
    elif direction == "smoothed_gradient":
        dampening = float(first.get("dampening", 0.0) or 0.0)
        scale = (1.0 - dampening) / (1.0 - momentum) if momentum > 0 else 1.0
        smoothing = gamma if gamma is not None else (momentum if momentum > 0 else 0.9)
        chosen = SmoothedGradient(predicted, smoothing, scale)
    else:
        raise ValueError(
            "direction must be 'auto', 'smoothed_gradient', 'momentum_buffer' or 'adam', "
            f"got {direction!r}"
        )
    return SpecTrainPrediction(
        trainable,
        direction=chosen,
        learning_rates=learning_rates or LearningRateForecast(optimizer),
        version=mode,  # type: ignore[arg-type]
        groups=groups,
        **common,
    )
