"""Staleness policies: how the server turns stale gradients into updates.

A gradient's *staleness* τ is the number of server updates applied between the moment its
worker read the weights and the moment the gradient is applied (exact version counters; see
:class:`~lightning_parallel.parameter_server.server.ShardServer`). Each remedy of the survey
"分布式深度学习研究" is one small, composable piece of :class:`UpdatePolicy`:

========================  ====================================  ===================================
piece                     rule                                  paper
========================  ====================================  ===================================
staleness scaling         learning rate η·f(τ): ``inverse``     Zhang, Gupta, Lian, Liu 2016
                          1/(τ+1), ``sqrt`` 1/√(τ+1),           (staleness-aware async SGD)
                          ``exp`` e^(−cτ)
drop                      discard gradients with τ > bound      same survey
n-softsync                one update averages n gradients       Zhang et al. 2016
bounded staleness (SSP)   no gradient is applied with τ > s:    Ho et al. 2013
                          fast workers block; s=0 synchronous
delay compensation        g + λ·g⊙g⊙(w_now − w_used)            Zheng et al. 2017 (DC-ASGD)
========================  ====================================  ===================================

Zhang et al. count the update that applies a gradient in its staleness (a gradient applied by
the very next update has staleness 1 there, 0 here), so their η/τ is η/(τ+1) in our count: with
W workers the mean factor is about 1/W, which makes W asynchronous steps move the weights about
as far as one synchronous step on the averaged gradient.

Defaults (:class:`UpdatePolicy` with no arguments) give plain asynchronous SGD: every gradient
is applied on arrival, unscaled, never dropped, no bound, no compensation.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

__all__: list[str] = []

#: Names accepted by :func:`staleness_scaling` and ``ParameterServerStrategy(staleness=...)``.
STALENESS_SCALINGS: tuple[str, ...] = ("none", "inverse", "sqrt", "exp")


class StalenessScaling:
    """Learning-rate factor of a gradient of staleness τ (one method: :meth:`factor`).

    Every factor is 1 at τ = 0: a fresh gradient always takes the full step.
    """

    name = "none"

    def factor(self, staleness: int) -> float:
        """The learning-rate multiplier for a gradient ``staleness`` updates old."""
        return 1.0

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class InverseScaling(StalenessScaling):
    """η/(τ+1) (Zhang et al. 2016's η/τ in their count): the step shrinks with updates missed."""

    name = "inverse"

    def factor(self, staleness: int) -> float:
        return 1.0 / (staleness + 1)


class SqrtScaling(StalenessScaling):
    """η/√(τ+1): a milder decay than ``inverse`` for many workers."""

    name = "sqrt"

    def factor(self, staleness: int) -> float:
        return 1.0 / math.sqrt(staleness + 1)


class ExponentialScaling(StalenessScaling):
    """η·e^(−c·τ), c = ``decay``: stale gradients fade quickly (the factor is 1 at τ = 0)."""

    name = "exp"

    def __init__(self, decay: float = 0.5) -> None:
        if not decay > 0.0:
            raise ValueError(f"staleness_decay must be > 0 for 'exp' scaling, got {decay}")
        self.decay = float(decay)

    def factor(self, staleness: int) -> float:
        return math.exp(-self.decay * staleness)

    def __repr__(self) -> str:
        return f"ExponentialScaling(decay={self.decay})"


def staleness_scaling(name: str, decay: float = 0.5) -> StalenessScaling:
    """The scaling called ``name`` (one of :data:`STALENESS_SCALINGS`)."""
    if name == "none":
        return StalenessScaling()
    if name == "inverse":
        return InverseScaling()
    if name == "sqrt":
        return SqrtScaling()
    if name == "exp":
        return ExponentialScaling(decay)
    raise ValueError(
        f"staleness must be one of {', '.join(map(repr, STALENESS_SCALINGS))}; got {name!r}"
    )


def _optional_count(name: str, value: int | float | None, minimum: int) -> int | None:
    """``None`` or ``math.inf`` mean unbounded; otherwise an integer >= ``minimum``."""
    if value is None or (isinstance(value, float) and math.isinf(value)):
        return None
    if isinstance(value, (str, bool)) or not isinstance(value, (int, float)):
        raise ValueError(
            f"{name} must be an integer >= {minimum} or None (unbounded); got {value!r}"
        )
    number = int(value)
    if number != float(value) or number < minimum:
        raise ValueError(
            f"{name} must be an integer >= {minimum} or None (unbounded); got {value!r}"
        )
    return number


@dataclass(frozen=True)
class UpdatePolicy:
    """The server's rules for turning gradients into updates; all pieces compose.

    Args:
        staleness: learning-rate scaling by staleness τ (updates missed, 0 = fresh):
            ``"none"`` (default), ``"inverse"`` (η/(τ+1)), ``"sqrt"`` (η/√(τ+1)) or ``"exp"``
            (η·e^(−decay·τ)).
        staleness_decay: c of ``"exp"`` scaling (default 0.5; larger => stale gradients fade
            faster).
        drop_staleness: discard gradients staler than this (default ``None``: keep all).
        softsync: n of n-softsync: each update averages n gradients (default 1: apply each on
            arrival; larger => closer to synchronous). Zhang et al.'s "n-softsync" with λ
            learners waits for ⌊λ/n⌋ gradients, so their n corresponds to ``softsync=λ//n``.
        softsync_wait: whether a worker whose gradient waits for its group also waits for its
            reply (default ``True``: it resumes with the weights its group produced;
            ``False``: as in Zhang et al., a learner pushes its gradient and pulls the current
            weights at once, and its gradient joins the next group: faster, staler, and in our
            measurements unstable with momentum 0.9). Only with ``softsync > 1`` and no
            ``max_staleness`` (SSP decides the waits itself).
        max_staleness: SSP bound s: no gradient is applied with staleness above s; a worker
            whose gradient would break the bound waits (default ``None``: unbounded, fully
            asynchronous; ``0``: synchronous SGD, every update averages one gradient per worker).
        delay_compensation: λ of DC-ASGD (default 0.0: off; the paper uses about 0.04).
        lr_scale: constant factor on the user's learning rate for every update (default 1.0).
            An update applies ``softsync`` gradients where synchronous training with ``W``
            workers applies the mean of ``W``: ``softsync / W`` keeps the step per sample
            (the linear scaling rule; ``ParameterServerStrategy(lr_scale="auto")``).

    Example::

        policy = UpdatePolicy(staleness="inverse", max_staleness=4)
    """

    staleness: str = "none"
    staleness_decay: float = 0.5
    drop_staleness: int | None = None
    softsync: int = 1
    softsync_wait: bool = True
    max_staleness: int | None = None
    delay_compensation: float = 0.0
    lr_scale: float = 1.0
    scaling: StalenessScaling = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "scaling", staleness_scaling(self.staleness, self.staleness_decay))
        object.__setattr__(
            self, "drop_staleness", _optional_count("drop_staleness", self.drop_staleness, 0)
        )
        object.__setattr__(
            self, "max_staleness", _optional_count("max_staleness", self.max_staleness, 0)
        )
        softsync = int(self.softsync)
        if softsync != self.softsync or softsync < 1:
            raise ValueError(f"softsync must be an integer >= 1, got {self.softsync!r}")
        object.__setattr__(self, "softsync", softsync)
        compensation = float(self.delay_compensation)
        if not compensation >= 0.0 or math.isinf(compensation):
            raise ValueError(
                f"delay_compensation (DC-ASGD λ) must be a finite value >= 0, got "
                f"{self.delay_compensation!r}; the paper uses about 0.04"
            )
        object.__setattr__(self, "delay_compensation", compensation)
        scale = float(self.lr_scale)
        if not scale > 0.0 or math.isinf(scale):
            raise ValueError(f"lr_scale must be a finite value > 0, got {self.lr_scale!r}")
        object.__setattr__(self, "lr_scale", scale)

    @property
    def answers_before_update(self) -> bool:
        """Whether a pushed gradient is answered with the current weights before it is applied."""
        return self.softsync > 1 and self.max_staleness is None and not self.softsync_wait

    def factor(self, staleness: int) -> float:
        """Learning-rate multiplier of a gradient of ``staleness``."""
        return self.scaling.factor(staleness)

    def keeps(self, staleness: int) -> bool:
        """Whether a gradient of ``staleness`` is applied (``False``: dropped)."""
        return self.drop_staleness is None or staleness <= self.drop_staleness

    def compensate(self, gradient: Tensor, weights_now: Tensor, weights_used: Tensor) -> Tensor:
        """DC-ASGD: g + λ·g⊙g⊙(w_now − w_used); ``gradient`` itself when λ = 0."""
        if self.delay_compensation == 0.0:
            return gradient
        with torch.no_grad():
            return gradient + self.delay_compensation * gradient * gradient * (
                weights_now - weights_used
            )

    def group_size(
        self, pending_reads: Sequence[int], computing_reads: Sequence[int], version: int
    ) -> int:
        """How many of the oldest pending gradients one update applies now (0: wait).

        1. Without a computing worker no more gradients can come, so the pending ones are
           flushed (a last group may be smaller than ``softsync``); otherwise a group needs at
           least ``softsync`` gradients.
        2. SSP: every gradient left behind (still pending, or still being computed) will be
           applied at version ≥ v+1, so the group of size k is allowed only if
           v + 1 − read ≤ s for each of them. The smallest allowed k is chosen; with s = 0 this
           makes the group all gradients read at the current version: synchronous SGD.

        Args:
            pending_reads: versions read by the pending gradients, oldest first.
            computing_reads: versions read by the workers still computing a gradient.
            version: the server's current version v.
        """
        count = len(pending_reads)
        if count == 0:
            return 0
        smallest = min(self.softsync, count) if not computing_reads else self.softsync
        bound = self.max_staleness
        for size in range(smallest, count + 1):
            if bound is None:
                return size
            behind = [*pending_reads[size:], *computing_reads]
            if all(version + 1 - read <= bound for read in behind):
                return size
        return 0
