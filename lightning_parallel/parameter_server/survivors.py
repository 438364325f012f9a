"""The workers still in a parameter-server run after the server went on without some.

With ``worker_loss="continue"``, shard 0's server goes on without a worker that died, froze or
was cut off, and publishes ``(rank, reason)`` in the store before any reply carries the new
count (:meth:`ParameterServerRuntime.lost_workers`: the same list on every rank).
:class:`LostWorkers` is what a rank makes of that list, in plain torch:

1. **adoption** (:meth:`LostWorkers.adopt`): the ranks left and a process group of theirs (every
   survivor creates it, in the same order: a collective call), one warning per newly lost worker
   and the gauge ``ps_workers_lost``;
2. **a collective over the survivors** (:meth:`LostWorkers.call`): ``run(group)`` over that group
   (``None``, the default group, until a worker is lost). A worker lost between two training
   epochs (in validation, a checkpoint, logging) is noticed there: the collective fails on every
   survivor, since each needs every member's data; whether to go on is the caller's decision;
3. **the server's verdict** (:meth:`LostWorkers.await_verdict`): a survivor whose collective
   failed waits until the server declares the loss (at once for a dead process, the heartbeat
   timeout for a frozen one) and adopts it, so that the collective runs again over the
   survivors. It gives up, and the error stands, if the error is not a communication error, a
   shard on this rank failed, the store's host (rank 0) no longer answers this rank's heartbeat,
   or no verdict comes within the heartbeat timeout and 5 s more.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any, TypeVar

from lightning_parallel.comm.groups import new_group
from lightning_parallel.comm.ledger import process_ledger
from lightning_parallel.comm.liveness import Liveness, is_communication_error
from lightning_parallel.parameter_server.runtime import ParameterServerRuntime

__all__: list[str] = []

log = logging.getLogger(__name__)

_T = TypeVar("_T")


class LostWorkers:
    """The ranks still in the run and collectives over them (see the module docstring)."""

    def __init__(self) -> None:
        #: the ranks still in the run, once a worker was lost (``None`` before)
        self.survivors: list[int] | None = None
        #: the survivors' process group (``None``, the default group, before a loss)
        self.group: Any = None

    def members(self, world_size: int) -> list[int]:
        """The ranks of ``range(world_size)`` still in the run."""
        return self.survivors or list(range(world_size))

    def adopt(self, runtime: ParameterServerRuntime, count: int, world_size: int) -> None:
        """The server went on without ``count`` workers in all: move to a group of the
        survivors and say so (nothing if this rank already knew of ``count``)."""
        known = world_size - len(self.members(world_size))
        if count <= known:
            return
        lost = runtime.lost_workers(count)
        gone = {rank for rank, _ in lost}
        self.survivors = [rank for rank in range(world_size) if rank not in gone]
        self.group = new_group(self.survivors, members_only=True)
        for rank, reason in lost[known:]:
            log.warning(
                "parameter server: worker rank %d was lost (%s); training continues on the "
                "%d remaining worker%s (ranks %s)",
                rank,
                reason,
                len(self.survivors),
                "" if len(self.survivors) == 1 else "s",
                self.survivors,
            )
        process_ledger().set_gauge("ps_workers_lost", float(len(gone)))

    def call(self, run: Callable[[Any], _T], recover: Callable[[Exception], bool]) -> _T:
        """``run(group)`` over the survivors; again, over the survivors then, each time
        ``recover(error)`` says the error was a loss it adopted (else the error stands)."""
        while True:
            try:
                return run(self.group)
            except Exception as error:
                if not recover(error):
                    raise

    def await_verdict(
        self,
        runtime: ParameterServerRuntime,
        error: Exception,
        world_size: int,
        timeout: float,
        liveness: Liveness | None,
        waiting: Callable[[str], None],
    ) -> bool:
        """Whether the server declared a loss that explains ``error`` (then adopted).

        Args:
            timeout: the heartbeat timeout: the longest the server takes to declare a loss.
            liveness: this rank's heartbeat, which tells whether the store's host answers.
            waiting: records what this rank does while it waits (shown if a peer fails).
        """
        if runtime.failure is not None or not is_communication_error(error):
            return False
        if liveness is not None and time.monotonic() - liveness.last_answer > 3 * liveness.interval:
            return False  # the store's host (rank 0) is gone: no verdict will come
        known = world_size - len(self.members(world_size))
        deadline = time.monotonic() + timeout + 5.0
        waiting("waiting for the server to declare a lost worker")
        try:
            while (count := runtime.published_lost()) <= known:
                if time.monotonic() > deadline:
                    return False
                time.sleep(0.1)
        except Exception:  # the store does not answer: its host failed too
            return False
        self.adopt(runtime, count, world_size)
        return True
