"""Run the rounds of model averaging for one model replica per rank, in plain torch."""

from __future__ import annotations

import copy
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_parallel.averaging.averager import Averager, move_all
from lightning_parallel.averaging.flat import FlatLayout
from lightning_parallel.averaging.policies import (
    BUFFER_POLICIES,
    OPTIMIZER_STATE_POLICIES,
    check_choice,
    optimizer_state_tensors,
    reset_optimizer_state,
    round_buffers,
    trainable_parameters,
)
from lightning_parallel.averaging.reduction import Reduction, ReductionWork
from lightning_parallel.averaging.schedule import AveragingSchedule
from lightning_parallel.comm.devices import to_group
from lightning_parallel.comm.ledger import CommLedger, process_ledger

__all__: list[str] = []


@dataclass
class _Round:
    """A round whose reduction was started and whose result is not applied yet."""

    snapshot: list[Tensor]  # this rank's tensors when the round started
    layout: FlatLayout
    sums: list[Tensor]  # flat buffers, summed in place over the ranks
    work: ReductionWork | None  # None once the sums are complete
    num_parameters: int  # the first entries of snapshot are parameters
    started_at: int  # optimizer steps counted when the round started
    blocked_seconds: float = 0.0  # time training waited for this round so far
    parameter_means: list[Tensor] | None = None  # set when ``parameter_mean`` averaged them


class ParameterMean(Protocol):
    """Averages the replicas' parameters by a route of its own (e.g. a compressed delta).

    ``reset(start)`` is called with the agreed parameters when local training begins;
    ``__call__(local)`` is collective and returns the mean of every rank's ``local`` (new
    tensors, identical on every rank).
    """

    def reset(self, start: Sequence[Tensor]) -> None: ...

    def __call__(self, local: Sequence[Tensor]) -> list[Tensor]: ...


class ReplicaAveraging:
    """Average the replicas of one model across ranks on a schedule, with buffer and state policies.

    Each rank holds a replica ``x_i`` of ``module`` trained by its own ``optimizers``. At the
    end of every round (see :class:`~lightning_parallel.averaging.AveragingSchedule`):

    1. the trainable parameters, the floating-point buffers (``buffers="average"``) and the
       optimizer state (``optimizer_state="average"``) are packed into one flat buffer per dtype
       and summed over the ranks by ``reduction`` (flat allreduce or host-shaped tree);
    2. the divergence ``‖x_i − x̄‖`` is recorded, then the ``averager`` turns ``(x_i, x̄)`` into the
       point the parameters restart from; buffers and averaged optimizer state take the mean;
       ``optimizer_state="reset"`` clears the optimizer state;
    3. with ``overlap=True`` step 1 runs asynchronously while the next optimizer step computes,
       and step 2 is applied one step later as a correction that keeps that step's progress:
       ``x_i ← target + (x_i − x_i^snapshot)``.

    During the warm-up the caller averages gradients with :meth:`average_gradients` (synchronous
    data parallelism). All state needed to resume exactly is in :meth:`state_dict` (identical on
    every rank) and :meth:`local_state_dict` (this rank's replica, optimizer state and the round
    in flight).

    A training loop uses it like this (every rank runs the same calls)::

        averaging.broadcast_replicas()
        for batch in loader:
            averaging.synchronize()              # rounds due at this step boundary
            loss_fn(model(batch)).backward()
            if averaging.in_warmup:
                averaging.average_gradients()
            optimizer.step()
            optimizer.zero_grad()
            averaging.count_optimizer_step()
        averaging.finish()                       # every replica becomes the mean

    Args:
        module: this rank's replica.
        optimizers: the optimizers that train it (their state follows ``optimizer_state``).
        averager: the algorithm (periodic, BMUF, EASGD, outer optimizer, one-shot).
        schedule: the period and warm-up; counts optimizer steps.
        reduction: sums buffers over the ranks (``FlatAllReduce`` or ``TreeAllReduce``).
        buffers: ``"average"`` or ``"local"``.
        optimizer_state: ``"keep"``, ``"average"`` or ``"reset"``.
        overlap: start each round's reduction asynchronously and apply it one step later.
        ledger: where gauges go (``rounds``, ``divergence``, ``bytes_per_round``, and
            ``round_wait_s``: seconds training waited for the round's exchange, all of it when
            blocking, only what the next step did not hide when overlapped); the process
            ledger by default.
    """

    def __init__(
        self,
        module: nn.Module,
        optimizers: Sequence[Optimizer],
        averager: Averager,
        schedule: AveragingSchedule,
        reduction: Reduction,
        buffers: str = "average",
        optimizer_state: str = "keep",
        overlap: bool = False,
        ledger: CommLedger | None = None,
    ) -> None:
        self.module = module
        self.optimizers = list(optimizers)
        self.averager = averager
        self.schedule = schedule
        self.reduction = reduction
        self.buffers = check_choice("buffers", buffers, BUFFER_POLICIES)
        self.optimizer_state = check_choice(
            "optimizer_state", optimizer_state, OPTIMIZER_STATE_POLICIES
        )
        self.overlap = bool(overlap)
        self.ledger = ledger if ledger is not None else process_ledger()
        self.last_divergence: float | None = None
        self._round: _Round | None = None
        self._round_due = False
        self._swapped: list[tuple[Tensor, Tensor]] | None = None  # (live tensor, local copy)
        # Whether every replica (parameters and round buffers) is known to be identical, so
        # that their mean is the live model and evaluating or saving it needs no communication.
        self._in_consensus = False
        # Set by a compressor (``HyloCompression``) to average the parameters' round deltas
        # itself; buffers and optimizer state still go through ``reduction``.
        self.parameter_mean: ParameterMean | None = None

    # ------------------------------------------------------------------ schedule

    @property
    def world_size(self) -> int:
        """Number of replicas ``M``."""
        return self.reduction.world_size

    @property
    def in_warmup(self) -> bool:
        """Whether the next optimizer step is synchronous (its gradients must be averaged)."""
        return self.schedule.in_warmup

    @property
    def rounds(self) -> int:
        """Rounds started so far (restored from checkpoints)."""
        return self.schedule.rounds

    @property
    def in_consensus(self) -> bool:
        """Whether the replicas are known to be identical right now."""
        return self._in_consensus

    def count_optimizer_step(self) -> None:
        """Count one optimizer step (once per training step, however many optimizers stepped)."""
        self._in_consensus = False
        if self.schedule.count_step() and self.averager.averages_during_training:
            self._round_due = True

    def synchronize(self) -> None:
        """Do the work due at this step boundary; call it before every step and before reading.

        Applies the round in flight once an optimizer step has passed since it started, starts
        the averager when local training begins (the replicas agree then), and starts a round
        if the last counted step ended one.
        """
        if self._swapped is not None:
            return  # evaluation in progress: no step has been taken since it started
        if self._round is not None and self.schedule.optimizer_steps > self._round.started_at:
            self._finish_round()
        if not self.averager.started and not self.schedule.in_warmup:
            start = [parameter.detach() for parameter in trainable_parameters(self.module)]
            self.averager.reset(start, self.world_size)
            if self.parameter_mean is not None:
                self.parameter_mean.reset(start)
        if self._round_due:
            self._round_due = False
            self._start_round()

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
        self.reduction.all_reduce(flat).wait()
        with torch.no_grad():
            for buffer in flat:
                buffer.div_(self.world_size)
            for parameter, mean in zip(params, layout.unpack(flat), strict=True):
                if parameter.grad is None:
                    parameter.grad = mean.clone()
                else:
                    parameter.grad.copy_(mean)

    def _mean(self, tensors: Sequence[Tensor]) -> list[Tensor]:
        """The mean over the ranks of ``tensors`` (new tensors; blocking)."""
        if not tensors:
            return []
        layout = FlatLayout(tensors)
        flat = layout.pack(tensors)
        if self.world_size > 1:
            self._wait_in_flight()
            self.reduction.all_reduce(flat).wait()
            for buffer in flat:
                buffer.div_(self.world_size)
        return layout.unpack(flat)

    def _wait_in_flight(self) -> None:
        """Complete the reduction in flight (its result is still applied on schedule).

        Another reduction must not start while a tree reduction's helper thread may still be
        issuing collectives on the same groups, or the ranks could issue them in different orders.
        """
        if self._round is not None and self._round.work is not None:
            self._round.work.wait()
            self._round.work = None

    # ------------------------------------------------------------------ rounds

    def _round_tensors(self) -> tuple[list[Tensor], int]:
        parameters = trainable_parameters(self.module)
        tensors = [*parameters, *round_buffers(self.module, self.buffers)]
        if self.optimizer_state == "average":
            tensors += optimizer_state_tensors(self.optimizers)
        return tensors, len(parameters)

    def _start_round(self) -> None:
        tensors, num_parameters = self._round_tensors()
        # Blocking rounds apply before anything moves, so the live tensors are the snapshot.
        snapshot = [t.detach().clone() if self.overlap else t.detach() for t in tensors]
        reduced, parameter_means = snapshot, None
        start = time.perf_counter()
        if self.parameter_mean is not None and self.world_size > 1:
            # the parameters take their own (blocking) route; the rest the reduction
            parameter_means = self.parameter_mean(snapshot[:num_parameters])
            reduced = snapshot[num_parameters:]
        layout = FlatLayout(reduced)
        sums = layout.pack(reduced)
        self.schedule.mark_round()
        self.ledger.set_gauge("rounds", self.schedule.rounds)
        self.ledger.set_gauge("bytes_per_round", self.reduction.bytes_sent(layout.nbytes(sums)))
        work = None
        if self.world_size > 1 and sums:
            work = self.reduction.all_reduce(sums, async_op=self.overlap)
        self._round = _Round(
            snapshot,
            layout,
            sums,
            work,
            num_parameters,
            self.schedule.optimizer_steps,
            blocked_seconds=time.perf_counter() - start,
            parameter_means=parameter_means,
        )
        if not self.overlap:
            self._finish_round()

    def _finish_round(self) -> None:
        """Apply the round's result (waiting for it if needed)."""
        current = self._round
        assert current is not None
        self._round = None
        if current.work is not None:
            start = time.perf_counter()
            current.work.wait()
            current.blocked_seconds += time.perf_counter() - start
        self.ledger.set_gauge("round_wait_s", current.blocked_seconds)
        with torch.no_grad():
            for buffer in current.sums:
                buffer.div_(self.world_size)
            mean = current.layout.unpack(current.sums)
            if current.parameter_means is not None:
                mean = current.parameter_means + mean
            count = current.num_parameters
            local_parameters = current.snapshot[:count]
            mean_parameters = mean[:count]
            squared = sum(
                float((replica.double() - average.double()).pow(2).sum())
                for replica, average in zip(local_parameters, mean_parameters, strict=True)
            )
            self.last_divergence = math.sqrt(squared)
            self.ledger.set_gauge("divergence", self.last_divergence)
            targets = self.averager.update(local_parameters, mean_parameters) + mean[count:]
            live, _ = self._round_tensors()
            if [t.shape for t in live] != [t.shape for t in current.snapshot]:
                raise RuntimeError(
                    "the model or optimizer state changed shape during a round of averaging; "
                    "do not add parameters or optimizer state while training with averaging"
                )
            moved = self.schedule.optimizer_steps > current.started_at
            for tensor, snapshot, target in zip(live, current.snapshot, targets, strict=True):
                if moved:
                    tensor.copy_(target + (tensor - snapshot))
                else:
                    tensor.copy_(target)
        self._in_consensus = not moved and self.averager.restarts_in_consensus
        if self.optimizer_state == "reset":
            reset_optimizer_state(self.optimizers)

    def finish(self) -> None:
        """End training: apply every pending round, then make every replica the mean."""
        self.synchronize()
        if self._round is not None:
            self._finish_round()
        self.restore_replica()
        if self._in_consensus:
            return
        tensors = [*trainable_parameters(self.module), *round_buffers(self.module, self.buffers)]
        with torch.no_grad():
            for tensor, mean in zip(tensors, self._mean(tensors), strict=True):
                tensor.copy_(mean)
        self._in_consensus = True

    # ------------------------------------------------------------------ evaluation

    def prepare_evaluation(self, average_first: bool = True) -> None:
        """Make the model the replicas' consensus for evaluation; undo with :meth:`restore_replica`.

        Args:
            average_first: run a round now if local steps were taken since the last one (the
                evaluated model is then the model training continues from, and the round's
                exchange is the only communication); ``False`` evaluates the mean of the
                replicas without changing them (one extra exchange; training is unaffected).
        """
        self.synchronize()
        if average_first:
            if self._round is not None:
                self._finish_round()  # nothing moved since it started: applied as is
            if (
                self.averager.averages_during_training
                and self.averager.started
                and self.schedule.local_steps > 0
            ):
                self._round_due = False
                self._start_round()
                if self._round is not None:
                    self._finish_round()
        if not self._in_consensus:
            self.swap_in_mean()

    def swap_in_mean(self) -> None:
        """Put the replicas' mean into the model for validation (undo: :meth:`restore_replica`)."""
        if self._swapped is not None:
            return
        tensors = [*trainable_parameters(self.module), *round_buffers(self.module, self.buffers)]
        means = self._mean(tensors)
        with torch.no_grad():
            self._swapped = [(tensor, tensor.detach().clone()) for tensor in tensors]
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
        if self._swapped is None and not self._in_consensus:
            tensors = [
                *trainable_parameters(self.module),
                *round_buffers(self.module, self.buffers),
            ]
            means = {id(tensor): mean for tensor, mean in zip(tensors, self._mean(tensors))}
        else:
            means = {}
        return _detached_copy(state, means)

    # ------------------------------------------------------------------ checkpoint

    def state_dict(self) -> dict[str, Any]:
        """State identical on every rank: schedule counters and the averager's state."""
        return {
            "schedule": self.schedule.state_dict(),
            "averager": self.averager.state_dict() if self.averager.started else None,
            "round_due": self._round_due,
            "in_consensus": self._in_consensus,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`."""
        self.schedule.load_state_dict(state["schedule"])
        if state.get("averager") is not None:
            self.averager.load_state_dict(state["averager"])
            self.averager.to(self._device())
        self._round_due = bool(state.get("round_due", False))
        self._in_consensus = bool(state.get("in_consensus", False))

    def _device(self) -> torch.device:
        """The model's device (its first parameter's; the CPU for a model without any)."""
        return next(self.module.parameters(), torch.empty(0)).device

    def local_state_dict(self) -> dict[str, Any]:
        """This rank's own state: its replica, its optimizers' state and the round in flight."""
        self._wait_in_flight()
        local = {id(tensor): saved for tensor, saved in self._swapped or []}
        model = _detached_copy(self.module.state_dict(keep_vars=True), local)
        pending = None
        if self._round is not None:
            pending = {
                "snapshot": [tensor.clone() for tensor in self._round.snapshot],
                "sums": [tensor.clone() for tensor in self._round.sums],
                "num_parameters": self._round.num_parameters,
                "started_at": self._round.started_at,
            }
        return {
            "model": model,
            "optimizers": [copy.deepcopy(optimizer.state_dict()) for optimizer in self.optimizers],
            "pending_round": pending,
        }

    def load_local_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`local_state_dict` (the module and optimizers must exist)."""
        self.restore_replica()
        self.module.load_state_dict(state["model"])
        for optimizer, optimizer_state in zip(self.optimizers, state["optimizers"], strict=True):
            optimizer.load_state_dict(optimizer_state)
        pending = state.get("pending_round")
        self._round = None
        if pending is not None:
            # the replica file was loaded onto the CPU; the round's tensors live with the model
            device = self._device()
            snapshot = move_all(pending["snapshot"], device)
            self._round = _Round(
                snapshot=snapshot,
                layout=FlatLayout(snapshot),
                sums=move_all(pending["sums"], device),
                work=None,
                num_parameters=int(pending["num_parameters"]),
                started_at=int(pending["started_at"]),
            )


def _detached_copy(state: dict[str, Any], replace: dict[int, Tensor]) -> dict[str, Any]:
    """A copy of ``state`` whose tensors are detached clones, some replaced by identity."""
    copied: dict[str, Any] = {}
    for key, value in state.items():
        if isinstance(value, Tensor):
            copied[key] = replace.get(id(value), value).detach().clone()
        else:
            copied[key] = value
    return copied
