import os
import time

import pytest
import torch
import torch.distributed as dist
from helpers.distributed import run_distributed, start_fork_server


def test_results_come_back_by_rank():
    def body(rank, world):
        tensor = torch.tensor([float(rank)])
        dist.all_reduce(tensor)
        return rank, tensor.item()

    assert run_distributed(body, 3) == [(0, 3.0), (1, 3.0), (2, 3.0)]


def test_a_failing_rank_raises_with_its_traceback():
    def body(rank, world):
        if rank == 1:
            raise ValueError("rank one broke")
        return rank

    with pytest.raises(RuntimeError, match="rank one broke"):
        run_distributed(body, 2, timeout=30)


@pytest.mark.faults
def test_a_hung_rank_times_out_and_is_killed():
    def body(rank, world):
        if rank == 0:
            time.sleep(120)
        return os.getpid()

    start_fork_server()
    start = time.monotonic()
    with pytest.raises(TimeoutError, match="ranks still running"):
        run_distributed(body, 2, timeout=3)
    # the rank sleeps 120 s: killed, not waited for (a busy machine takes ~30 s to get there)
    assert time.monotonic() - start < 60
