"""Collectives that outlive a lost rank (comm/survivors.py), on real gloo processes."""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch
import torch.distributed as dist
from helpers.distributed import run_distributed, start_fork_server

from lightning_parallel.comm.liveness import Liveness, default_store
from lightning_parallel.comm.survivors import LostRank, Survivors


def _survivors(rank: int, world: int, timeout: float = 6.0) -> tuple[Survivors, Liveness]:
    store = default_store()
    assert store is not None
    liveness = Liveness(store, rank, world, interval=0.25)
    seen: list[list[int]] = []
    survivors = Survivors(
        store,
        liveness.store,
        rank,
        world,
        {"main": None, "side": dist.new_group()},
        timeout=timeout,
        on_loss=lambda view: seen.append(view.members),
    )
    survivors.seen = seen  # type: ignore[attr-defined]
    return survivors, liveness


def _summed(value: float):
    def fn(group, members):
        tensor = torch.tensor([value])
        dist.all_reduce(tensor, group=group)
        return float(tensor), list(members)

    return fn


def test_without_a_loss_every_rank_gets_the_sum_in_order_on_both_lanes():
    def fn(rank, world):
        survivors, liveness = _survivors(rank, world)
        pending = [survivors.run("side", _summed(rank + 10 * k)) for k in range(3)]
        main = survivors.call("main", _summed(1.0))
        results = [p.wait() for p in pending]
        survivors.close()
        liveness.stop()
        return main, results, survivors.seen

    for main, results, seen in run_distributed(fn, 3):
        assert main == (3.0, [0, 1, 2])
        assert [value for value, _ in results] == [3.0, 33.0, 63.0]
        assert seen == []


@pytest.mark.faults
@pytest.mark.parametrize("fault", ["kill", "freeze"])
def test_the_survivors_agree_and_redo_a_collective_without_the_lost_rank(fault):
    """Rank 2 stops before its fifth collective (killed, or frozen with its sockets open); the
    fifth is redone over ranks 0 and 1 once rank 0's watchdog declares the loss, and every
    later collective runs over the two; the results are the same on both."""

    def fn(rank, world):
        survivors, liveness = _survivors(rank, world)
        sums = []
        for k in range(8):
            if rank == 2 and k == 4:
                if fault == "kill":
                    os._exit(1)
                os.kill(os.getpid(), signal.SIGSTOP)
            pending = survivors.run("side", _summed(float(rank + 1)))
            sums.append(pending.wait())
        survivors.close()
        liveness.stop()
        return sums, survivors.seen, survivors.view.lost

    start_fork_server()  # its first start is not the run's time
    start = time.monotonic()
    results = run_distributed(fn, 3, timeout=60, may_vanish={2})
    assert time.monotonic() - start < 40
    assert results[2] is None
    for sums, seen, lost in results[:2]:
        assert [value for value, _ in sums[:4]] == [6.0] * 4
        assert sums[4:] == [(3.0, [0, 1])] * 4  # 1 + 2: rank 2's 3 is gone
        assert seen == [[0, 1]]
        assert [rank for rank, _ in lost] == [2] and "no heartbeat" in lost[0][1]


@pytest.mark.faults
def test_a_rank_declared_lost_leaves_with_an_error_naming_it():
    """A rank that was frozen past the timeout and wakes up finds itself declared lost."""

    def fn(rank, world):
        survivors, liveness = _survivors(rank, world, timeout=4.0)
        if rank == 1:
            liveness.stop()  # its heartbeat stops, as if frozen
            time.sleep(9.0)
            with pytest.raises(LostRank, match="rank 1 was declared lost"):
                survivors.call("main", _summed(1.0))
            default_store().set("test/left", "1")
            return "left"
        value = survivors.call("main", _summed(1.0))
        default_store().wait(["test/left"])  # rank 0 hosts the store: it stays until then
        survivors.close()
        liveness.stop()
        return value

    results = run_distributed(fn, 2, timeout=60)
    assert results == [(1.0, [0]), "left"]


@pytest.mark.faults
def test_a_collective_finished_by_some_survivors_only_is_run_again_by_all():
    """As when a rank dies in the middle of a ring all-reduce: rank 0's attempt "finishes"
    (it returns without waiting for anyone) while rank 1's waits for the dead rank 2. Both
    votes are read the same way, so rank 0 throws its result away and both run it again."""

    def fn(rank, world):
        survivors, liveness = _survivors(rank, world)
        if rank == 2:
            os._exit(1)

        def uneven(group, members):
            if rank == 0 and len(members) == 3:
                return "finished alone"
            return _summed(float(rank + 1))(group, members)

        value = survivors.call("main", uneven)
        survivors.close()
        liveness.stop()
        return value

    results = run_distributed(fn, 3, timeout=60, may_vanish={2})
    assert results[:2] == [(3.0, [0, 1])] * 2


@pytest.mark.faults
def test_rank_0_keeps_the_store_until_every_member_has_closed_or_is_lost():
    """Rank 0 hosts the store: its ``close`` waits for rank 1, which reads the store 2 s after
    the last collective (as a slow rank reads its last votes), and not for rank 2, which died
    after it (declared lost within the heartbeat timeout, far sooner than the 22 s bound)."""

    def fn(rank, world):
        survivors, liveness = _survivors(rank, world)
        survivors.call("main", _summed(1.0))
        if rank == 2:
            os._exit(1)
        if rank == 1:
            time.sleep(2.0)
            survivors.store.set("late", "read")  # fails if rank 0's process has ended
        start = time.monotonic()
        survivors.close()
        liveness.stop()
        return time.monotonic() - start

    lingered, _, _ = run_distributed(fn, 3, may_vanish={2}, timeout=60)
    assert 1.5 < lingered < 16.0, lingered  # declared lost after 6 s; the bound is 22 s
