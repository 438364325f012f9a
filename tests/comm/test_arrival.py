"""Which ranks reached a point, asked through a store (one process: the other ranks' keys are
set by hand, as their processes would)."""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import torch.distributed as dist

from lightning_parallel.comm.arrival import ranks_missing


def test_every_rank_there_returns_nothing_at_once() -> None:
    store = dist.HashStore()
    store.set("point/1", "1")
    store.set("point/2", "1")
    started = time.monotonic()
    assert ranks_missing(store, "point", 0, 3, timedelta(seconds=30)) == []
    assert time.monotonic() - started < 5


def test_a_rank_that_never_comes_is_named_after_the_wait() -> None:
    store = dist.HashStore()
    store.set("point/2", "1")
    started = time.monotonic()
    assert ranks_missing(store, "point", 0, 3, timedelta(seconds=0.3)) == [1]
    assert time.monotonic() - started >= 0.3
    assert store.check(["point/0"])  # this rank announced itself for the others


def test_a_rank_that_comes_during_the_wait_counts() -> None:
    store = dist.HashStore()
    late = threading.Timer(0.2, lambda: store.set("point/1", "1"))
    late.start()
    assert ranks_missing(store, "point", 0, 2, timedelta(seconds=10)) == []
    late.join()


def test_points_are_apart() -> None:
    store = dist.HashStore()
    store.set("first/1", "1")
    assert ranks_missing(store, "second", 0, 2, timedelta(seconds=0.1)) == [1]
