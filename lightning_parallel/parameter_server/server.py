"""One server shard as a pure state machine: requests in, replies out, no communication.

:class:`ShardServer` owns a slice of the flat parameters and an optimizer over it (the user's
optimizer class and hyperparameters), both held by its
:class:`~lightning_parallel.parameter_server.updates.ShardUpdater`, which applies each group of
gradients; the server keeps the workers, the pending gradients, versions, grants and replies.
Threads and the network live in :class:`~lightning_parallel.parameter_server.host.ShardHost`;
the deterministic simulator (:mod:`~lightning_parallel.parameter_server.simulation`) drives the
same class without them.

Algorithm, for each request (Zhang et al. 2016; Ho et al. 2013; Zheng et al. 2017):

1. ``BEGIN``: the worker starts an epoch; it reads the current weights (version v) and is
   granted batches of the epoch budget.
2. ``STEP`` with a gradient: the gradient joins the pending list with the version it was
   computed on. A ``STEP`` without one is a pull: the worker reads version v at once.
3. While :meth:`UpdatePolicy.group_size` allows, the oldest pending gradients form one update
   at version v (:mod:`~lightning_parallel.parameter_server.updates`): each gets staleness
   τ = v − read; gradients with τ above the drop bound are discarded; the others are
   delay-compensated (DC-ASGD) and combined as ĝ = Σ f(τ_i)·g_i / Σ f(τ_i) with a learning
   rate η·mean f(τ_i). The optimizer steps and the version becomes v + 1. Each worker of the
   group reads version v + 1 in its reply.
4. ``DRAIN``: a worker's last step of the epoch is answered only when every live worker has
   drained and no gradient is pending, so that every rank leaves the epoch with the same
   weights, in step with Lightning's collectives.
5. A failed worker (:meth:`fail`) that the run can go on without (``expendable``: it hosts
   no shard and is not rank 0) is *lost*: it no longer counts for soft synchronization, SSP or
   the drain, its spare batches go back to the epoch's pool, and the others continue; the
   count of lost workers travels in every reply, so that every worker learns of it at the
   same drain. Any other failed worker aborts the run: every waiting and every later request
   is answered with ``ABORT`` naming the failed rank.
"""

from __future__ import annotations

import copy
import enum
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from torch.optim import Optimizer

from lightning_parallel.parameter_server.budget import EpochBudget
from lightning_parallel.parameter_server.policies import UpdatePolicy
from lightning_parallel.parameter_server.protocol import (
    FailureKind,
    Reply,
    ReplyFlag,
    ReplyKind,
    Request,
    RequestFlag,
    RequestKind,
)
from lightning_parallel.parameter_server.snapshots import SnapshotPool
from lightning_parallel.parameter_server.telemetry import ServerStatistics
from lightning_parallel.parameter_server.updates import PendingGradient, ShardUpdater

__all__: list[str] = []


class WorkerStatus(enum.Enum):
    """Where a worker is, as the server sees it."""

    IDLE = "idle"  # between epochs (or not begun)
    COMPUTING = "computing"  # holds weights, computing a gradient
    WAITING = "waiting"  # its gradient is pending; waits for the reply
    DRAIN_PENDING = "drain_pending"  # its last gradient of the epoch is pending
    DRAINING = "draining"  # done with the epoch; waits for every worker to drain
    LEFT = "left"
    FAILED = "failed"


_LIVE = (
    WorkerStatus.IDLE,
    WorkerStatus.COMPUTING,
    WorkerStatus.WAITING,
    WorkerStatus.DRAIN_PENDING,
    WorkerStatus.DRAINING,
)
_WAITING_FOR_REPLY = (WorkerStatus.WAITING, WorkerStatus.DRAIN_PENDING, WorkerStatus.DRAINING)


@dataclass
class _Worker:
    status: WorkerStatus = WorkerStatus.IDLE
    read_version: int = 0
    weights_read: Tensor | None = None  # the exact weights it read (DC-ASGD's w_used)
    # the read before that: a worker that overlaps its exchange (ParameterClient's
    # ``overlap``) computes its gradient on it, and says so with the version in its request
    previous_version: int = -1
    previous_weights: Tensor | None = None
    want: int = 0
    held: int = 0
    lends: bool = True  # its spare granted batches may go to faster workers
    staleness: int = -1  # staleness of its last consumed gradient, for the reply
    dropped: bool = False
    waiting_since: float = 0.0


class ShardServer:
    """A shard of the parameter server: weights, optimizer, versions and policy.

    Args:
        parameters: the shard's initial parameters (copied into one flat CPU vector).
        make_optimizer: builds the shard's optimizer over the list of parameter tensors it is
            given (views of the flat vector, with the original shapes).
        policy: the update rules.
        workers: global ranks of all workers.
        expendable: workers whose failure the run survives (see step 5; default: none).
        budget: the epoch budget (only the first shard holds one; ``None`` elsewhere).
        before_update: called with the optimizer before every update (the strategy uses it to
            copy the current learning rate and other hyperparameters from the user's optimizer,
            so that learning-rate schedulers keep working).
        clock: time source for waiting-time telemetry.
    """

    def __init__(
        self,
        parameters: Sequence[Tensor],
        make_optimizer: Callable[[list[Tensor]], Optimizer],
        policy: UpdatePolicy,
        workers: Sequence[int],
        *,
        expendable: Collection[int] = (),
        budget: EpochBudget | None = None,
        before_update: Callable[[Optimizer], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.policy = policy
        self.statistics = ServerStatistics()
        #: the flat weights and the optimizer (it checks the parameters first), and step 3
        self.updater = ShardUpdater(
            parameters, make_optimizer, policy, self.statistics, before_update=before_update
        )
        # the updater's, never reassigned (updated in place)
        self.weights, self.gradient = self.updater.weights, self.updater.gradient
        self.parameters, self.optimizer = self.updater.parameters, self.updater.optimizer
        self.budget = budget
        self.version = 0
        self.failure: tuple[int, str] | None = None
        self.failure_kind = FailureKind.UNKNOWN
        self.expendable = frozenset(int(rank) for rank in expendable)
        #: workers lost so far, in order, with the reason (step 5)
        self.lost: list[tuple[int, str]] = []
        self._clock = clock
        self._workers = {int(rank): _Worker() for rank in workers}
        self._pending: list[PendingGradient] = []
        self._snapshot: Tensor | None = None
        self._snapshots = SnapshotPool(self.weights, limit=len(self._workers) + 2)
        self._buffers: dict[int, Tensor] = {}

    # ------------------------------------------------------------------ requests

    def gradient_buffer(self, worker: int) -> Tensor:
        """Where a remote worker's gradient for this shard is received.

        One per worker suffices: a worker sends its next gradient only after the reply to the
        previous one, which comes after the previous gradient was consumed.
        """
        if worker not in self._buffers:
            self._buffers[worker] = torch.empty_like(self.weights)
        return self._buffers[worker]

    def handle(self, request: Request) -> list[Reply]:
        """Process one request; return the replies now due (to this and other workers)."""
        worker = self._worker(request.worker)
        if request.kind == RequestKind.LEAVE:
            worker.status = WorkerStatus.LEFT
            return [] if self.failure else self._progress()
        if self.failure is not None:
            return [self._abort(request.worker)]
        if worker.status == WorkerStatus.FAILED:
            # a lost worker that comes back (it was frozen, or cut off, longer than the
            # heartbeat timeout): the others went on without it; it must stop
            return [self._abort(request.worker, failed=request.worker)]
        if worker.status == WorkerStatus.LEFT:
            raise RuntimeError(
                f"worker rank {request.worker} sent {request.kind.name} after leaving"
            )
        worker.lends = RequestFlag.KEEPS_GRANTS not in request.flags
        if request.kind == RequestKind.BEGIN:
            granted, flags = (
                self.budget.begin(
                    request.worker,
                    request.epoch_batches,
                    request.want,
                    restart=RequestFlag.RESTART in request.flags,
                    lends=worker.lends,
                )
                if self.budget is not None
                else (0, ReplyFlag.NONE)
            )
            return [self._read(request.worker, granted, flags)]
        if request.kind == RequestKind.CLAIM:
            granted, flags = self._grant(request.worker, request.want, request.held)
            return [self._reply(request.worker, granted, flags)]
        worker.want, worker.held = request.want, request.held
        drain = RequestFlag.DRAIN in request.flags
        if RequestFlag.HAS_GRADIENT in request.flags:
            if request.gradient is None or request.gradient.numel() != self.weights.numel():
                raise ValueError(f"worker rank {request.worker} sent a gradient of the wrong size")
            read_version, weights_read = self._computed_on(request)
            pending = PendingGradient(
                request.worker, read_version, request.gradient, drain, weights_read
            )
            self._pending.append(pending)
            worker.status = WorkerStatus.DRAIN_PENDING if drain else WorkerStatus.WAITING
            worker.waiting_since = self._clock()
            replies = self._progress()
            if (
                self.policy.answers_before_update
                and not drain
                and worker.status == WorkerStatus.WAITING
                and any(p is pending for p in self._pending)
            ):
                # n-softsync: the worker does not wait for its group; its gradient does (a copy:
                # the worker's receive buffer is reused for its next gradient)
                pending.gradient = pending.gradient.clone()
                pending.answered = True
                granted, flags = self._grant(request.worker, worker.want, worker.held)
                replies.append(self._read(request.worker, granted, flags))
            return replies
        worker.staleness, worker.dropped = -1, False
        if drain:
            worker.status = WorkerStatus.DRAINING
            worker.waiting_since = self._clock()
            return self._progress()
        granted, flags = self._grant(request.worker, request.want, request.held)
        return [self._read(request.worker, granted, flags)]

    def fail(
        self, worker: int, reason: str, kind: FailureKind = FailureKind.UNKNOWN
    ) -> list[Reply]:
        """Worker ``worker`` is gone: lose it if it is expendable and the failure is not a
        protocol error (the others go on: the replies now due), else abort every waiting
        worker (and all later requests)."""
        state = self._workers.get(worker)
        if state is None or state.status in (WorkerStatus.LEFT, WorkerStatus.FAILED):
            return []
        if self.failure is not None:
            return []
        state.status = WorkerStatus.FAILED
        if worker in self.expendable and kind != FailureKind.PROTOCOL:
            self.lost.append((worker, reason))
            if self.budget is not None:
                self.budget.forget(worker)
            # its pending gradient, if any, was received whole and is applied; groups and
            # the drain no longer wait for it
            return self._progress()
        self.failure = (worker, reason)
        self.failure_kind = kind
        return [
            self._abort(rank)
            for rank, other in self._workers.items()
            if other.status in _WAITING_FOR_REPLY
        ]

    @property
    def live_workers(self) -> list[int]:
        return [rank for rank, worker in self._workers.items() if worker.status in _LIVE]

    def status(self, worker: int) -> WorkerStatus:
        return self._worker(worker).status

    # ------------------------------------------------------------------ updates

    def _progress(self) -> list[Reply]:
        replies: list[Reply] = []
        while True:
            # a worker that has not begun the epoch yet will read the current version and
            # send a gradient too: synchronous and softsync groups must wait for it
            computing = [
                worker.read_version if worker.status == WorkerStatus.COMPUTING else self.version
                for worker in self._workers.values()
                if worker.status in (WorkerStatus.COMPUTING, WorkerStatus.IDLE)
            ]
            size = self.policy.group_size(
                [pending.read_version for pending in self._pending], computing, self.version
            )
            if size == 0:
                break
            group, self._pending = self._pending[:size], self._pending[size:]
            self._apply(group)
            for pending in group:
                worker = self._workers[pending.worker]
                if pending.answered:
                    continue  # its worker got weights back when it pushed
                if worker.status not in (WorkerStatus.WAITING, WorkerStatus.DRAIN_PENDING):
                    continue  # it failed or left meanwhile
                self._add_held(pending.worker)
                if pending.drain:
                    worker.status = WorkerStatus.DRAINING
                    worker.waiting_since = self._clock()
                else:
                    granted, flags = self._grant(pending.worker, worker.want, worker.held)
                    replies.append(self._read(pending.worker, granted, flags))
        replies.extend(self._finish_drain())
        return replies

    def _apply(self, group: list[PendingGradient]) -> None:
        fates, stepped = self.updater.apply(group, self.version)
        for pending, (staleness, dropped) in zip(group, fates):
            # for the worker's next reply (the last of its gradients in the group counts)
            worker = self._workers[pending.worker]
            worker.staleness, worker.dropped = staleness, dropped
        if stepped:
            self.version += 1
            self._snapshot = None

    def _finish_drain(self) -> list[Reply]:
        live = [worker for worker in self._workers.values() if worker.status in _LIVE]
        draining = [w for w in live if w.status == WorkerStatus.DRAINING]
        if not draining or len(draining) != len(live) or self._pending:
            return []
        if self.budget is not None:
            self.budget.close_epoch()
        flags = self.budget.flags() if self.budget is not None else ReplyFlag.NONE
        replies = []
        for rank, worker in self._workers.items():
            if worker.status == WorkerStatus.DRAINING:
                self._add_held(rank)
                replies.append(self._read(rank, 0, flags))
                worker.status = WorkerStatus.IDLE
        return replies

    # ------------------------------------------------------------------ replies

    def _grant(self, worker: int, want: int, held: int) -> tuple[int, ReplyFlag]:
        if self.budget is None:
            return 0, ReplyFlag.NONE
        return self.budget.grant(worker, want, held, lends=self._worker(worker).lends)

    def _weights(self) -> Tensor:
        # One read-only snapshot per version: sends may still be reading it while the next
        # update changes the weights, and DC-ASGD needs exactly the weights each worker read.
        if self._snapshot is None:
            self._snapshot = self._snapshots.take()
        return self._snapshot

    def _computed_on(self, request: Request) -> tuple[int, Tensor | None]:
        """The version (and DC-ASGD's weights) the request's gradient was computed on."""
        worker = self._worker(request.worker)
        if request.read_version == worker.read_version:
            return worker.read_version, worker.weights_read
        if request.read_version == worker.previous_version:
            return worker.previous_version, worker.previous_weights
        raise ValueError(
            f"worker rank {request.worker} sent a gradient of version {request.read_version}, "
            f"but read versions {worker.previous_version} and {worker.read_version} last"
        )

    def _read(self, rank: int, granted: int, flags: ReplyFlag) -> Reply:
        worker = self._workers[rank]
        if worker.status != WorkerStatus.DRAINING:
            worker.status = WorkerStatus.COMPUTING
        if worker.read_version != self.version:
            worker.previous_version, worker.previous_weights = (
                worker.read_version,
                worker.weights_read,
            )
        worker.read_version = self.version
        if self.policy.delay_compensation:
            worker.weights_read = self._weights()
        return self._reply(rank, granted, flags)

    def _reply(self, rank: int, granted: int, flags: ReplyFlag) -> Reply:
        worker = self._workers[rank]
        if worker.dropped:
            flags |= ReplyFlag.DROPPED
        reply = Reply(
            rank,
            ReplyKind.WEIGHTS,
            self.version,
            self._weights(),
            granted,
            flags,
            worker.staleness,
            lost=len(self.lost),
        )
        worker.staleness, worker.dropped = -1, False
        return reply

    def _abort(self, rank: int, failed: int | None = None) -> Reply:
        if failed is not None:  # ``rank`` itself was lost earlier
            why = next(why for lost, why in self.lost if lost == failed)
            kind, reason = FailureKind.LOST, f"the others went on without it ({why})"
        else:
            assert self.failure is not None
            (failed, reason), kind = self.failure, self.failure_kind
        return Reply(
            rank,
            ReplyKind.ABORT,
            self.version,
            self._weights(),
            failed_rank=failed,
            failure=kind,
            reason=reason,
        )

    def _add_held(self, rank: int) -> None:
        worker = self._workers[rank]
        held = self.statistics.held_seconds
        held[rank] = held.get(rank, 0.0) + max(0.0, self._clock() - worker.waiting_since)

    def _worker(self, rank: int) -> _Worker:
        try:
            return self._workers[rank]
        except KeyError:
            raise ValueError(f"rank {rank} is not a worker of this shard") from None

    # ------------------------------------------------------------------ state

    def state_dict(self) -> dict[str, Any]:
        """Weights, optimizer state, version and counters (between epochs: nothing pending)."""
        return {
            "weights": self.weights.clone(),
            "optimizer": copy.deepcopy(self.optimizer.state_dict()),
            "version": self.version,
            "statistics": self.statistics.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` (weights and optimizer state are optional keys)."""
        if self._pending:
            raise RuntimeError("cannot load a shard's state while gradients are pending")
        with torch.no_grad():
            if "weights" in state:
                self.weights.copy_(state["weights"])
        if "optimizer" in state:
            self.optimizer.load_state_dict(state["optimizer"])
        self.version = int(state["version"])
        if "statistics" in state:
            self.statistics.load_state_dict(state["statistics"])
        self._snapshot = None
        for worker in self._workers.values():
            worker.read_version = self.version
            worker.weights_read = None
            worker.previous_version, worker.previous_weights = -1, None
