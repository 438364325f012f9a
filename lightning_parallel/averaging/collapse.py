"""A rule on each replica's own training loss: which replicas fell back to where training began.

Plain Python, no communication: every rank feeds it the same vector of per-replica losses (one
all-reduced vector per local step) and so takes the same decision.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

__all__: list[str] = []


class ReplicaCollapse:
    """Say which replicas have collapsed back to the starting loss while another has not.

    Rule (``smoothing`` ``s``, ``drop`` ``δ``, ``patience`` ``K``; one observation per local
    step: the vector of every replica's own loss ``ℓ_{i,t}``, ``None`` for a replica not in
    the run):

    1. each replica's smoothed loss ``L_{i,t} = s·L_{i,t−1} + (1 − s)·ℓ_{i,t}``; a replica
       whose loss is not finite counts as back at the start at once;
    2. the starting level ``S`` is the highest smoothed mean loss ``(1/M)·Σ_i L_{i,t}`` seen
       while no replica has left it, frozen afterwards (the initial plateau: ``ln 10`` for a
       classifier of 10 balanced classes that outputs a constant);
    3. a replica has **left** the start once its ``L_i ≤ (1 − δ)·S``; it is **healthy** while
       it stays there;
    4. a replica that had left is **collapsed** once ``L_i ≥ (1 − δ/2)·S`` for ``K`` steps in
       a row while another replica is healthy. :meth:`observe` then returns it, and the caller
       replaces it by the healthy replicas' mean (:meth:`replaced` resets its level to theirs).

    Why: where the loss leaves a plateau training sits on the edge of stability, and a replica
    alone (half the batch of data parallelism, so twice its gradient noise) can take one bad
    step onto a dead, constant-output point while the others train on. The mean loss hides it
    (``diloco``, ``vgg_mini`` seed 4: one replica at 2.3, the other at 0.5-1.2, a mean of 1.4
    to 1.7 that no rule on the mean flags), and the next round averages the dead model with
    the healthy one: both come out at a loss of 2.26 and need 25 steps to leave the plateau
    again. Replacing the dead replica by the healthy one when it is seen keeps the progress
    that a roll-back of every replica would throw away. When every replica collapses together
    (the round's model itself went bad), there is no healthy replica to copy and the rules on
    the mean (:class:`~lightning_parallel.averaging.plateau.LossSpike`) answer instead.

    Args:
        smoothing: ``s`` in ``[0, 1)`` (larger: steadier, slower to notice).
        drop: ``δ`` in ``(0, 1)``: how far below the start a replica's smoothed loss must be
            to have left it (it must exceed the plateau's noise); back within ``δ/2`` of the
            start counts as collapsed.
        patience: ``K ≥ 1``: steps in a row back at the start (larger: later, fewer).
    """

    def __init__(self, smoothing: float = 0.7, drop: float = 0.15, patience: int = 3) -> None:
        if isinstance(smoothing, bool) or not 0.0 <= float(smoothing) < 1.0:
            raise ValueError(f"smoothing must be in [0, 1), got {smoothing!r}")
        if isinstance(drop, bool) or not 0.0 < float(drop) < 1.0:
            raise ValueError(f"drop must be in (0, 1) (a relative fall of the loss), got {drop!r}")
        if isinstance(patience, bool) or int(patience) != patience or patience < 1:
            raise ValueError(f"patience must be a positive number of steps, got {patience!r}")
        self.smoothing = float(smoothing)
        self.drop = float(drop)
        self.patience = int(patience)
        self.smoothed: list[float | None] = []
        self.start: float | None = None
        self.left: list[bool] = []
        self.back: list[int] = []
        self.collapses = 0  # replicas replaced so far

    @property
    def armed(self) -> bool:
        """Whether some replica has left the start (``S`` is frozen from then on)."""
        return any(self.left)

    def _grow(self, replicas: int) -> None:
        missing = replicas - len(self.smoothed)
        if missing > 0:
            self.smoothed += [None] * missing
            self.left += [False] * missing
            self.back += [0] * missing

    def healthy(self) -> list[int]:
        """The replicas whose smoothed loss is at least ``δ`` below the start."""
        if self.start is None:
            return []
        mark = (1.0 - self.drop) * self.start
        return [i for i, level in enumerate(self.smoothed) if level is not None and level <= mark]

    def observe(self, losses: Sequence[float | None]) -> list[int]:
        """Take one step's per-replica losses (``None``: not in the run; NaN: no loss this
        step); return the replicas that collapsed at this step (usually none)."""
        self._grow(len(losses))
        infinite: list[int] = []
        for i, loss in enumerate(losses):
            if loss is None:  # not in the run (lost): neither healthy nor collapsed
                self.smoothed[i], self.left[i], self.back[i] = None, False, 0
                continue
            if math.isnan(loss):
                continue
            if not math.isfinite(loss):
                infinite.append(i)
                continue
            level = self.smoothed[i]
            self.smoothed[i] = (
                float(loss)
                if level is None
                else self.smoothing * level + (1.0 - self.smoothing) * float(loss)
            )
        levels = [level for level in self.smoothed if level is not None]
        if not levels:
            return []
        if not self.armed:
            mean = sum(levels) / len(levels)
            self.start = mean if self.start is None else max(self.start, mean)
        assert self.start is not None
        left_mark = (1.0 - self.drop) * self.start
        back_mark = (1.0 - self.drop / 2.0) * self.start
        for i, level in enumerate(self.smoothed):
            if level is not None and level <= left_mark:
                self.left[i] = True
        collapsed = []
        for i, level in enumerate(self.smoothed):
            if i in infinite:
                self.back[i] = self.patience
            elif level is not None and self.left[i] and level >= back_mark:
                self.back[i] += 1
            else:
                self.back[i] = 0
            if self.back[i] >= self.patience and self.left[i]:
                collapsed.append(i)
        if not collapsed or not self.healthy():
            return []
        return collapsed

    def replaced(self, replicas: Sequence[int]) -> None:
        """``replicas`` now hold the healthy replicas' mean: their level is the healthy mean."""
        healthy = [self.smoothed[i] for i in self.healthy()]
        level = sum(h for h in healthy if h is not None) / len(healthy) if healthy else None
        for i in replicas:
            self.smoothed[i] = level
            self.back[i] = 0
        self.collapses += len(replicas)

    def state_dict(self) -> dict[str, Any]:
        """The rule's state (identical on every rank) for the checkpoint."""
        return {
            "smoothed": list(self.smoothed),
            "start": self.start,
            "left": list(self.left),
            "back": list(self.back),
            "collapses": self.collapses,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`."""
        self.smoothed = list(state["smoothed"])
        self.start = state["start"]
        self.left = [bool(flag) for flag in state["left"]]
        self.back = [int(count) for count in state["back"]]
        self.collapses = int(state["collapses"])
