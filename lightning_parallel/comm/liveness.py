"""Which peer failed, and what each rank was doing: the diagnosis behind a failed collective.

When a peer dies, gloo says "Connection closed by peer [address]:port" or, for a frozen or
cut-off peer, only that an operation timed out; neither names the rank. This module adds the
missing facts, with the rendezvous store every run already has (the default group's):

1. **Activity.** :func:`set_activity` records what this rank is doing now (``"step 12:
   backward"``); strategies call it before each phase. It is a tuple assignment: free.
2. **Heartbeat.** :class:`Liveness` runs a thread that, every ``interval`` seconds, increments
   ``beat/<rank>`` in the store and writes this rank's activity to ``doing/<rank>``.
3. **Diagnosis.** After a failure, :meth:`Liveness.diagnose` reads every rank's counter twice,
   ``3 * interval`` apart (in a helper thread with a deadline of 3 s more: a frozen or cut-off
   store host does not answer at all). A rank whose counter did not move stopped: killed,
   frozen or cut off. If the store itself does not answer, the store's host (rank 0's,
   ``MASTER_ADDR``) is the one that failed, or this host is cut off from it. The result names
   the ranks, their last activity and this rank's activity, in one line.

The store's traffic is one ``add`` and one ``set`` per rank per ``interval`` (1 s by default);
the diagnosis reads ``world_size`` keys twice, only after a failure.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch.distributed as dist

__all__: list[str] = []

log = logging.getLogger(__name__)

_ACTIVITY: tuple[str, float] = ("starting", time.monotonic())
# words in the text of the errors a lost peer produces (gloo, NCCL, the store, ours)
_COMMUNICATION_WORDS = (
    "gloo",
    "nccl",
    "connection",
    "timed out",
    "timeout",
    "peer",
    "socket",
    "broken pipe",
    "store",
    "worker rank",
)


def set_activity(label: str) -> None:
    """Record what this rank does from now on (shown in a failure's diagnosis)."""
    global _ACTIVITY
    _ACTIVITY = (label, time.monotonic())


def activity() -> str:
    """This rank's current activity and for how long: ``"step 12: backward (for 0.3 s)"``."""
    label, since = _ACTIVITY
    return f"{label} (for {time.monotonic() - since:.1f} s)"


def is_communication_error(error: BaseException) -> bool:
    """Whether ``error`` looks like a lost peer or a failed collective (worth a diagnosis)."""
    if isinstance(error, (dist.DistError, TimeoutError, ConnectionError)):
        return True
    text = str(error).lower()
    return isinstance(error, RuntimeError) and any(word in text for word in _COMMUNICATION_WORDS)


def default_store() -> dist.Store | None:
    """The default process group's rendezvous store, or ``None`` (no group, or torch hides it)."""
    try:
        return dist.distributed_c10d._get_default_store()
    except (AttributeError, RuntimeError, ValueError):
        return None


@dataclass
class Diagnosis:
    """What :meth:`Liveness.diagnose` found.

    Attributes:
        silent: ranks whose heartbeat stopped, with their last published activity.
        store_unreachable: the store did not answer (its host failed, or this host is cut off).
        text: one line for a person.
    """

    silent: dict[int, str]
    store_unreachable: bool
    text: str


class Liveness:
    """This rank's heartbeat in ``store``, and the diagnosis of a failure (see the module doc).

    Args:
        store: a store every rank reaches (:func:`default_store`); keys are prefixed here.
        rank: this rank; ``world_size`` the number of ranks.
        interval: seconds between heartbeats.
        store_rank: the rank whose host serves the store (``MASTER_ADDR``; 0 under Lightning).
    """

    def __init__(
        self,
        store: dist.Store,
        rank: int,
        world_size: int,
        interval: float = 1.0,
        store_rank: int = 0,
    ) -> None:
        if interval <= 0:
            raise ValueError(f"interval must be > 0 seconds, got {interval}")
        self.store = dist.PrefixStore("lightning_parallel/liveness/", store)
        self.rank = rank
        self.world_size = world_size
        self.interval = interval
        self.store_rank = store_rank
        self.last_answer = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"lp-heartbeat-{rank}", daemon=True)
        self._thread.start()

    def _beat(self) -> None:
        self.store.add(f"beat/{self.rank}", 1)
        self.store.set(f"doing/{self.rank}", _ACTIVITY[0])
        self.last_answer = time.monotonic()

    def _run(self) -> None:
        while True:
            try:
                self._beat()
            except Exception as error:  # the store's host is gone: say so once, keep trying
                log.debug("rank %d: heartbeat failed: %s", self.rank, error)
            if self._stop.wait(self.interval):
                return

    def stop(self, wait: bool = True) -> None:
        """Stop the heartbeat; ``wait=False`` (after a failure) does not wait for its thread,
        which may be blocked on a frozen store and dies with the process."""
        self._stop.set()
        if wait and self._thread is not threading.current_thread():
            self._thread.join(timeout=self.interval + 1.0)

    def _counts(self) -> dict[int, int]:
        return {rank: int(self.store.add(f"beat/{rank}", 0)) for rank in range(self.world_size)}

    def _sample(self, wait: float, result: dict[str, object]) -> None:
        try:
            first = self._counts()
            time.sleep(wait)
            second = self._counts()
            silent = [r for r in range(self.world_size) if r != self.rank and first[r] == second[r]]
            result["silent"] = {r: self._doing(r) for r in silent}
        except Exception as error:
            result["error"] = error

    def _doing(self, rank: int) -> str:
        try:
            return self.store.get(f"doing/{rank}").decode("utf-8", errors="replace")
        except Exception:
            return "unknown"

    def diagnose(self, wait: float | None = None) -> Diagnosis:
        """Find the ranks that stopped (see the module doc); returns within ``wait + 3`` s."""
        wait = 3.0 * self.interval if wait is None else wait
        result: dict[str, object] = {}
        if time.monotonic() - self.last_answer < wait:
            sampler = threading.Thread(target=self._sample, args=(wait, result), daemon=True)
            sampler.start()
            sampler.join(timeout=wait + 3.0)  # a healthy store answers in milliseconds
        # else: the store has not answered this rank's own heartbeat for longer than the
        # sampling would wait; asking it again would only wait more
        doing = activity()
        if "silent" in result:
            silent: dict[int, str] = result["silent"]  # type: ignore[assignment]
            if not silent:
                text = (
                    f"rank {self.rank} failed while it was in '{doing}'; every other rank's "
                    "heartbeat is still alive, so no peer was lost"
                )
                return Diagnosis({}, False, text)
            names = ", ".join(f"rank {r} (last doing: '{what}')" for r, what in silent.items())
            text = (
                f"{names} stopped responding: no heartbeat for {wait:.0f} s, so killed, frozen "
                f"or cut off; rank {self.rank} was in '{doing}'"
            )
            return Diagnosis(silent, False, text)
        quiet = time.monotonic() - self.last_answer
        text = (
            f"the rendezvous store on rank {self.store_rank}'s host (MASTER_ADDR) has not answered "
            f"for {quiet:.0f} s: rank {self.store_rank} was killed, frozen or cut off, or this "
            f"host (rank {self.rank}) lost its link; rank {self.rank} was in '{doing}'"
        )
        if "error" in result:
            text += f" (the store said: {str(result['error']).splitlines()[0][:160]})"
        return Diagnosis({}, True, text)


class Watchdog:
    """Call ``on_silent(rank)`` for a watched rank whose heartbeat stalls for ``timeout`` s.

    Args:
        store: the store the heartbeats write to.
        watched: returns the ranks to watch now (workers that left are not watched).
        timeout: seconds of silence that count as a failure.
        on_silent: called once per silent rank, from the watchdog's thread.
    """

    def __init__(
        self,
        store: dist.Store,
        watched: Callable[[], Iterable[int]],
        timeout: float,
        on_silent: Callable[[int, float], None],
    ) -> None:
        self._store = store
        self._watched = watched
        self._timeout = timeout
        self._on_silent = on_silent
        self._stop = threading.Event()
        self._seen: dict[int, tuple[int, float]] = {}
        self._reported: set[int] = set()
        self._thread = threading.Thread(target=self._run, name="lp-watchdog", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(min(1.0, self._timeout / 4)):
            now = time.monotonic()
            for rank in self._watched():
                if rank in self._reported:
                    continue
                try:
                    count = int(self._store.add(f"beat/{rank}", 0))
                except Exception as error:
                    log.warning(
                        "watchdog stopped, the store does not answer (rank 0's "
                        "host failed or this host lost its link); collectives still end after "
                        "the run's timeout: %s",
                        error,
                    )
                    return
                last = self._seen.get(rank)
                if last is None or count != last[0]:
                    self._seen[rank] = (count, now)
                elif now - last[1] > self._timeout:
                    self._reported.add(rank)
                    self._on_silent(rank, now - last[1])

    def stop(self, wait: bool = True) -> None:
        """Stop the thread; ``wait=False`` (after a failure) leaves it to die with the process
        (it may be blocked on a store whose host is gone)."""
        self._stop.set()
        if wait and self._thread is not threading.current_thread():
            self._thread.join(timeout=5.0)
