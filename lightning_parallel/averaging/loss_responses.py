"""What model averaging does about the training loss: a synchronous window, a roll-back, a
replacement.

:class:`LossResponses` is the part of :class:`~lightning_parallel.averaging.ReplicaAveraging`
that watches the replicas' training loss (one scalar all-reduced per local step, or one per
replica when :class:`ReplicaCollapse` watches them) with the rules of
:mod:`~lightning_parallel.averaging.plateau` and :mod:`~lightning_parallel.averaging.collapse`
and answers them: a window of synchronous steps where the loss leaves its initial plateau
(:class:`PlateauExit`), the replacement of a replica that fell back to the starting loss by the
healthy replicas' mean (:class:`ReplicaCollapse`), and a roll-back of every replica to the last
agreed point after a spike or regression of the mean loss (:class:`LossSpike`): the last
one a step has shown healthy, so a round whose own point spikes at once is not gone back to.
EASGD, whose replicas never agree after a round, goes back to its center (the same on every
worker) on a regression only.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_parallel.averaging.collapse import ReplicaCollapse
from lightning_parallel.averaging.exchange import RoundExchange
from lightning_parallel.averaging.plateau import LossSpike, PlateauExit
from lightning_parallel.averaging.policies import (
    optimizer_state_tensors,
    reset_optimizer_state,
    round_buffers,
)
from lightning_parallel.averaging.reduction import FlatAllReduce, counted
from lightning_parallel.averaging.rounds import Agreement

__all__: list[str] = []

#: Roll-backs a regression may take to one point (a spike takes one): the second brings back a
#: network that died at the start's loss; a third would loop, as the rule re-arms at the first
#: healthy loss from the point.
REGRESSION_ROLLBACKS_TO_A_POINT = 2


class LossResponses(RoundExchange):
    """Watch the mean training loss and answer its plateau exit and its spikes.

    The round runner (:class:`~lightning_parallel.averaging.ReplicaAveraging`) provides
    :meth:`_start_averagers`, and calls :meth:`watch_loss` once.
    """

    def watch_loss(
        self,
        plateau: PlateauExit | None,
        window_steps: int,
        spike: LossSpike | None,
        collapse: ReplicaCollapse | None = None,
    ) -> None:
        """Set the rules (``None``: not watched) and the synchronous window's length."""
        if plateau is not None and (
            isinstance(window_steps, bool) or int(window_steps) != window_steps or window_steps < 1
        ):
            raise ValueError(
                f"window_steps must be a positive integer with a plateau rule, got {window_steps!r}"
            )
        self.plateau = plateau
        self.window_steps = int(window_steps)
        self._window_due = False
        self.spike = spike
        self._rollback_due = False
        self.rollbacks = 0
        # points to go back to kept so far, and that count at the last roll-back: a rule
        # firing again before a new one is kept would go back to the same point, and does not
        self._points_kept = 0
        self._points_at_rollback: int | None = None
        self._rollbacks_to_point = 0  # roll-backs since that count last changed
        self.rollbacks_declined = 0
        self.collapse = collapse
        self._collapsed_due: list[int] = []
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

    if TYPE_CHECKING:  # the round runner's, defined by ReplicaAveraging

        def _start_averagers(self) -> None: ...

    def _respond_to_loss(self) -> None:
        """At a step boundary: roll back after a spike, open the window after the plateau."""
        if self._rollback_due:
            self._collapsed_due = []  # every replica goes back: none is replaced
            self._roll_back()
        if self._collapsed_due:
            self._replace_collapsed()
        if self._window_due:
            self._open_window()

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

    @property
    def observes_loss(self) -> bool:
        """Whether the caller must pass this step's loss to :meth:`observe_loss`: a local step
        (rounds during training, several replicas) with a plateau rule that has not fired, a
        spike rule with a point to roll back to (the algorithm restarts the replicas in
        consensus, or keeps EASGD's center), or the collapse rule."""
        if (
            self.schedule.in_warmup
            or not self.averager.averages_during_training
            or self.world_size == 1
        ):
            return False
        watching_plateau = self.plateau is not None and not self.plateau.fired
        watching_spikes = self.spike is not None and self._can_roll_back
        return watching_plateau or watching_spikes or self.collapse is not None

    def observe_loss(self, loss: Tensor | float) -> None:
        """Feed the loss rules this step's loss, averaged over the ranks (collective: every
        rank calls it at the same step, while :attr:`observes_loss`)."""
        if not self.observes_loss:
            return
        value = torch.as_tensor(loss, dtype=torch.float64).detach().reshape(1).clone()
        if not isinstance(self.reduction, FlatAllReduce):
            # a tree reduction's helper thread must not interleave; a flat one's rounds in
            # flight keep running behind this scalar (gloo matches collectives by order)
            self._wait_in_flight()
        if self.collapse is None:
            ranks = counted(self.reduction.all_reduce([value]), self.world_size)
            mean = float(value.item()) / ranks
        else:
            mean = self._observe_replicas(value)
        if self.plateau is not None and self.plateau.observe(mean):
            self._window_due = True
            self.ledger.set_gauge("synchronous_window_at", self.schedule.optimizer_steps)
        watching = self.spike is not None and self.averager.started and self._can_roll_back
        regressions = self.spike.regressions if self.spike is not None else 0
        if watching and self.spike is not None and self.spike.observe(mean):
            self.ledger.set_gauge("loss_spikes", self.spike.spikes)
            self.ledger.set_gauge("loss_regressions", self.spike.regressions)
            regression = self.spike.regressions > regressions
            if not regression and self._rolls_back_to_center:
                return  # EASGD goes back to its center on a regression only
            limit = REGRESSION_ROLLBACKS_TO_A_POINT if regression else 1
            if self._no_point_since_rollback and self._rollbacks_to_point >= limit:
                # no point kept since the last roll-back: going back to the same one again
                # would repeat it (vgg_mini: a spike every 6 steps, 9 to 36 roll-backs and no
                # round between them), so training goes on through this one. A regression
                # gets a second roll-back to the point: a network dead at the start's loss
                # does not come back by itself (diloco on vgg_mini, seed 3: 25 steps at 2.30
                # after a declined regression, 0.581; 0.856 with the second roll-back), but
                # not a third (the rule re-arms at the first healthy loss from the point, so
                # a point whose run dies every time would be gone back to without end)
                self.rollbacks_declined += 1
                self.ledger.set_gauge("rollbacks_declined", self.rollbacks_declined)
            else:
                self._rollback_due = True
            return
        if watching and math.isfinite(mean):
            self._verified = True  # a step from the newest agreed point fired no rule
            self._previous_agreements.clear()
        if self._holding and self.spike is not None and not self.spike.unsettled:
            self._release_held_point()

    def _observe_replicas(self, value: Tensor) -> float:
        """All-reduce every replica's loss in its own slot (``2·W`` scalars: the losses, then
        who took part), feed them to the collapse rule, and return their mean."""
        world, rank = dist.get_world_size(), dist.get_rank()
        slots = torch.zeros(2 * world, dtype=torch.float64, device=value.device)
        slots[rank] = value[0]
        slots[world + rank] = 1.0
        self.reduction.all_reduce([slots]).wait()
        present = slots[world:].tolist()
        losses = [
            float(loss) if taking_part > 0.5 else None
            for loss, taking_part in zip(slots[:world].tolist(), present, strict=True)
        ]
        seen = [loss for loss in losses if loss is not None]
        assert self.collapse is not None
        collapsed = self.collapse.observe(losses)
        if collapsed:
            self._collapsed_due = collapsed
        return sum(seen) / len(seen) if seen else float("nan")

    def _replace_collapsed(self) -> None:
        """The collapsed replicas take the healthy replicas' mean model and optimizer state (one
        all-reduce of both, only the healthy ranks contributing); the schedule goes on."""
        assert self.collapse is not None
        collapsed, self._collapsed_due = self._collapsed_due, []
        healthy = self.collapse.healthy()
        if not healthy:
            return
        self._finish_rounds()  # a round in flight holds the collapsed replica's values
        tensors = self._model_tensors() + optimizer_state_tensors(self.optimizers)
        means = self._mean(tensors, among=healthy)
        if dist.get_rank() in collapsed:
            with torch.no_grad():
                for tensor, mean in zip(tensors, means, strict=True):
                    tensor.copy_(mean)
        self.collapse.replaced(collapsed)
        self.ledger.set_gauge("replicas_replaced", self.collapse.collapses)

    def _roll_back(self) -> None:
        """Every replica restarts from the last agreed point a step has shown healthy (the
        newest round's, else the one before it), optimizer state, averagers and the spike
        rule's level restarted; the next round is ``period`` steps away. Until a new point to
        go back to is kept, a spike fires without rolling back again, and a regression rolls
        back once more at most (:meth:`observe_loss`)."""
        self._rollback_due = False
        self._finish_rounds()
        self._due = []
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
            return
        self._verified = True
        self._previous_agreements.clear()
        self._holding = False  # a point inside the climb is never gone back to
        if self.spike is not None:
            self.spike.restart()
        reset_optimizer_state(self.optimizers)
        self._start_averagers()
        self.schedule.last_round_step = self.schedule.optimizer_steps
        self.schedule.phase_origin = self.schedule.optimizer_steps
        self._in_consensus = True
        self.rollbacks += 1
        self._rollbacks_to_point = (
            self._rollbacks_to_point + 1 if self._no_point_since_rollback else 1
        )
        self._points_at_rollback = self._points_kept
        self.ledger.set_gauge("rollbacks", self.rollbacks)

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

    def _open_window(self) -> None:
        """Every replica takes the mean model and optimizer state; the next ``window_steps``
        steps are synchronous; the averagers restart when they end."""
        self._window_due = False
        self._finish_rounds()
        self._due = []
        tensors = self._model_tensors() + optimizer_state_tensors(self.optimizers)
        with torch.no_grad():
            for tensor, mean in zip(tensors, self._mean(tensors), strict=True):
                tensor.copy_(mean)
        self._in_consensus = True
        self.schedule.open_synchronous_window(self.window_steps)
        for averager in self.averagers:
            averager.stop()

    # ------------------------------------------------------------------ checkpoint

    def state_dict(self) -> dict[str, Any]:
        """:meth:`ReplicaState.state_dict` with the plateau rule's state."""
        state = super().state_dict()
        if self.plateau is not None:
            state["plateau"] = {**self.plateau.state_dict(), "window_due": self._window_due}
        if self.spike is not None:
            state["spike"] = {
                **self.spike.state_dict(),
                "rollback_due": self._rollback_due,
                "rollbacks": self.rollbacks,
                "points_kept": self._points_kept,
                "points_at_rollback": self._points_at_rollback,
                "rollbacks_to_point": self._rollbacks_to_point,
                "rollbacks_declined": self.rollbacks_declined,
                "verified": self._verified,
                "previous_agreements": {
                    index: None if before is None else before.state_dict()
                    for index, before in self._previous_agreements.items()
                },
            }
        if self.collapse is not None:
            state["collapse"] = {**self.collapse.state_dict(), "due": list(self._collapsed_due)}
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`."""
        super().load_state_dict(state)
        saved = state.get("plateau")
        if self.plateau is not None and saved is not None:
            self.plateau.load_state_dict(saved)
            self._window_due = bool(saved.get("window_due", False))
        saved = state.get("spike")
        if self.spike is not None and saved is not None:
            self.spike.load_state_dict(saved)
            self._rollback_due = bool(saved.get("rollback_due", False))
            self.rollbacks = int(saved.get("rollbacks", 0))
            self._points_kept = int(saved.get("points_kept", 0))
            at = saved.get("points_at_rollback")
            self._points_at_rollback = None if at is None else int(at)
            self._rollbacks_to_point = int(saved.get("rollbacks_to_point", 0 if at is None else 1))
            self.rollbacks_declined = int(saved.get("rollbacks_declined", 0))
            self._verified = bool(saved.get("verified", True))
            device = self._device()
            self._previous_agreements = {
                int(index): None if before is None else Agreement.from_state_dict(before, device)
                for index, before in (saved.get("previous_agreements") or {}).items()
            }
        saved = state.get("collapse")
        if self.collapse is not None and saved is not None:
            self.collapse.load_state_dict(saved)
            self._collapsed_due = [int(i) for i in saved.get("due", [])]

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
