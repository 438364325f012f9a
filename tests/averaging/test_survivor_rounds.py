"""Averaging rounds over the survivors (averaging/survivor_reduction.py) against their reference.

Three gloo processes, plain torch: each replica holds its own values; rank 2 dies before a
round; the round that the two others then agree on must be exactly the mean of their two
replicas (for fp32 values, and within the codes' error for int8 deltas), and DiLoCo's outer step
must be taken from that mean.
"""

from __future__ import annotations

import os

import pytest
import torch
from helpers.distributed import run_distributed
from torch import nn

from lightning_parallel.averaging import (
    AveragingSchedule,
    OuterOptimizerAverager,
    PeriodicAverager,
    ReplicaAveraging,
    build_reduction,
)
from lightning_parallel.averaging.quantize import BlockQuantizer
from lightning_parallel.averaging.quantized_gather import ROUNDS_LANE, QuantizedAllGather
from lightning_parallel.averaging.survivor_reduction import SurvivorAllReduce, rounds_lane
from lightning_parallel.comm.ledger import CommLedger
from lightning_parallel.comm.liveness import Liveness, default_store
from lightning_parallel.comm.survivors import Survivors


def _averaging(rank: int, world: int, model: nn.Module, averager, quantized: bool):
    store = default_store()
    assert store is not None
    liveness = Liveness(store, rank, world, interval=0.25)
    first = build_reduction("flat")
    survivors = Survivors(
        store, liveness.store, rank, world, {ROUNDS_LANE: rounds_lane(first)}, timeout=3.0
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    engine = ReplicaAveraging(
        model,
        [optimizer],
        averager,
        AveragingSchedule(1, 0),
        SurvivorAllReduce(survivors, first),
        ledger=CommLedger(),
        quantized=QuantizedAllGather(BlockQuantizer("int8"), survivors) if quantized else None,
    )
    return engine, survivors, liveness


def _replica(rank: int) -> torch.Tensor:
    return torch.arange(8, dtype=torch.float32) * (rank + 1) + 0.5 * rank


@pytest.mark.faults
@pytest.mark.parametrize("quantized", [False, True])
def test_a_round_after_a_loss_is_the_mean_of_the_survivors(quantized: bool) -> None:
    def fn(rank: int, world: int):
        model = nn.Linear(8, 1, bias=False)
        engine, survivors, liveness = _averaging(rank, world, model, PeriodicAverager(), quantized)
        engine.broadcast_replicas()
        engine.synchronize()  # the averagers start from the common point
        with torch.no_grad():
            model.weight.copy_(_replica(rank))
        if rank == 2:
            os._exit(1)
        engine.count_optimizer_step()
        engine.synchronize()  # the round: started over three, finished over two
        weights = [model.weight.detach().reshape(-1).clone()]
        for k in (1, 2):  # later rounds: over the survivors' own group from the start
            with torch.no_grad():
                model.weight.add_(_replica(rank) * k)
            engine.count_optimizer_step()
            engine.synchronize()
            weights.append(model.weight.detach().reshape(-1).clone())
        survivors.close()
        liveness.stop()
        return weights, survivors.members

    results = run_distributed(fn, 3, timeout=60, may_vanish={2})
    mean = (_replica(0) + _replica(1)) / 2
    expected = [mean, 2 * mean, 4 * mean]  # each round: the mean of x + k·replica
    for weights, members in results[:2]:
        assert members == [0, 1]
        for got, want in zip(weights, expected, strict=True):
            if quantized:  # int8 codes of each delta: within one step of the block's scale
                step = float(want.abs().max()) / 127
                torch.testing.assert_close(got, want, atol=step, rtol=0)
            else:
                torch.testing.assert_close(got, want, atol=0, rtol=1e-6)
    for first, second in zip(results[0][0], results[1][0], strict=True):
        assert torch.equal(first, second)


@pytest.mark.faults
def test_diloco_takes_its_outer_step_from_the_survivors_mean() -> None:
    def fn(rank: int, world: int):
        model = nn.Linear(8, 1, bias=False)
        with torch.no_grad():
            model.weight.zero_()
        outer = OuterOptimizerAverager(lambda p: torch.optim.SGD(p, lr=0.7, momentum=0.5))
        engine, survivors, liveness = _averaging(rank, world, model, outer, quantized=False)
        engine.broadcast_replicas()
        engine.synchronize()
        with torch.no_grad():
            model.weight.copy_(_replica(rank))
        if rank == 2:
            os._exit(1)
        engine.count_optimizer_step()
        engine.synchronize()
        weights = model.weight.detach().reshape(-1).clone()
        survivors.close()
        liveness.stop()
        return weights

    results = run_distributed(fn, 3, timeout=60, may_vanish={2})
    # the pseudo-gradient x_g − x̄ from x_g = 0, one outer SGD step with lr 0.7 (momentum's
    # buffer starts as the gradient: the first step is plain)
    mean = (_replica(0) + _replica(1)) / 2
    expected = torch.zeros(8) - 0.7 * (torch.zeros(8) - mean)
    for weights in results[:2]:
        torch.testing.assert_close(weights, expected)
