"""The points model averaging rolls back to: kept after rounds, held during a climb, shown
healthy before the one before is let go.

:class:`RestartPoints` is the part of :class:`~lightning_parallel.averaging.ReplicaAveraging`
that keeps, for the loss rules'
:class:`~lightning_parallel.averaging.loss_responses.LossResponses`, the agreed point every
replica restarts from after a spike or a regression:

1. after a round whose replicas restart in consensus (or, for a round that landed late, its
   agreed point), the live model is kept; EASGD's center, the same on every worker, is kept
   after each whole-model round applied at once (it goes back there on a regression only);
2. a round inside a climb of the loss
   (:attr:`~lightning_parallel.averaging.plateau.LossSpike.unsettled`) is held apart, and
   becomes the point only once the loss has settled again;
3. the point kept before stays until a step from the new one has fired no rule; streaming and
   quantized rounds keep each fragment's agreement from before its rounds the same way;
4. a count of the points kept tells a rule that fires again before a new one is kept that it
   would go back to the same point.

The points are per-rank state (``local_state_dict``); their counts are in the shared state
(:meth:`RestartPoints._points_state`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from lightning_parallel.averaging.exchange import RoundExchange
from lightning_parallel.averaging.plateau import LossSpike
from lightning_parallel.averaging.policies import round_buffers
from lightning_parallel.averaging.rounds import Agreement

__all__: list[str] = []


class RestartPoints(RoundExchange):
    """Keep the agreed points a roll-back goes back to (see the module docstring).

    :class:`~lightning_parallel.averaging.loss_responses.LossResponses` sets :attr:`spike` and
    calls :meth:`_start_keeping_points` once.
    """

    spike: LossSpike | None

    def _start_keeping_points(self) -> None:
        """No point kept yet."""
        # points to go back to kept so far, and that count at the last roll-back: a rule
        # firing again before a new one is kept would go back to the same point, and does not
        self._points_kept = 0
        self._points_at_rollback: int | None = None
        self._rollbacks_to_point = 0  # roll-backs since that count last changed
        # the last point every replica agreed on (unfragmented, exact rounds; streaming and
        # quantized rounds keep each fragment's in ``agreements``)
        self._safe_point: list[Tensor] | None = None
        # the last agreed point of a climb not yet known to be transient (``_keep_safe_point``)
        self._held_point: list[Tensor] | None = None
        self._holding = False
        # until a step from the newest agreed point has shown a loss that fires no rule, the
        # point before it is kept (``_safe_point``'s, or each fragment's agreement's)
        self._verified = True
        self._previous_point: list[Tensor] | None = None
        self._previous_agreements: dict[int, Agreement | None] = {}

    @property
    def _no_point_since_rollback(self) -> bool:
        """Whether a roll-back would go back to the point the last one went to."""
        return self._points_at_rollback == self._points_kept

    @property
    def _rolls_back_to_center(self) -> bool:
        """Whether the replicas, which do not restart in consensus, roll back to an agreed point
        the algorithm keeps (EASGD's center) on a regression: with the regression rule on, and
        whole-model rounds applied at once only (a delayed round, or one that keeps each
        fragment's agreement: streaming, quantized, ``before_validation="global"``, leaves no
        such point). A spike is counted and trained through: going back to the center at one
        cost ``vgg_mini`` (seeds 4 and 11) up to 17 points, where EASGD without it trained
        through the spike's descent (docs/averaging_defaults.md, "EASGD goes back to its center
        on a regression")."""
        return (
            not self.averager.restarts_in_consensus
            and self.averager.keeps_agreed_point
            and self.spike is not None
            and self.spike.regression is not None
            and len(self.fragments) == 1
            and not self._keep_agreement
            and self.sync_delay == 0
        )

    @property
    def _can_roll_back(self) -> bool:
        """Whether a loss rule has an agreed point to roll every replica back to (a spike or a
        regression; EASGD's center: a regression only)."""
        return self.averager.restarts_in_consensus or self._rolls_back_to_center

    def _center_point(self) -> list[Tensor]:
        """The algorithm's agreed point with the round's buffers (the replicas hold the mean
        buffers after a round), shaped like :meth:`_model_tensors`."""
        center = self.averager.agreed_point()
        assert center is not None
        return [*center, *round_buffers(self.module, self.buffers)]

    def _restore_point(self) -> bool:
        """Put the last agreed point a step has shown healthy (the newest, else the one before
        it) into the replicas, and count the roll-back against it; ``False`` when there is
        none yet."""
        if self._keep_agreement and all(agreement is not None for agreement in self.agreements):
            if not self._verified:  # the newest rounds' points spiked at once: go back before
                for index, before in self._previous_agreements.items():
                    if before is not None:
                        self.agreements[index] = before
            self._put_agreement()
        elif self._safe_point is not None:
            if not self._verified and self._previous_point is not None:
                self._safe_point, self._previous_point = self._previous_point, self._safe_point
            with torch.no_grad():
                for tensor, saved in zip(self._model_tensors(), self._safe_point, strict=True):
                    tensor.copy_(saved)
        else:
            return False
        self._verified = True
        self._previous_agreements.clear()
        self._holding = False  # a point inside the climb is never gone back to
        self._rollbacks_to_point = (
            self._rollbacks_to_point + 1 if self._no_point_since_rollback else 1
        )
        self._points_at_rollback = self._points_kept
        return True

    def _keep_safe_point(self, point: Sequence[Tensor] | None = None) -> None:
        """Remember the live model (replicas in consensus), or the agreed ``point`` of a round
        that landed late, as the point to roll back to, the loss not climbing back towards
        where training started.

        A round applied ``sync_delay`` steps after it started (``overlap=True``) leaves no
        replica at the agreed point: each keeps its steps taken meanwhile, so the point kept
        is the round's result itself (:meth:`_delayed_round_agreed`); without it, the point
        to roll back to stayed where local training had started.

        A round inside a climb (the loss :attr:`~LossSpike.unsettled`) is held apart: a climb
        that ends in a regression rolls back to the point from before it (a point inside may
        already be dead), but one that settles again by itself showed that training went on
        from the held point, which then becomes the point to roll back to. Without that, a
        spike after a transient climb and before the next round went back to the point from
        before the climb (``bmuf`` seed 4 on ``vgg_mini``: 33 steps, to a loss of 2.26 from
        0.99, where the rounds 19 and 11 steps back had been held).

        The point kept before stays until a step from the new one has fired no rule: a
        spike at the first loss from a round says the round's point is itself bad, and the
        roll-back goes to the point before it (:meth:`_roll_back`). Streaming and quantized
        rounds keep each fragment's agreement from before its rounds the same way
        (:meth:`_agreement_replaced`).
        """
        if self.spike is None or self._keep_agreement or len(self.fragments) > 1:
            return
        tensors = self._model_tensors() if point is None else list(point)
        if self.spike.unsettled and self._safe_point is not None:
            self._held_point = _copy_into(self._held_point, tensors)
            self._holding = True
            return
        if self._verified:  # the point kept so far waits behind the new one until it is shown
            self._previous_point, self._safe_point = self._safe_point, self._previous_point
        self._safe_point = _copy_into(self._safe_point, tensors)
        self._verified = False
        self._holding = False
        self._points_kept += 1

    def _delayed_round_agreed(self, point: Sequence[Tensor]) -> None:
        """A round applied late landed: its agreed point is the one to roll back to."""
        self._keep_safe_point(point)

    def _agreement_replaced(self, index: int, before: Agreement | None) -> None:
        """Keep fragment ``index``'s agreed point from before its newest round until a step
        has shown the new one healthy (the first after any round since the last such step)."""
        if self.spike is None or not self.averager.restarts_in_consensus:
            return  # no roll-back: nothing to go back to (EASGD's replicas never agree)
        self._previous_agreements.setdefault(index, before)
        self._verified = False
        self._points_kept += 1

    def _forget_earlier_points(self) -> None:
        """The replicas agree where local training (re)starts: nothing before it is gone back
        to (after a synchronous window, the window's end)."""
        self._verified = True
        self._previous_agreements.clear()

    def _release_held_point(self) -> None:
        """The climb has settled without a roll-back: the point held inside it is safe."""
        self._safe_point, self._held_point = self._held_point, self._safe_point
        self._holding = False
        self._points_kept += 1

    # ------------------------------------------------------------------ checkpoint

    def _points_state(self) -> dict[str, Any]:
        """The points' counts and the fragments' agreements kept from before their rounds
        (identical on every rank), for the spike rule's entry of the checkpoint."""
        return {
            "points_kept": self._points_kept,
            "points_at_rollback": self._points_at_rollback,
            "rollbacks_to_point": self._rollbacks_to_point,
            "verified": self._verified,
            "previous_agreements": {
                index: None if before is None else before.state_dict()
                for index, before in self._previous_agreements.items()
            },
        }

    def _load_points_state(self, saved: dict[str, Any]) -> None:
        """Restore :meth:`_points_state`."""
        self._points_kept = int(saved.get("points_kept", 0))
        at = saved.get("points_at_rollback")
        self._points_at_rollback = None if at is None else int(at)
        self._rollbacks_to_point = int(saved.get("rollbacks_to_point", 0 if at is None else 1))
        self._verified = bool(saved.get("verified", True))
        device = self._device()
        self._previous_agreements = {
            int(index): None if before is None else Agreement.from_state_dict(before, device)
            for index, before in (saved.get("previous_agreements") or {}).items()
        }

    def local_state_dict(self) -> dict[str, Any]:
        """:meth:`ReplicaState.local_state_dict` with the point a loss spike rolls back to."""
        state = super().local_state_dict()
        if self._safe_point is not None:
            state["safe_point"] = [tensor.clone() for tensor in self._safe_point]
        if self._holding and self._held_point is not None:
            state["held_point"] = [tensor.clone() for tensor in self._held_point]
        if not self._verified and self._previous_point is not None:
            state["previous_point"] = [tensor.clone() for tensor in self._previous_point]
        return state

    def load_local_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`local_state_dict`."""
        super().load_local_state_dict(state)
        device = self._device()
        saved = state.get("safe_point")
        if saved is not None:
            self._safe_point = [tensor.to(device) for tensor in saved]
        previous = state.get("previous_point")
        self._previous_point = None if previous is None else [t.to(device) for t in previous]
        held = state.get("held_point")
        self._holding = held is not None
        if held is not None:
            self._held_point = [tensor.to(device) for tensor in held]


def _copy_into(saved: list[Tensor] | None, tensors: list[Tensor]) -> list[Tensor]:
    """``tensors``' values in ``saved`` (cloned when there is none yet)."""
    if saved is None:
        return [tensor.detach().clone() for tensor in tensors]
    with torch.no_grad():
        for kept, tensor in zip(saved, tensors, strict=True):
            kept.copy_(tensor)
    return saved
