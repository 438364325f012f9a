"""Serve one shard from a rank that also trains: threads around a :class:`ShardServer`.

Lightning runs its collectives in lockstep on every rank, so the server cannot be a rank with
its own loop; it runs as threads of the rank that hosts it (by default rank 0, which is also a
worker), on a process group of its own:

1. one *receiver* thread per remote worker: a directed, blocking receive of the worker's
   request header (and gradient) from the parameter-server group; a receive that fails means
   the worker died, and the shard is failed naming it;
2. requests go through :meth:`ShardServer.handle` under one lock; the replies due are sent with
   ``isend`` (header, then the weights snapshot), the local worker's go to a mailbox;
3. one *reaper* thread waits for the sends to finish, in order, so snapshots stay alive until
   the wire has them;
4. :meth:`fail` (connection loss, watchdog) answers every waiting worker with ``ABORT``.

Why directed receives rather than one any-source receive: gloo does not wake an any-source
receive when a peer dies, so a dead worker would go unnoticed.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence

import torch
from torch.distributed import ProcessGroup
from torch.distributed import distributed_c10d as c10d

from lightning_parallel.parameter_server.protocol import (
    HEADER_SIZE,
    REPLY_HEADER_TAG,
    REPLY_WEIGHTS_TAG,
    REQUEST_GRADIENT_TAG,
    REQUEST_HEADER_TAG,
    FailureKind,
    Reply,
    Request,
    RequestFlag,
    RequestKind,
)
from lightning_parallel.parameter_server.server import ShardServer

__all__: list[str] = []

log = logging.getLogger(__name__)


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return text[0] if text else type(error).__name__


class ShardHost:
    """Run ``server`` for ``workers`` from global rank ``rank`` over ``group``.

    Args:
        server: the shard's state machine.
        shard: the shard's index (for names and messages).
        rank: this process's global rank (its own worker talks to the shard in-process).
        workers: global ranks of all workers.
        group: the parameter-server process group (gloo, separate from Lightning's).
        wire_dtype: dtype gradients arrive in and weights leave in (``None``: the shard's).
        on_lost: called (with the lock held, before any reply goes out) with the rank and the
            reason when the server loses a worker; the runtime publishes it there.
    """

    def __init__(
        self,
        server: ShardServer,
        shard: int,
        rank: int,
        workers: Sequence[int],
        group: ProcessGroup,
        wire_dtype: torch.dtype | None = None,
        on_lost: Callable[[int, str], None] | None = None,
    ) -> None:
        self.server = server
        self.on_lost = on_lost
        self.wire_dtype = wire_dtype if wire_dtype != server.weights.dtype else None
        self.shard = shard
        self.rank = rank
        self.group = group
        self._remote = [worker for worker in workers if worker != rank]
        self._lock = threading.RLock()
        self._mailbox: queue.Queue[Reply] = queue.Queue()
        self._inflight: queue.Queue[tuple[int, list[c10d.Work], list[torch.Tensor]] | None] = (
            queue.Queue()
        )
        self._closing = False
        self._bytes_sent = 0.0
        self._buffers = {worker: server.gradient_buffer(worker) for worker in self._remote}
        self._incoming = {  # where a gradient in the wire's dtype lands first
            worker: torch.empty(server.weights.numel(), dtype=self.wire_dtype)
            for worker in self._remote
            if self.wire_dtype is not None
        }
        self._receivers = [
            threading.Thread(
                target=self._receive,
                args=(worker,),
                name=f"ps-shard{shard}-from{worker}",
                daemon=True,
            )
            for worker in self._remote
        ]
        self._reaper = threading.Thread(
            target=self._reap, name=f"ps-shard{shard}-send", daemon=True
        )

    def start(self) -> None:
        """Start listening to the remote workers."""
        for thread in self._receivers:
            thread.start()
        self._reaper.start()

    # ------------------------------------------------------------------ local worker

    def submit(self, request: Request) -> None:
        """Hand a request to the shard (from the local worker or a receiver thread)."""
        with self._lock:
            try:
                replies = self.server.handle(request)
            except Exception as error:
                # A protocol error is a bug, not a network fault: fail loudly, naming it.
                replies = self.server.fail(
                    request.worker, f"bad request: {_first_line(error)}", FailureKind.PROTOCOL
                )
                self._dispatch(replies)
                raise
            self._dispatch(replies)

    def take_local(self, timeout: float) -> Reply | None:
        """The next reply for the local worker, or ``None`` after ``timeout`` seconds."""
        try:
            return self._mailbox.get(timeout=timeout)
        except queue.Empty:
            return None

    def fail(
        self, worker: int, reason: str, kind: FailureKind = FailureKind.CONNECTION_LOST
    ) -> None:
        """Declare ``worker`` failed: lost (the others go on) or, if the run cannot go on
        without it, every waiting worker gets ``ABORT`` (:meth:`ShardServer.fail`)."""
        with self._lock:
            lost = len(self.server.lost)
            replies = self.server.fail(worker, reason, kind)
            if len(self.server.lost) > lost:
                if self.on_lost is not None:
                    self.on_lost(worker, reason)
                log.warning(
                    "parameter-server shard %d: worker rank %d lost (%s); training continues "
                    "on the %d remaining worker(s)",
                    self.shard,
                    worker,
                    reason,
                    len(self.server.live_workers),
                )
            elif self.server.failure is not None and self.server.failure[0] == worker:
                log.error(
                    "parameter-server shard %d: worker rank %d failed: %s",
                    self.shard,
                    worker,
                    reason,
                )
            self._dispatch(replies)

    @property
    def failure(self) -> tuple[int, str] | None:
        return self.server.failure

    def take_bytes(self) -> float:
        """Bytes the shard sent since the last call (replies to remote workers)."""
        with self._lock:
            sent, self._bytes_sent = self._bytes_sent, 0.0
        return sent

    # ------------------------------------------------------------------ threads

    def _receive(self, worker: int) -> None:
        header = torch.zeros(HEADER_SIZE, dtype=torch.int64)
        buffer = self._buffers[worker]
        while True:
            try:
                c10d.recv(header, src=worker, group=self.group, tag=REQUEST_HEADER_TAG)
                request = Request.from_header(header)
                if RequestFlag.HAS_GRADIENT in request.flags:
                    incoming = self._incoming.get(worker, buffer)
                    c10d.recv(incoming, src=worker, group=self.group, tag=REQUEST_GRADIENT_TAG)
                    request.gradient = buffer if incoming is buffer else buffer.copy_(incoming)
            except Exception as error:
                if not self._closing:
                    self.fail(
                        worker,
                        f"lost the connection to worker rank {worker} ({_first_line(error)})",
                    )
                return
            try:
                self.submit(request)
            except Exception:
                log.exception(
                    "parameter-server shard %d: bad request from rank %d", self.shard, worker
                )
                return
            if request.kind == RequestKind.LEAVE:
                return

    def _dispatch(self, replies: list[Reply]) -> None:
        # Called with the lock held: the two sends of one reply leave in order, and replies to
        # one worker keep their order.
        for reply in replies:
            if reply.worker == self.rank:
                self._mailbox.put(reply)
                continue
            header = reply.header()
            weights = (
                reply.weights if self.wire_dtype is None else reply.weights.to(self.wire_dtype)
            )
            try:
                works = [
                    c10d.isend(header, dst=reply.worker, group=self.group, tag=REPLY_HEADER_TAG),
                    c10d.isend(weights, dst=reply.worker, group=self.group, tag=REPLY_WEIGHTS_TAG),
                ]
            except Exception as error:
                self.fail(
                    reply.worker,
                    f"cannot send to worker rank {reply.worker} ({_first_line(error)})",
                )
                continue
            self._bytes_sent += header.numel() * 8 + weights.numel() * weights.element_size()
            self._inflight.put(
                (reply.worker, [w for w in works if w is not None], [header, weights])
            )

    def _reap(self) -> None:
        while True:
            item = self._inflight.get()
            if item is None:
                return
            worker, works, _keep_alive = item
            try:
                for work in works:
                    work.wait()
            except Exception as error:
                if not self._closing:
                    self.fail(
                        worker,
                        f"lost the connection to worker rank {worker} ({_first_line(error)})",
                    )

    # ------------------------------------------------------------------ shutdown

    def close(self, timeout: float) -> list[int]:
        """Wait up to ``timeout`` s for every remote worker to leave; stop the threads.

        Returns:
            The remote ranks that had not left (their receiver threads are abandoned).
        """
        deadline = time.monotonic() + (timeout if self.failure is None else 0.0)
        still = []
        lost = {rank for rank, _ in self.server.lost}
        for worker, thread in zip(self._remote, self._receivers):
            if worker in lost:
                continue  # its receiver may wait on a frozen peer: abandoned (a daemon)
            thread.join(timeout=max(0.0, deadline - time.monotonic()))
            if thread.is_alive():
                still.append(worker)
        self._closing = True
        self._inflight.put(None)
        self._reaper.join(timeout=max(0.0, deadline - time.monotonic()))
        return still
