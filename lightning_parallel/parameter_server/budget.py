"""The epoch as a shared budget of batches, so that fast workers take more of it.

With a fixed share per worker, an asynchronous epoch still lasts as long as the slowest
worker's share, and the fast ones idle at the epoch's end: no faster than synchronous SGD. The
first shard's server therefore holds the epoch as one pool of batches:

1. each worker that begins the epoch adds its own number of batches to the pool and is granted
   at least one;
2. with every gradient (and, rarely, a separate claim) a worker asks for enough batches to keep
   ``lookahead`` in hand, and is granted what the pool still holds;
3. a worker starts a granted batch only when it trains it (not when the data loader prefetches
   it), so right after a reply a worker starts at most one of its granted batches before it
   speaks again: the rest are *spare*, known exactly to the server;
4. once the pool is empty, a worker asking for more takes the spare batches of workers slower
   than itself (measured by the time between their requests); the slower worker learns it at
   its next reply (a negative grant) and skips the batch it would have started: a straggler
   does not keep everyone waiting at the epoch end for batches it reserved early, only for the
   one it is computing;
5. at the very end, a worker slower than the rest whose remaining batches the faster workers
   would finish (with the pool) before it finishes its next one returns all of them, including
   the one it prefetched, and stops for this epoch;
6. when neither the pool nor a slower worker's spare holds anything, replies say
   ``EPOCH_OVER``: a worker finishes the batches it holds and drains. The epoch processes
   exactly Σ batches, however they are spread.

A run limit (``max_steps`` × world size × accumulation) caps the batches of the whole run the
same way and raises ``RUN_OVER``.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from lightning_parallel.parameter_server.protocol import ReplyFlag

__all__: list[str] = []


class EpochBudget:
    """Grants batches from the epoch's pool and the run's limit.

    Args:
        run_batches: batches the whole run may still take (``None``: unlimited).
        share: pool the workers' batches (steps 1-3). Off for synchronous training (SSP bound
            0): every worker then takes exactly its own batches, as under DDP.
    """

    def __init__(
        self,
        run_batches: int | None = None,
        share: bool = True,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if run_batches is not None and run_batches < 0:
            raise ValueError(f"run_batches must be >= 0 or None, got {run_batches}")
        self.run_remaining = run_batches
        self.share = share
        self.pool = 0
        self.granted = 0
        self.epoch_open = False
        self._clock = clock
        self._begun: set[int] = set()
        self._granted_to: dict[int, int] = {}
        self._own: dict[int, int] = {}
        self._spare: dict[int, int] = {}  # granted batches a worker cannot start before it asks
        self._stolen: dict[int, int] = {}  # spare batches given away since its last reply
        self._retired: set[int] = set()  # gave its batches back at the epoch's tail
        self._told_over: set[int] = set()  # was told EPOCH_OVER this epoch
        self._last_seen: dict[int, float] = {}
        self._interval: dict[int, float] = {}  # seconds between a worker's requests (EMA)

    def available(self, worker: int | None = None) -> int:
        """Batches that can still be granted in this epoch (to ``worker``, unless shared)."""
        left = self.pool
        if not self.share and worker is not None:
            left = min(left, self._own.get(worker, 0) - self._granted_to.get(worker, 0))
        if self.run_remaining is not None:
            left = min(left, self.run_remaining)
        return max(0, left)

    def begin(
        self,
        worker: int,
        epoch_batches: int,
        want: int,
        restart: bool = False,
        lends: bool = True,
    ) -> tuple[int, ReplyFlag]:
        """``worker`` starts the epoch with ``epoch_batches`` of its own: grant at least one.

        ``restart``: the worker dropped its iterator before training a batch of it (Lightning
        re-creates it when resuming); the batches granted to it this epoch go back to the pool.
        ``lends``: see :meth:`grant`.
        """
        if not self.epoch_open:
            self.epoch_open, self.pool, self.granted = True, 0, 0
            self._begun.clear()
            self._granted_to.clear()
            self._own.clear()
            self._spare.clear()
            self._stolen.clear()
            self._retired.clear()
            self._told_over.clear()
        if worker not in self._begun:
            self._begun.add(worker)
            self.pool += max(0, epoch_batches)
            self._own[worker] = max(0, epoch_batches)
        elif restart:
            self._stolen.pop(worker, None)
            self._spare.pop(worker, None)
            self._refund(worker, self._granted_to.get(worker, 0))
        self._tick(worker)
        count = self._take(worker, max(1, want), at_least=1)
        self._set_spare(worker, count, lends)
        return count, self.flags(worker)

    def grant(
        self, worker: int, want: int, held: int = 0, lends: bool = True
    ) -> tuple[int, ReplyFlag]:
        """Grant ``worker`` up to ``want`` more batches; it holds ``held`` not yet started.

        The grant is net of the spare batches faster workers took from this one since its
        last reply (so it may be negative). ``lends``: the worker starts at most one batch
        before it asks again, so all but one of what it then holds may be lent to faster
        workers (``False`` for a worker that may start several between requests: overlapped
        steps, gradient accumulation; nothing is lent).
        """
        self._tick(worker)
        stolen = self._stolen.pop(worker, 0)
        held -= stolen
        if lends and held > 0 and self._better_left_to_others(worker, held):
            # the epoch's tail: the faster workers finish the pool and everything this worker
            # holds before it would finish one more batch: it returns all and stops
            self._refund(worker, held)
            self._retired.add(worker)
            self._spare[worker] = 0
            return -(held + stolen), self.flags(worker)
        count = self._take(worker, max(0, want), at_least=0)
        self._set_spare(worker, held + count, lends)
        return count - stolen, self.flags(worker)

    def _set_spare(self, worker: int, holds: int, lends: bool) -> None:
        # the worker starts one of the ``holds`` batches before it asks again: the rest may go
        # to faster workers
        self._spare[worker] = max(0, holds - 1) if lends and self.share else 0

    def _better_left_to_others(self, worker: int, held: int) -> bool:
        """Would the faster workers still in the epoch finish the pool and ``held`` batches
        sooner than ``worker`` finishes its next one?"""
        mine = self._interval.get(worker)
        if mine is None or not self.share or not self.epoch_open:
            return False
        faster = [
            self._interval[other]
            for other in self._begun
            if other != worker
            and other not in self._told_over
            and other not in self._retired
            and self._interval.get(other, mine) < mine
        ]
        if not faster:
            return False
        return (self.pool + held) / sum(1.0 / interval for interval in faster) < mine

    def _tick(self, worker: int) -> None:
        now = self._clock()
        last = self._last_seen.get(worker)
        if last is not None:
            interval = now - last
            previous = self._interval.get(worker)
            self._interval[worker] = (
                interval if previous is None else 0.7 * previous + 0.3 * interval
            )
        self._last_seen[worker] = now

    def _slower(self, worker: int) -> list[int]:
        """Workers with spare batches, slower than ``worker``, slowest first."""
        own = self._interval.get(worker)
        if own is None or not self.share or not self.epoch_open:
            return []
        slower = [
            other
            for other, spare in self._spare.items()
            if other != worker and spare > 0 and self._interval.get(other, 0.0) > own
        ]
        return sorted(slower, key=lambda other: -self._interval[other])

    def _refund(self, worker: int, count: int) -> None:
        self.pool += count
        self.granted -= count
        self._granted_to[worker] = self._granted_to.get(worker, 0) - count
        if self.run_remaining is not None:
            self.run_remaining += count

    def flags(self, worker: int | None = None) -> ReplyFlag:
        """The budget facts to tell ``worker`` now."""
        flags = ReplyFlag.NONE
        lendable = (
            sum(self._spare[other] for other in self._slower(worker)) if worker is not None else 0
        )
        if (self.available(worker) == 0 and lendable == 0) or worker in self._retired:
            flags |= ReplyFlag.EPOCH_OVER
            if worker is not None:
                self._told_over.add(worker)
        if self.run_remaining is not None and self.run_remaining <= 0:
            flags |= ReplyFlag.RUN_OVER
        return flags

    def forget(self, worker: int) -> None:
        """``worker`` was lost: its spare batches go back to the pool for the others, and it
        no longer counts as a worker of the epoch (the batch it was computing is lost)."""
        spare = self._spare.pop(worker, 0)
        if spare:
            self._refund(worker, spare)
        self._stolen.pop(worker, None)
        self._retired.add(worker)
        self._interval.pop(worker, None)

    def close_epoch(self) -> None:
        """Every worker drained: the next ``begin`` opens a new epoch."""
        self.epoch_open = False

    def _take(self, worker: int, want: int, at_least: int) -> int:
        # at_least lets every worker train at least one batch per epoch, so that all ranks
        # reach the epoch end (and Lightning's collectives there) together.
        if worker in self._retired:
            return 0
        count = max(at_least, min(want, self.available(worker)))
        self.pool -= count
        self.granted += count
        self._granted_to[worker] = self._granted_to.get(worker, 0) + count
        if self.run_remaining is not None:
            self.run_remaining -= count
        for other in self._slower(worker):  # the pool is short: take slower workers' spare
            if count >= want:
                break
            moved = min(self._spare[other], want - count)
            self._spare[other] -= moved
            self._stolen[other] = self._stolen.get(other, 0) + moved
            self._granted_to[other] -= moved
            self._granted_to[worker] += moved
            count += moved
        return count
