"""The failure diagnosis: heartbeats in the store name the rank that stopped, and what it did."""

from __future__ import annotations

import gc
import socket
import threading
import time
from collections.abc import Iterator
from datetime import timedelta

import pytest
import torch.distributed as dist

from lightning_parallel.comm import liveness
from lightning_parallel.comm.liveness import Liveness, is_communication_error, set_activity


@pytest.fixture(autouse=True)
def _destroy_the_stores_here() -> Iterator[None]:
    """A test's stores (and the exceptions that still reference them) are destroyed in this
    process before the next test: a store's server thread lives here, and a child forked later
    that collected the garbage would join a thread it does not have and hang (seen once in the
    suite, under pytest-xdist: a Lightning ``ddp`` child stuck in ``~TCPStore``)."""
    yield
    _RELEASE.set()  # a store left hanging on purpose answers now; its sampler thread ends
    time.sleep(0.05)
    gc.collect()
    _RELEASE.clear()


#: set after each test: ends the waits of stores that never answer
_RELEASE = threading.Event()


def _store() -> dist.TCPStore:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    return dist.TCPStore(
        "127.0.0.1", port, 1, True, timeout=timedelta(seconds=10), wait_for_workers=False
    )


def test_the_diagnosis_names_the_rank_whose_heartbeat_stopped_and_its_last_activity() -> None:
    store = _store()
    set_activity("step 7: backward")
    ranks = [Liveness(store, rank, 3, interval=0.1) for rank in range(3)]
    time.sleep(0.3)
    ranks[2].stop()  # rank 2 "dies": its counter stops moving
    try:
        set_activity("step 9: model averaging round")
        found = ranks[0].diagnose(wait=0.5)
    finally:
        for rank in ranks[:2]:
            rank.stop()
    assert found.silent == {2: "step 7: backward"} and not found.store_unreachable
    assert "rank 2 (last doing: 'step 7: backward') stopped responding" in found.text
    assert "rank 0 was in 'step 9: model averaging round" in found.text


def test_the_diagnosis_says_when_no_peer_was_lost() -> None:
    store = _store()
    ranks = [Liveness(store, rank, 2, interval=0.1) for rank in range(2)]
    try:
        found = ranks[1].diagnose(wait=0.4)
    finally:
        for rank in ranks:
            rank.stop()
    assert found.silent == {} and "no peer was lost" in found.text


def test_an_unanswering_store_is_reported_as_the_store_hosts_failure(monkeypatch) -> None:
    store = _store()
    watcher = Liveness(store, 1, 2, interval=0.1)
    watcher.stop()

    def never_answers(*args: object) -> int:
        _RELEASE.wait(60)
        return 0

    monkeypatch.setattr(watcher, "_counts", never_answers)
    started = time.monotonic()
    found = watcher.diagnose(wait=0.2)
    assert time.monotonic() - started < 4.0  # bounded: wait + 3 s
    assert found.store_unreachable
    assert "rendezvous store on rank 0's host" in found.text and "this host (rank 1)" in found.text


def test_activity_is_what_was_set_last_with_its_age() -> None:
    set_activity("step 3: optimizer step")
    assert liveness.activity().startswith("step 3: optimizer step (for 0.")


@pytest.mark.parametrize(
    ("error", "expected"),
    [
        (RuntimeError("[gloo/transport/tcp/pair.cc:537] Connection closed by peer"), True),
        (RuntimeError("Timed out waiting 20000ms for recv operation to complete"), True),
        (dist.DistBackendError("NCCL communicator was aborted"), True),
        (ConnectionResetError(104, "reset"), True),
        (ValueError("the user's own bug"), False),
        (RuntimeError("mat1 and mat2 shapes cannot be multiplied"), False),
    ],
)
def test_which_errors_get_a_diagnosis(error: BaseException, expected: bool) -> None:
    assert is_communication_error(error) is expected
