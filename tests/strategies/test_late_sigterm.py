"""The SIGTERM flag a no-flush pipeline reads a batch late (strategies/base.py)."""

import time
from types import SimpleNamespace

import pytest
from helpers.distributed import run_distributed
from pytorch_lightning.utilities.exceptions import SIGTERMException

from lightning_parallel.strategies.base import LateSigtermFlag


def _trainer():
    return SimpleNamespace(received_sigterm=False, strategy=SimpleNamespace(root_device="cpu"))


@pytest.mark.slow
def test_no_rank_waits_for_the_others_at_a_batch_and_all_stop_at_the_same_one():
    """Rank 0 reaches each batch 0.3 s after the one before and receives SIGTERM at batch 2.
    Rank 1 passes batch ``n``'s flag before rank 0 has reached batch ``n`` (Lightning's
    blocking broadcast holds it there until rank 0 arrives), and both raise at batch 3,
    reading batch 2's flag."""

    def fn(rank, world):
        trainer = _trainer()
        flag = LateSigtermFlag(trainer)
        times = []
        for batch in range(6):
            if rank == 0:
                time.sleep(0.3)
                trainer.received_sigterm = batch >= 2
                times.append(time.time())  # reached the batch
            try:
                flag()
            except SIGTERMException:
                return batch, times
            if rank == 1:
                times.append(time.time())  # passed the batch's flag
        return None, times

    (stopped_0, reached_0), (stopped_1, passed_1) = run_distributed(fn, 2, timeout=60)
    assert stopped_0 == stopped_1 == 3
    for batch in (1, 2):
        assert passed_1[batch] < reached_0[batch] - 0.1


def test_draining_completes_the_broadcast_in_flight():
    def fn(rank, world):
        flag = LateSigtermFlag(_trainer())
        flag()
        flag.drain()
        return flag.pending is None

    assert run_distributed(fn, 2, timeout=60) == [True, True]
