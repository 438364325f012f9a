"""Rules on the replicas' mean training loss: leaving the initial plateau, a spike, a regression."""

from __future__ import annotations

import math
from typing import Any

__all__: list[str] = []


class PlateauExit:
    """Watch the replicas' mean training loss and say once when it has left its first plateau.

    Rule (``drop`` ``δ``, ``smoothing`` ``s``, one observation ``ℓ_t`` per optimizer step, the
    loss averaged over the ranks, so that every rank takes the same decision):

    1. the smoothed loss is ``L_t = s·L_{t−1} + (1 − s)·ℓ_t`` (``L_1 = ℓ_1``);
    2. the plateau's level is the highest smoothed loss seen so far, ``P_t = max_{u≤t} L_u``;
    3. the loss has left the plateau at the first step where ``L_t ≤ (1 − δ)·P_t``; the rule
       then fires once and never again.

    Why: a network that starts on a plateau (the bundled BatchNorm-free ``vgg_mini`` sits near
    chance for up to three epochs) leaves it into a stretch of steep, unstable descent whose
    steps are several times larger than on the plateau. Local steps on the plateau track
    synchronous data parallelism closely, but one replica alone in that stretch can overshoot
    (seed 3: a replica's loss went to 7.0 where DDP's mean-gradient step went to 2.9) and the
    averaged model lands on a dead, constant-output point (loss ``ln 10``) that it does not
    leave in 5 epochs. :class:`~lightning_parallel.averaging.ReplicaAveraging` runs a short
    synchronous window from the step this rule fires where ``synchronous_window`` asks for one
    (off by default: it did not help; docs/averaging_defaults.md, "Loss spikes roll back").

    Tuning: ``δ`` must exceed the smoothed loss's noise on the plateau (a few tenths of a
    percent for 2 ranks of 32 samples on digits) and stay below the descent's first fall
    (about 10 % there); a loss that falls from the first step fires the rule within a few
    steps, which then acts as post-local SGD's warm-up.

    Args:
        drop: ``δ`` in ``(0, 1)``: the relative fall of the smoothed loss below the plateau's
            level that counts as leaving it (larger: fires later).
        smoothing: ``s`` in ``[0, 1)``: the exponential smoothing of the loss (larger: less
            noise, later).
    """

    def __init__(self, drop: float = 0.05, smoothing: float = 0.7) -> None:
        if isinstance(drop, bool) or not 0.0 < float(drop) < 1.0:
            raise ValueError(f"drop must be in (0, 1) (a relative fall of the loss), got {drop!r}")
        if isinstance(smoothing, bool) or not 0.0 <= float(smoothing) < 1.0:
            raise ValueError(f"smoothing must be in [0, 1), got {smoothing!r}")
        self.drop = float(drop)
        self.smoothing = float(smoothing)
        self.smoothed: float | None = None
        self.plateau: float | None = None
        self.observed = 0
        self.fired_at: int | None = None  # the observation (1-based) at which the rule fired

    @property
    def fired(self) -> bool:
        """Whether the loss has left its plateau (the rule fires once)."""
        return self.fired_at is not None

    def observe(self, loss: float) -> bool:
        """Take one step's mean loss; return ``True`` only at the step the plateau is left.

        A loss that is not finite is ignored (it says nothing about the plateau's level).
        """
        if self.fired or not math.isfinite(loss):
            return False
        self.observed += 1
        if self.smoothed is None:
            self.smoothed = float(loss)
        else:
            self.smoothed = self.smoothing * self.smoothed + (1.0 - self.smoothing) * float(loss)
        self.plateau = self.smoothed if self.plateau is None else max(self.plateau, self.smoothed)
        if self.smoothed <= (1.0 - self.drop) * self.plateau:
            self.fired_at = self.observed
            return True
        return False

    def state_dict(self) -> dict[str, Any]:
        """The rule's state (identical on every rank) for the checkpoint."""
        return {
            "smoothed": self.smoothed,
            "plateau": self.plateau,
            "observed": self.observed,
            "fired_at": self.fired_at,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`."""
        self.smoothed = state["smoothed"]
        self.plateau = state["plateau"]
        self.observed = int(state["observed"])
        self.fired_at = state["fired_at"]


class LossSpike:
    """Say when the mean training loss jumps far above its recent level, or climbs back to
    where training started, after it had fallen well below it, and stays there.

    Rule (``ratio`` ``r``, ``smoothing`` ``s``, ``regression`` ``c``, ``patience`` ``K``,
    ``armed_drop`` ``δ``; one observation ``ℓ_t`` per optimizer step, the loss averaged over
    the ranks, so that every rank takes the same decision). ``L`` is the smoothed loss of the
    steps that were not spikes, ``L_t = s·L_{t−1} + (1 − s)·ℓ_t`` (``L_1 = ℓ_1``); ``P`` the
    highest ``L`` so far, whatever ``c`` (the spike's level, :attr:`highest`); ``S`` the
    highest ``L`` while the rule is not armed, frozen while it is (the regression's starting
    level, :attr:`start`: where training started, the initial plateau's level); ``B`` the
    lowest ``L`` since the last regression:

    1. a **spike**: ``ℓ_t > r·L_{t−1}`` and ``ℓ_t > P_{t−1}``; it leaves ``L`` as it was (the
       level it is measured against stays the healthy one); the regression does not change
       which steps are spikes;
    2. the rule is **armed** once ``L ≤ (1 − δ)·S``: the loss has left where it started;
    3. a **regression** (``c`` not ``None``, ``band`` ``β``): armed, and both the smoothed loss
       and the step's own loss at least ``(1 − β)·(B + c·(S − B))`` (``c = 1``: back in the
       starting level's band) for ``K`` steps in a row; the rule is then disarmed and ``B``
       restarts at ``L``, so it fires again only after the loss has fallen ``δ`` below ``S``
       once more (a roll-back to a point that is itself on the plateau does not repeat).
       Both losses, because the smoothed one alone remembers a bump for several steps: on
       ``vgg_mini`` (seed 4) ``diloco``'s and streaming DiLoCo's mean losses went 1.6, 2.7,
       3.5, then 2.0 and 2.3, the bump ``ddp``'s own run has there (3.0) and trains through,
       and the smoothed loss stayed above the start for the three steps after it: a roll-back
       to the round 10 steps earlier, with the momentum cleared, after which streaming
       DiLoCo's network died (0.797 at the end; with both losses 0.850). The band, because a
       dead network's loss (``ln 10`` on ten classes, give or take a batch's noise) sits a
       little below the plateau's highest smoothed value as often as above it, and the
       smoothed loss alone reached the start only through such an echo;
    4. while armed and ``L ≥ B + c·(S − B)/2`` the loss is :attr:`unsettled`: the caller holds
       a round kept then apart from the point to roll back to (a round inside a climb that
       ends in a regression may be dead) and makes it that point only once the loss is
       settled again (the climb was transient and training went on from it);
    5. after a roll-back (:meth:`restart`) the first loss is the restart point's own: it is
       no spike (with ``K = 1`` it can end a regression), and ``L`` restarts at it. Measured
       against the level from before, a point that is itself bad spikes at once and is gone
       back to again: streaming DiLoCo on ``vgg_mini`` (seed 1) rolled back 45 steps in a row
       to a validation round's point (losses 3.1 to 5.8) and ended at 0.306.

    ``P`` and ``S`` differ once an armed loss climbs above where it started: ``P`` follows it
    (a later step up to that height is excused, as before the regression existed), ``S`` does
    not (the climb is measured against the start). With one level for both (commit 0885397)
    ``bmuf`` seed 4 rolled back at a step the spike-only rule had excused (0.903 → 0.811).

    The second condition of the spike keeps late training's noise out: once the loss is small,
    a batch twice as hard as the recent ones is ordinary (``vgg_mini`` seed 0 rolled back at
    such steps without it, and ended 0.894 where it had reached 0.925), while a step worse than
    the untrained model is not.

    Why: where the loss leaves a plateau (the bundled ``vgg_mini`` on digits) training is on
    the edge of stability; with momentum 0.9 one bad step can take a replica's loss from 1.6 to
    6 or 7 and its weights onto a dead, constant-output point (loss ``ln 10``) where the
    average of the replicas stays for epochs (seed 3: DDP's own spike reached 2.9 and it
    recovered, the averaged runs' did not). The same fall can take two or three steps, none
    of them twice the smoothed level (``bmuf`` seed 2: 1.56, 2.69, 3.50, then 2.30 for 40
    steps; ``diloco`` seed 3: 1.49, 2.15, 3.57, then 2.29 for 30 steps): the regression
    catches it, where the smoothed loss stays at or above the start (2.30) for 3 steps. One
    step back at the start is not enough: ``model_averaging`` seed 2 went 1.61, 2.08, 3.28,
    then 2.1 to 2.25 for 10 steps and recovered (0.925; rolled back at the 3.28 it died).
    :class:`~lightning_parallel.averaging.ReplicaAveraging` answers either by restarting every
    replica from the last point they agreed on while the loss was settled, with the inner
    optimizer's state and the outer (block) momentum restarted from zero.

    Args:
        ratio: ``r > 1``: how many times the smoothed loss a step's loss must exceed (larger:
            fewer restarts; DDP's healthy steps on ``vgg_mini`` stayed under 1.9).
        smoothing: ``s`` in ``[0, 1)`` (larger: a steadier level, slower to follow a falling
            loss).
        regression: ``c`` in ``(0, 1]``: the share of the way back from the lowest smoothed
            loss to the starting level that counts (larger: fires later, only on a loss
            nearly back at the start); ``None``: spikes only (the former rule).
        patience: ``K ≥ 1``: the steps in a row the smoothed loss must stay back there
            (larger: fewer roll-backs, and later ones).
        armed_drop: ``δ`` in ``(0, 1)``: how far below the starting level the smoothed loss
            must have fallen before a climb back can count (larger: fewer regressions; it must
            exceed the plateau's noise, a few tenths of a percent on ``vgg_mini``).
        band: ``β`` in ``[0, δ)``: how far below the regression's mark both losses may be and
            still count as back there (above the plateau's noise: on ``vgg_mini``, seed 4, the
            mean loss of its first 23 steps lay within 2.292-2.305, 0.6%); less than
            ``armed_drop``, or a loss that has just armed the rule would already count as back.
    """

    def __init__(
        self,
        ratio: float = 2.0,
        smoothing: float = 0.7,
        regression: float | None = 1.0,
        patience: int = 3,
        armed_drop: float = 0.15,
        band: float = 0.03,
    ) -> None:
        if isinstance(ratio, bool) or not float(ratio) > 1.0:
            raise ValueError(f"ratio must be above 1 (times the smoothed loss), got {ratio!r}")
        if isinstance(smoothing, bool) or not 0.0 <= float(smoothing) < 1.0:
            raise ValueError(f"smoothing must be in [0, 1), got {smoothing!r}")
        if regression is not None and (
            isinstance(regression, bool) or not 0.0 < float(regression) <= 1.0
        ):
            raise ValueError(
                f"regression must be in (0, 1] (a share of the way back to the starting loss) "
                f"or None (spikes only), got {regression!r}"
            )
        if isinstance(patience, bool) or int(patience) != patience or patience < 1:
            raise ValueError(f"patience must be a positive number of steps, got {patience!r}")
        if isinstance(armed_drop, bool) or not 0.0 < float(armed_drop) < 1.0:
            raise ValueError(
                f"armed_drop must be in (0, 1) (a relative fall of the loss), got {armed_drop!r}"
            )
        if isinstance(band, bool) or not 0.0 <= float(band) < float(armed_drop):
            raise ValueError(
                f"band must be in [0, armed_drop) (a relative tolerance under the starting "
                f"level, less than the fall that arms the rule), got {band!r}"
            )
        self.ratio = float(ratio)
        self.band = float(band)
        self.smoothing = float(smoothing)
        self.regression = None if regression is None else float(regression)
        self.patience = int(patience)
        self.armed_drop = float(armed_drop)
        self.smoothed: float | None = None
        self.highest: float | None = None  # P: the highest smoothed loss so far (spikes)
        self.start: float | None = None  # S: the highest while not armed (the regression)
        self.lowest: float | None = None
        self.armed = False  # the smoothed loss has fallen armed_drop below the start
        self.back = 0  # steps in a row with both losses back at the mark (less the band)
        self.rebase = False  # the next loss is a restart point's: the level restarts there
        self.spikes = 0
        self.regressions = 0

    def restart(self) -> None:
        """Training went back to an earlier point: the next loss sets the level (5. above)."""
        self.rebase = True

    def _mark(self, share: float) -> float:
        assert self.lowest is not None and self.start is not None
        return self.lowest + share * (self.start - self.lowest)

    @property
    def unsettled(self) -> bool:
        """Whether the smoothed loss is climbing back: no point should be kept as safe now."""
        if self.regression is None or not self.armed or self.smoothed is None:
            return False
        return self.smoothed >= self._mark(self.regression / 2.0)

    def observe(self, loss: float) -> bool:
        """Take one step's mean loss; return whether it is a spike or ends a regression (an
        infinite loss is a spike, once a level exists; NaN, no loss reported, is ignored)."""
        if math.isnan(loss):
            return False
        if (
            self.smoothed is None
            or self.highest is None
            or self.start is None
            or self.lowest is None
        ):
            if math.isfinite(loss):
                self.smoothed = self.highest = self.start = self.lowest = float(loss)
            return False
        if self.rebase and math.isfinite(loss):
            # the first loss after a roll-back is the restart point's own: the level restarts
            # there, whatever it is (a point that is itself bad would otherwise spike again
            # and be gone back to, step after step)
            self.rebase, self.back = False, 0
            self.smoothed = float(loss)
        elif not math.isfinite(loss) or (loss > self.ratio * self.smoothed and loss > self.highest):
            self.spikes += 1
            return True
        else:
            self.smoothed = self.smoothing * self.smoothed + (1.0 - self.smoothing) * float(loss)
        self.highest = max(self.highest, self.smoothed)
        if not self.armed:
            self.start = max(self.start, self.smoothed)
        self.lowest = min(self.lowest, self.smoothed)
        self.armed = self.armed or self.smoothed <= (1.0 - self.armed_drop) * self.start
        if self.regression is None or not self.armed:
            return False
        level = (1.0 - self.band) * self._mark(self.regression)
        self.back = self.back + 1 if min(self.smoothed, float(loss)) >= level else 0
        if self.back < self.patience:
            return False
        self.regressions += 1
        self.armed, self.back, self.lowest = False, 0, self.smoothed
        return True

    def state_dict(self) -> dict[str, Any]:
        """The rule's state (identical on every rank) for the checkpoint."""
        return {
            "smoothed": self.smoothed,
            "highest": self.highest,
            "start": self.start,
            "lowest": self.lowest,
            "armed": self.armed,
            "back": self.back,
            "rebase": self.rebase,
            "spikes": self.spikes,
            "regressions": self.regressions,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`."""
        self.smoothed = state["smoothed"]
        self.highest = state.get("highest", self.smoothed)
        # a checkpoint from before the two levels: its "highest" was frozen while armed
        self.start = state.get("start", self.highest)
        self.lowest = state.get("lowest", self.smoothed)
        self.armed = bool(state.get("armed", False))
        self.back = int(state.get("back", 0))
        self.rebase = bool(state.get("rebase", False))
        self.spikes = int(state["spikes"])
        self.regressions = int(state.get("regressions", 0))
