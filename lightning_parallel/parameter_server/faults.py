"""Detect dead or frozen workers, so that a failure stops the run instead of hanging it.

Two signals, both naming the rank:

1. **Connection loss.** A shard host listens to each remote worker on its own thread with a
   directed receive; when the worker's process dies, the kernel closes its sockets and gloo
   raises in that thread at once ("Connection closed by peer").
2. **Silence.** A worker that is alive but frozen (stopped, swapped out, cut off) keeps its
   sockets open. Every rank runs a :class:`Heartbeat` that increments a counter in the
   process group's key-value store every ``timeout / 4`` seconds; a shard host's watchdog
   (:class:`~lightning_parallel.comm.liveness.Watchdog`) declares a worker failed when its
   counter has not moved for ``timeout``.

The shard then answers every waiting and every later request with ``ABORT``; each worker
raises :class:`WorkerFailure` naming the failed rank.
"""

from __future__ import annotations

import logging
import threading

import torch.distributed as dist

__all__: list[str] = []

log = logging.getLogger(__name__)


class WorkerFailure(RuntimeError):
    """A worker (or shard host) of the parameter server failed; the run cannot go on.

    Attributes:
        rank: the global rank that failed (``None`` when unknown).
    """

    def __init__(self, message: str, rank: int | None = None) -> None:
        super().__init__(message)
        self.rank = rank


def heartbeat_store(session: str) -> dist.Store | None:
    """A key-value store shared by all ranks (the default process group's), or ``None``."""
    try:
        base = dist.distributed_c10d._get_default_store()
    except (AttributeError, RuntimeError, ValueError):
        return None
    return dist.PrefixStore(f"lightning_parallel/parameter_server/{session}/", base)


def _key(rank: int) -> str:
    return f"beat/{rank}"


class Heartbeat:
    """Increment this rank's counter in ``store`` every ``interval`` seconds (a thread)."""

    def __init__(self, store: dist.Store, rank: int, interval: float) -> None:
        self._store = store
        self._rank = rank
        self._interval = interval
        self._stop = threading.Event()
        store.add(_key(rank), 1)
        self._thread = threading.Thread(target=self._run, name=f"ps-heartbeat-{rank}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            try:
                self._store.add(_key(self._rank), 1)
            except Exception as error:  # the store's host is gone: the run is failing anyway
                log.warning(
                    "rank %d: parameter-server heartbeat stopped, the store does not answer "
                    "(rank 0's host failed or this host lost its link): %s",
                    self._rank,
                    error,
                )
                return

    def stop(self, wait: bool = True) -> None:
        """Stop the thread; ``wait=False`` (after a failure) leaves it to die with the process
        (it may be blocked on a store whose host is gone)."""
        self._stop.set()
        if wait and self._thread is not threading.current_thread():
            self._thread.join(timeout=5.0)
