"""The state a replica shares with the others: their mean, the agreed points, the checkpoint."""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_parallel.averaging.averager import Averager
from lightning_parallel.averaging.flat import FlatLayout
from lightning_parallel.averaging.fragments import Fragment
from lightning_parallel.averaging.policies import round_buffers, trainable_parameters
from lightning_parallel.averaging.reduction import Reduction, counted
from lightning_parallel.averaging.rounds import Agreement, Round
from lightning_parallel.averaging.schedule import AveragingSchedule
from lightning_parallel.comm.devices import to_group

__all__: list[str] = []


class ReplicaState:
    """What :class:`~lightning_parallel.averaging.ReplicaAveraging` holds besides its rounds.

    This rank's replica (``module``, ``optimizers``), the averagers (one per fragment), each
    fragment's last agreed point, the rounds in flight, and the collectives that do not follow
    the schedule: the broadcast at the start, the warm-up's gradient mean, the replicas' mean
    for evaluation and checkpoints. Checkpoints: :meth:`state_dict` (identical on every rank)
    and :meth:`local_state_dict` (this rank's own).
    """

    def __init__(
        self,
        module: nn.Module,
        optimizers: Sequence[Optimizer],
        averagers: list[Averager],
        schedule: AveragingSchedule,
        reduction: Reduction,
        buffers: str,
        fragments: list[Fragment],
        keep_agreement: bool,
    ) -> None:
        self.module = module
        self.optimizers = list(optimizers)
        self.averagers = averagers
        self.schedule = schedule
        self.reduction = reduction
        self.buffers = buffers
        self.fragments = fragments
        self._keep_agreement = keep_agreement
        self.agreements: list[Agreement | None] = [None] * len(fragments)
        self.peak_round_bytes = 0.0
        self._rounds: list[Round] = []
        self._due: list[int] = []
        self._swapped: list[tuple[Tensor, Tensor]] | None = None  # (live tensor, local copy)
        self._swapped_mean = True  # what is swapped in: the mean, or the agreed points
        # Whether every replica (parameters and round buffers) is known to be identical, so
        # that their mean is the live model and evaluating or saving it needs no communication.
        self._in_consensus = False
        # Set by an evaluation while it runs its rounds: the replicas' mean after the last
        # round landed then, where that round's mean tells it (EASGD), so that evaluating the
        # mean needs no exchange of its own; None otherwise.
        self._watch_round_mean = False
        self._round_mean: list[Tensor] | None = None

    @property
    def averager(self) -> Averager:
        """The algorithm (the first fragment's copy when the model is fragmented)."""
        return self.averagers[0]

    @property
    def keeps_agreement(self) -> bool:
        """Whether each fragment's last agreed point is kept (streaming, quantized, or for
        ``policy="global"`` evaluation): a checkpoint resumes exactly only into a run alike."""
        return self._keep_agreement

    @property
    def world_size(self) -> int:
        """Number of replicas ``M``."""
        return self.reduction.world_size

    def _model_tensors(self) -> list[Tensor]:
        """The tensors a round averages, all fragments together: parameters, then buffers."""
        return [*trainable_parameters(self.module), *round_buffers(self.module, self.buffers)]

    # ------------------------------------------------------------------ communication

    def broadcast_replicas(self, src: int = 0) -> None:
        """Make every replica (all parameters and buffers) equal to rank ``src``'s."""
        if self.world_size == 1:
            self._in_consensus = True
            return
        tensors = [*self.module.parameters(), *self.module.buffers()]
        if not tensors:
            return
        layout = FlatLayout(tensors)
        flat = [to_group(buffer) for buffer in layout.pack(tensors)]  # on the group's device
        for buffer in flat:
            dist.broadcast(buffer, src=src)
        with torch.no_grad():
            for tensor, value in zip(tensors, layout.unpack(flat), strict=True):
                tensor.copy_(value)
        self._in_consensus = True

    def average_gradients(self, parameters: Sequence[Tensor] | None = None) -> None:
        """Replace the gradients of ``parameters`` by their mean over the ranks (warm-up steps).

        A parameter without a gradient takes part with zeros, so that every rank sends the same
        layout; it then holds the mean of the others' gradients, as under DDP.
        """
        if self.world_size == 1:
            return
        params = list(parameters) if parameters is not None else trainable_parameters(self.module)
        params = [parameter for parameter in params if parameter.requires_grad]
        if not params:
            return
        self._wait_in_flight()
        grads = [
            parameter.grad if parameter.grad is not None else torch.zeros_like(parameter)
            for parameter in params
        ]
        layout = FlatLayout(grads)
        flat = layout.pack(grads)
        ranks = counted(self.reduction.all_reduce(flat), self.world_size)
        with torch.no_grad():
            for buffer in flat:
                buffer.div_(ranks)
            for parameter, mean in zip(params, layout.unpack(flat), strict=True):
                if parameter.grad is None:
                    parameter.grad = mean.clone()
                else:
                    parameter.grad.copy_(mean)

    def _mean(self, tensors: Sequence[Tensor], among: Sequence[int] | None = None) -> list[Tensor]:
        """The mean over the ranks of ``tensors`` (new tensors; blocking; every rank calls it),
        or over the ranks in ``among`` alone (the others contribute zeros)."""
        if not tensors:
            return []
        layout = FlatLayout(tensors)
        flat = layout.pack(tensors)
        if self.world_size > 1:
            self._wait_in_flight()
            if among is not None and dist.get_rank() not in among:
                for buffer in flat:
                    buffer.zero_()
            ranks = counted(self.reduction.all_reduce(flat), self.world_size)
            for buffer in flat:
                buffer.div_(ranks if among is None else len(among))
        return layout.unpack(flat)

    def _wait_in_flight(self) -> None:
        """Complete the reductions in flight (their results are still applied on schedule).

        Another reduction must not start while a tree reduction's helper thread may still be
        issuing collectives on the same groups, or the ranks could issue them in different orders.
        """
        for pending in self._rounds:
            pending.wait()

    # ------------------------------------------------------------------ views

    def _put_agreement(self) -> None:
        """Write every fragment's agreed point into the live model."""
        parameters = trainable_parameters(self.module)
        buffers = round_buffers(self.module, self.buffers)
        with torch.no_grad():
            for fragment, agreement in zip(self.fragments, self.agreements, strict=True):
                assert agreement is not None
                for i, value in zip(fragment.parameters, agreement.anchor, strict=True):
                    parameters[i].copy_(value)
                for i, value in zip(fragment.buffers, agreement.buffers or [], strict=False):
                    buffers[i].copy_(value)

    def swap_in_mean(self, known: Sequence[Tensor] | None = None) -> None:
        """Put the replicas' mean into the model for validation (undo: :meth:`restore_replica`);
        ``known``: that mean, already known on every rank (no exchange)."""
        if self._swapped is not None:
            return
        tensors = self._model_tensors()
        means = list(known) if known is not None else self._mean(tensors)
        with torch.no_grad():
            self._swapped = [(tensor, tensor.detach().clone()) for tensor in tensors]
            self._swapped_mean = True
            for tensor, mean in zip(tensors, means, strict=True):
                tensor.copy_(mean)

    def restore_replica(self) -> None:
        """Put this rank's own replica back after :meth:`swap_in_mean`."""
        if self._swapped is None:
            return
        with torch.no_grad():
            for tensor, local in self._swapped:
                tensor.copy_(local)
        self._swapped = None

    def averaged_state_dict(self) -> dict[str, Any]:
        """``module.state_dict()`` with the mean of the replicas (the model to save or evaluate).

        Collective: every rank must call it. Buffers follow the buffer policy (``local``: this
        rank's own).
        """
        state = self.module.state_dict(keep_vars=True)
        means: dict[int, Tensor] = {}
        if self._swapped is not None and not self._swapped_mean:
            # the agreed points are swapped in for validation: the mean is of the replicas
            live = [tensor for tensor, _ in self._swapped]
            replicas = self._mean([local for _, local in self._swapped])
            means = {id(tensor): mean for tensor, mean in zip(live, replicas)}
        elif self._swapped is None and not self._in_consensus:
            tensors = self._model_tensors()
            means = {id(tensor): mean for tensor, mean in zip(tensors, self._mean(tensors))}
        return _detached_copy(state, means)

    # ------------------------------------------------------------------ checkpoint

    def state_dict(self) -> dict[str, Any]:
        """State identical on every rank: schedule counters, the averagers' state, agreements."""
        started = self.averager.started
        state: dict[str, Any] = {
            "schedule": self.schedule.state_dict(),
            "averager": self.averager.state_dict() if started else None,
            "due_fragments": list(self._due),
            "round_due": bool(self._due),
            "in_consensus": self._in_consensus,
            "fragments": len(self.fragments),
            "agreements_kept": self._keep_agreement,
            "peak_round_bytes": self.peak_round_bytes,
        }
        if len(self.fragments) > 1:
            state["averagers"] = [a.state_dict() if started else None for a in self.averagers]
        if self._keep_agreement:
            state["agreements"] = [a.state_dict() if a else None for a in self.agreements]
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`."""
        saved_fragments = int(state.get("fragments", 1))
        if saved_fragments != len(self.fragments):
            raise ValueError(
                f"the checkpoint's averaging ran {saved_fragments} fragments, this run "
                f"{len(self.fragments)}; resume with the same fragments"
            )
        self.schedule.load_state_dict(state["schedule"])
        device = self._device()
        averager_states = state.get("averagers") or [state.get("averager")]
        for averager, saved in zip(self.averagers, averager_states, strict=True):
            if saved is not None:
                averager.load_state_dict(saved)
                averager.to(device)
        if "due_fragments" in state:
            self._due = [int(index) for index in state["due_fragments"]]
        else:  # a checkpoint from before fragments
            self._due = [0] if state.get("round_due", False) else []
        self._in_consensus = bool(state.get("in_consensus", False))
        self.peak_round_bytes = float(state.get("peak_round_bytes", 0.0))
        for index, saved in enumerate(state.get("agreements") or []):
            previous = self.agreements[index]
            restored = None if saved is None else Agreement.from_state_dict(saved, device)
            if restored is not None and previous is not None:
                restored.residual = previous.residual  # this rank's own: the local state's
            self.agreements[index] = restored

    def _device(self) -> torch.device:
        """The model's device (its first parameter's; the CPU for a model without any)."""
        return next(self.module.parameters(), torch.empty(0)).device

    def local_state_dict(self) -> dict[str, Any]:
        """This rank's own state: its replica, its optimizers' state, error-feedback residuals
        and the rounds in flight."""
        self._wait_in_flight()
        local = {id(tensor): saved for tensor, saved in self._swapped or []}
        model = _detached_copy(self.module.state_dict(keep_vars=True), local)
        return {
            "model": model,
            "optimizers": [copy.deepcopy(optimizer.state_dict()) for optimizer in self.optimizers],
            "pending_rounds": [pending.state_dict() for pending in self._rounds],
            "residuals": [
                None if a is None or a.residual is None else a.residual.clone()
                for a in self.agreements
            ],
        }

    def load_local_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`local_state_dict` (the module and optimizers must exist)."""
        self.restore_replica()
        self.module.load_state_dict(state["model"])
        for optimizer, optimizer_state in zip(self.optimizers, state["optimizers"], strict=True):
            optimizer.load_state_dict(optimizer_state)
        # the replica file was loaded onto the CPU; the rounds' tensors live with the model
        device = self._device()
        pending = state.get("pending_rounds")
        if pending is None:  # a checkpoint from before fragments: one round at most
            pending = [] if state.get("pending_round") is None else [state["pending_round"]]
        self._rounds = [Round.from_state_dict(saved, device) for saved in pending]
        for agreement, residual in zip(self.agreements, state.get("residuals") or [], strict=False):
            if agreement is not None and residual is not None:
                agreement.residual = residual.to(device)


def _detached_copy(state: dict[str, Any], replace: dict[int, Tensor]) -> dict[str, Any]:
    """A copy of ``state`` whose tensors are detached clones, some replaced by identity."""
    copied: dict[str, Any] = {}
    for key, value in state.items():
        if isinstance(value, Tensor):
            copied[key] = replace.get(id(value), value).detach().clone()
        else:
            copied[key] = value
    return copied
