"""The epoch as a shared budget of batches, so that fast workers take more of it.

With a fixed share per worker, an asynchronous epoch still lasts as long as the slowest
worker's share, and the fast ones idle at the epoch's end: no faster than synchronous SGD. The
first shard's server therefore holds the epoch as one pool of batches:

1. each worker that begins the epoch adds its own number of batches to the pool and is granted
   at least one;
2. with every gradient (and, rarely, a separate claim) a worker asks for enough batches to keep
   ``lookahead`` in hand, and is granted what the pool still holds;
3. once the pool is empty, a reply takes back the batches the worker was granted but has not
   started (a negative grant) and returns them to the pool, where the next worker to ask, most
   likely a fast one, gets them: a straggler does not keep everyone waiting at the epoch end
   for batches it reserved early;
4. when the pool is empty, replies say ``EPOCH_OVER``: a worker finishes the batches it holds
   and drains. The epoch processes exactly Σ batches, however they are spread.

A run limit (``max_steps`` × world size × accumulation) caps the batches of the whole run the
same way and raises ``RUN_OVER``.
"""

from __future__ import annotations

from lightning_parallel.parameter_server.protocol import ReplyFlag

__all__: list[str] = []


class EpochBudget:
    """Grants batches from the epoch's pool and the run's limit.

    Args:
        run_batches: batches the whole run may still take (``None``: unlimited).
        share: pool the workers' batches (steps 1-3). Off for synchronous training (SSP bound
            0): every worker then takes exactly its own batches, as under DDP.
    """

    def __init__(self, run_batches: int | None = None, share: bool = True) -> None:
        if run_batches is not None and run_batches < 0:
            raise ValueError(f"run_batches must be >= 0 or None, got {run_batches}")
        self.run_remaining = run_batches
        self.share = share
        self.pool = 0
        self.granted = 0
        self.epoch_open = False
        self._begun: set[int] = set()
        self._granted_to: dict[int, int] = {}
        self._own: dict[int, int] = {}

    def available(self, worker: int | None = None) -> int:
        """Batches that can still be granted in this epoch (to ``worker``, unless shared)."""
        left = self.pool
        if not self.share and worker is not None:
            left = min(left, self._own.get(worker, 0) - self._granted_to.get(worker, 0))
        if self.run_remaining is not None:
            left = min(left, self.run_remaining)
        return max(0, left)

    def begin(
        self, worker: int, epoch_batches: int, want: int, restart: bool = False
    ) -> tuple[int, ReplyFlag]:
        """``worker`` starts the epoch with ``epoch_batches`` of its own: grant at least one.

        ``restart``: the worker dropped its iterator before training a batch of it (Lightning
        re-creates it when resuming); the batches granted to it this epoch go back to the pool.
        """
        if not self.epoch_open:
            self.epoch_open, self.pool, self.granted = True, 0, 0
            self._begun.clear()
            self._granted_to.clear()
            self._own.clear()
        if worker not in self._begun:
            self._begun.add(worker)
            self.pool += max(0, epoch_batches)
            self._own[worker] = max(0, epoch_batches)
        elif restart:
            self._refund(worker, self._granted_to.get(worker, 0))
        return self._grant(worker, max(1, want), at_least=1)

    def grant(self, worker: int, want: int, held: int = 0) -> tuple[int, ReplyFlag]:
        """Grant ``worker`` up to ``want`` more batches; it holds ``held`` unused ones.

        With the pool empty, the ``held`` batches are taken back instead: the grant is
        ``-held`` and they return to the pool for whoever asks next.
        """
        if self.share and self.epoch_open and held > 0 and self.available() == 0:
            self._refund(worker, held)
            return -held, self.flags(worker)
        return self._grant(worker, max(0, want), at_least=0)

    def _refund(self, worker: int, count: int) -> None:
        self.pool += count
        self.granted -= count
        self._granted_to[worker] = self._granted_to.get(worker, 0) - count
        if self.run_remaining is not None:
            self.run_remaining += count

    def flags(self, worker: int | None = None) -> ReplyFlag:
        """The budget facts to tell ``worker`` now."""
        flags = ReplyFlag.NONE
        if self.available(worker) == 0:
            flags |= ReplyFlag.EPOCH_OVER
        if self.run_remaining is not None and self.run_remaining <= 0:
            flags |= ReplyFlag.RUN_OVER
        return flags

    def close_epoch(self) -> None:
        """Every worker drained: the next ``begin`` opens a new epoch."""
        self.epoch_open = False

    def _grant(self, worker: int, want: int, at_least: int) -> tuple[int, ReplyFlag]:
        # at_least lets every worker train at least one batch per epoch, so that all ranks
        # reach the epoch end (and Lightning's collectives there) together.
        count = max(at_least, min(want, self.available(worker)))
        self.pool -= count
        self.granted += count
        self._granted_to[worker] = self._granted_to.get(worker, 0) + count
        if self.run_remaining is not None:
            self.run_remaining -= count
        return count, self.flags(worker)
