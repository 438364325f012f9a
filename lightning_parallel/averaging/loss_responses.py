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
one a step has shown healthy, so a round whose own point spikes at once is not gone back to
(the points are kept by :class:`~lightning_parallel.averaging.restart_points.RestartPoints`).
EASGD, whose replicas never agree after a round, goes back to its center (the same on every
worker) on a regression only.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_parallel.averaging.collapse import ReplicaCollapse
from lightning_parallel.averaging.plateau import LossSpike, PlateauExit
from lightning_parallel.averaging.policies import optimizer_state_tensors, reset_optimizer_state
from lightning_parallel.averaging.reduction import FlatAllReduce, counted
from lightning_parallel.averaging.restart_points import RestartPoints

__all__: list[str] = []

#: Roll-backs a regression may take to one point (a spike takes one): the second brings back a
#: network that died at the start's loss; a third would loop, as the rule re-arms at the first
#: healthy loss from the point.
REGRESSION_ROLLBACKS_TO_A_POINT = 2


class LossResponses(RestartPoints):
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
        self.rollbacks_declined = 0
        self.collapse = collapse
        self._collapsed_due: list[int] = []
        self._start_keeping_points()

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
        if not self._restore_point():
            return
        if self.spike is not None:
            self.spike.restart()
        reset_optimizer_state(self.optimizers)
        self._start_averagers()
        self.schedule.last_round_step = self.schedule.optimizer_steps
        self.schedule.phase_origin = self.schedule.optimizer_steps
        self._in_consensus = True
        self.rollbacks += 1
        self.ledger.set_gauge("rollbacks", self.rollbacks)

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
                "rollbacks_declined": self.rollbacks_declined,
                **self._points_state(),
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
            self.rollbacks_declined = int(saved.get("rollbacks_declined", 0))
            self._load_points_state(saved)
        saved = state.get("collapse")
        if self.collapse is not None and saved is not None:
            self.collapse.load_state_dict(saved)
            self._collapsed_due = [int(i) for i in saved.get("due", [])]
