"""The learning rates of the next updates, which a prediction moves the weights by: the current
ones, or the scheduler's own future values simulated on a copy."""

from __future__ import annotations

import copy
import warnings

import torch
from torch.optim import Optimizer

__all__: list[str] = []


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
