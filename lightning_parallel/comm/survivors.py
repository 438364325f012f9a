"""Collectives that outlive a lost rank: the survivors agree on every result, then go on.

A rank that dies, freezes or is cut off in the middle of a collective leaves the others in one
of two states: some may have finished the collective (the lost rank sent them all they needed
before it stopped) while others wait for it, or fail. :class:`Survivors` makes every rank take
the same decision for every collective and moves the run to the ranks that are left:

1. **Verdicts.** Every rank's heartbeat counts in the rendezvous store
   (:class:`~lightning_parallel.comm.liveness.Liveness`). Rank 0 runs a
   :class:`~lightning_parallel.comm.liveness.Watchdog`: a member whose counter has not moved
   for ``timeout`` seconds is lost, and rank 0 publishes a new *view* (``view/<k>``: the
   members left, the rank lost and why). Rank 0 itself (the store's host) cannot be lost: the
   store goes with it, and every rank then fails with an error naming it.
2. **Lanes.** A collective is a function ``fn(group, members)`` run on a *lane*: a daemon
   thread of its own per kind of collective (the averaging rounds, Lightning's collectives),
   each with its own process group per view, so that the collectives of one lane keep their
   order on every rank. The caller's thread only waits: it polls the collective and the view
   count, so a frozen peer never blocks it longer than the verdict takes.
3. **Votes.** Once its attempt has ended (done, failed, or superseded by a newer view) each
   rank writes its outcome under the collective's key for that view, ``op/<lane>/<seq>/<view>/
   <rank>``, with ``compare_set`` (the first writer wins). A member that a later view declares
   lost and that wrote nothing is written ``lost`` by whoever looks first, so a frozen rank that
   wakes up later cannot change the outcome. Every rank reads the same outcomes: the result is
   used only if every member of the view wrote ``done``; otherwise every survivor adopts the
   newest view (a process group of the survivors per lane, ``new_group(members_only=True)``,
   in lane order) and runs the collective again there, from the same inputs.

The functions must therefore be repeatable: they may not change their inputs (an in-place
allreduce works on a copy). Results are identical on every rank that returns one. What a
committed collective cost in store traffic: one ``compare_set``, one or a few ``check`` calls,
one ``multi_get``, and a ``view/count`` read every 50 ms while it waits; its result waits for
the slowest member's vote.

Not handled: two ranks lost within one ``timeout`` of each other are adopted one after the
other, which works when both are dead; a view whose group a later-lost member never joins
ends the run at the group's timeout.
"""

from __future__ import annotations

import json
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import torch
import torch.distributed as dist

from lightning_parallel.comm.groups import new_group
from lightning_parallel.comm.liveness import Watchdog

__all__: list[str] = []

log = logging.getLogger(__name__)

_T = TypeVar("_T")

#: ``fn(group, members)``: a collective over ``group`` whose ranks are ``members``
Collective = Callable[[Any, list[int]], _T]


class LostRank(RuntimeError):
    """The run cannot go on as asked: this rank was declared lost, or rank 0 / the store is gone,
    or a collective failed with no lost rank to explain it."""


@dataclass
class View:
    """The ranks in the run from some point on, and each lane's process group over them."""

    number: int
    members: list[int]
    groups: dict[str, Any]
    lost: list[tuple[int, str]] = field(default_factory=list)  # every rank lost so far


class _Lane:
    """A daemon thread running one lane's collectives in the order they were submitted."""

    def __init__(self, name: str, device: torch.device | None) -> None:
        self._jobs: queue.SimpleQueue[tuple[Callable[[], Any], Future[Any]] | None] = (
            queue.SimpleQueue()
        )
        self._device = device
        self._thread = threading.Thread(target=self._run, name=f"lp-lane-{name}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        if self._device is not None and self._device.type == "cuda":
            torch.cuda.set_device(self._device)  # the current device is per thread
        while (job := self._jobs.get()) is not None:
            call, future = job
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(call())
            except BaseException as error:  # handed to the waiting thread
                future.set_exception(error)

    def submit(self, call: Callable[[], _T]) -> Future[_T]:
        future: Future[_T] = Future()
        self._jobs.put((call, future))
        return future

    def close(self) -> None:
        """Let the thread end after its current job (it may be blocked on a lost peer: it is a
        daemon and dies with the process)."""
        self._jobs.put(None)


class Pending(Generic[_T]):
    """A collective submitted to :meth:`Survivors.run`; :meth:`wait` returns its agreed result."""

    def __init__(self, survivors: Survivors, lane: str, seq: int, fn: Collective[_T]) -> None:
        self._survivors = survivors
        self.lane = lane
        self.seq = seq
        self._fn = fn
        self._result: tuple[_T, list[int]] | None = None
        self._attempt = survivors._start(self)

    @property
    def members(self) -> list[int]:
        """The ranks whose contributions the result holds (after :meth:`wait`)."""
        assert self._result is not None, "wait() first"
        return self._result[1]

    def wait(self) -> _T:
        """The result, the same on every survivor; runs again over the survivors after a loss."""
        if self._result is None:
            self._result = self._survivors._settle(self)
        return self._result[0]


class Survivors:
    """Collectives over the ranks still in the run, agreed through the store (module doc).

    Args:
        store: a store every rank reaches (the default group's); keys are prefixed here.
        heartbeats: the store holding every rank's ``beat/<rank>`` counter (``Liveness``'s).
        rank: this rank (global); ``world_size`` the number of ranks at the start.
        lanes: each lane's process group over every rank (``None``: the default group), in the
            order new groups are made for them after a loss.
        timeout: seconds of heartbeat silence after which a member is lost.
        device: the device collectives run on (CUDA lanes set it in their thread).
        on_loss: called on every rank with each view adopted after a loss.
    """

    def __init__(
        self,
        store: dist.Store,
        heartbeats: dist.Store,
        rank: int,
        world_size: int,
        lanes: dict[str, Any],
        timeout: float,
        device: torch.device | None = None,
        on_loss: Callable[[View], None] | None = None,
    ) -> None:
        if timeout <= 0:
            raise ValueError(f"timeout must be > 0 seconds, got {timeout}")
        self.store = dist.PrefixStore("lightning_parallel/survivors/", store)
        self.rank = rank
        self.timeout = timeout
        self.view = View(0, list(range(world_size)), dict(lanes))
        self._device = device
        self._on_loss = on_loss
        self._lanes = {name: _Lane(name, device) for name in lanes}
        self._seq = dict.fromkeys(lanes, 0)
        self._written: dict[str, list[list[str]]] = {name: [] for name in lanes}
        self._closed = False
        self._published = list(self.view.members)  # rank 0: the members it declared
        self._watchdog: Watchdog | None = None
        if rank == 0 and world_size > 1:
            self._watchdog = Watchdog(heartbeats, self._watched, timeout, self._publish)

    @property
    def members(self) -> list[int]:
        """The ranks in the current view."""
        return list(self.view.members)

    def group(self, lane: str) -> Any:
        """The current view's process group of ``lane``."""
        return self.view.groups[lane]

    # ------------------------------------------------------------------ verdicts (rank 0)

    def _watched(self) -> list[int]:
        return [rank for rank in self._published if rank != 0]

    def _publish(self, rank: int, silent_for: float) -> None:
        if self._closed or rank not in self._published:
            return
        self._published.remove(rank)
        count = int(self.store.add("view/count", 0)) + 1
        reason = f"no heartbeat for {silent_for:.0f} s: killed, frozen or cut off"
        record = {"lost": rank, "reason": reason, "members": self._published}
        self.store.set(f"view/{count}", json.dumps(record))
        self.store.add("view/count", 1)

    def published(self) -> int:
        """The number of views published so far (0: nobody lost)."""
        try:
            return int(self.store.add("view/count", 0))
        except Exception as error:
            raise LostRank(
                "the rendezvous store (rank 0's host) does not answer: rank 0 was lost, or this "
                f"host (rank {self.rank}) lost its link; a run cannot go on without rank 0 "
                f"({error})"
            ) from error

    def _read_view(self, number: int) -> dict[str, Any]:
        return json.loads(self.store.get(f"view/{number}").decode("utf-8"))

    def adopt(self) -> bool:
        """Move to the newest published view (new groups, in lane order); ``True`` if it moved.

        Raises:
            LostRank: this rank was declared lost.
        """
        moved = False
        while self.view.number < self.published():
            record = self._read_view(self.view.number + 1)
            members = [int(rank) for rank in record["members"]]
            lost = (int(record["lost"]), str(record["reason"]))
            if self.rank not in members:
                raise LostRank(
                    f"rank {self.rank} was declared lost by the others ({lost[1]}) and leaves "
                    "the run"
                )
            groups = {name: new_group(members, members_only=True) for name in self._lanes}
            for lane in self._lanes.values():
                lane.close()  # it may be blocked on the lost rank for good
            self._lanes = {name: _Lane(name, self._device) for name in groups}
            self.view = View(self.view.number + 1, members, groups, [*self.view.lost, lost])
            moved = True
            if self._on_loss is not None:
                self._on_loss(self.view)
        return moved

    # ------------------------------------------------------------------ collectives

    def run(self, lane: str, fn: Collective[_T]) -> Pending[_T]:
        """Start ``fn`` on ``lane``; ``wait()`` on the result gives the agreed value."""
        if self.published() > self.view.number:
            self.adopt()
        self._seq[lane] += 1
        return Pending(self, lane, self._seq[lane], fn)

    def call(self, lane: str, fn: Collective[_T]) -> _T:
        """``run(lane, fn).wait()``."""
        return self.run(lane, fn).wait()

    def _start(self, pending: Pending[_T]) -> tuple[View, Future[_T]]:
        view = self.view
        group, members = view.groups[pending.lane], list(view.members)
        future = self._lanes[pending.lane].submit(lambda: pending._fn(group, members))
        return view, future

    def _settle(self, pending: Pending[_T]) -> tuple[_T, list[int]]:
        written: list[str] = []
        while True:
            view, future = pending._attempt
            outcome, result = self._await(future, view)
            prefix = f"op/{pending.lane}/{pending.seq}/{view.number}"
            written.append(f"{prefix}/{self.rank}")
            votes = self._vote(prefix, outcome, view.members)
            if outcome == "error":
                raise result
            if all(vote == "done" for vote in votes.values()):
                self._forget(pending.lane, written)
                return result, list(view.members)
            errors = [rank for rank, vote in votes.items() if vote == "error"]
            if errors:
                raise LostRank(
                    f"a collective failed on rank(s) {errors} while no rank was lost; see their "
                    "error"
                )
            self.adopt()
            pending._attempt = self._start(pending)

    def _await(self, future: Future[_T], view: View) -> tuple[str, Any]:
        """Wait for an attempt: ``("done", result)``; ``("failed", None)`` once a newer view
        supersedes it; ``("error", exception)`` for a collective that raised with no loss
        declared within ``timeout`` and a margin (an error of its own)."""
        poll = 0.05
        while True:
            try:
                return "done", future.result(timeout=poll)
            except FutureTimeout:
                if self.published() > view.number:
                    if future.done() and future.exception() is None:
                        return "done", future.result()
                    return "failed", None
            except Exception as error:
                deadline = time.monotonic() + self.timeout + 10.0
                while time.monotonic() < deadline:
                    if self.published() > view.number:
                        return "failed", None
                    time.sleep(poll)
                return "error", error

    def _vote(self, prefix: str, outcome: str, members: Sequence[int]) -> dict[int, str]:
        """Write this rank's outcome, wait for every member's (``lost`` for the lost), read all.

        A member that is alive but late (its heartbeat goes on) is waited for: only the
        watchdog's verdict turns a missing vote into ``lost``.
        """
        self.store.compare_set(f"{prefix}/{self.rank}", "", outcome)
        keys = {rank: f"{prefix}/{rank}" for rank in members}
        sleep = 0.001
        while not self.store.check(list(keys.values())):
            latest = self._latest_members()
            for rank, key in keys.items():
                if rank not in latest and not self.store.check([key]):
                    self.store.compare_set(key, "", "lost")
            time.sleep(sleep)
            sleep = min(0.02, sleep * 2)
        values = self.store.multi_get(list(keys.values()))
        return {rank: value.decode() for rank, value in zip(keys, values, strict=True)}

    def _latest_members(self) -> list[int]:
        count = self.published()
        if count == self.view.number:
            return self.view.members
        return [int(rank) for rank in self._read_view(count)["members"]]

    def _forget(self, lane: str, written: list[str]) -> None:
        """Delete this rank's votes on the lane's collective before last: every member has read
        them (each voted on the last one after reading them)."""
        history = self._written[lane]
        history.append(written)
        while len(history) > 2:
            for key in history.pop(0):
                try:
                    self.store.delete_key(key)
                except Exception:  # the store is gone: the next collective says so
                    return

    def close(self) -> None:
        """Say this rank is done; rank 0 lingers until every member is; stop; let the lanes end.

        Rank 0 hosts the store, and a rank still reading the votes of the last collective
        (Lightning's barrier before the last checkpoint, say) would find it gone if rank 0's
        process ended first. So rank 0 waits, its watchdog still running, until every member of
        the newest view has written ``closed/<rank>`` or has been declared lost, for at most
        ``2 * timeout + 10`` seconds (a member alive but stuck). Blocked lanes die with the
        process.
        """
        try:
            self.store.set(f"closed/{self.rank}", "1")
            if self._watchdog is not None:
                self._linger(bound=2 * self.timeout + 10.0)
        except Exception:  # the store is gone (rank 0 lost): nothing to wait for
            pass
        self._closed = True
        if self._watchdog is not None:
            self._watchdog.stop(wait=False)
        for lane in self._lanes.values():
            lane.close()

    def _linger(self, bound: float) -> None:
        deadline = time.monotonic() + bound
        while time.monotonic() < deadline:
            keys = [f"closed/{rank}" for rank in self._published if rank != self.rank]
            if not keys or self.store.check(keys):
                return
            time.sleep(0.02)
        log.warning(
            "rank 0 stopped waiting for ranks %s to finish after %.0f s",
            [rank for rank in self._published if not self.store.check([f"closed/{rank}"])],
            bound,
        )
