"""The host-shaped tree reduce equals a flat allreduce, and only leaders cross hosts."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from helpers.distributed import run_distributed
from torch import nn

from lightning_parallel.averaging import (
    AveragingSchedule,
    PeriodicAverager,
    ReplicaAveraging,
    build_reduction,
)
from lightning_parallel.comm.accounting import track_collectives
from lightning_parallel.comm.ledger import CommLedger
from lightning_parallel.comm.tree import HostTopology, TreeAllReduce


def test_topology_blocks_of_consecutive_ranks() -> None:
    topology = HostTopology(world_size=6, ranks_per_host=3)
    assert topology.num_hosts == 2
    assert topology.host_ranks(1) == [3, 4, 5]
    assert topology.leaders() == [0, 3]
    assert [topology.host_of(rank) for rank in range(6)] == [0, 0, 0, 1, 1, 1]
    with pytest.raises(ValueError, match="not a multiple of ranks_per_host"):
        HostTopology(world_size=3, ranks_per_host=2)
    with pytest.raises(ValueError, match="positive"):
        HostTopology(world_size=3, ranks_per_host=0)


def test_tree_needs_the_host_size() -> None:
    def run(rank: int, world: int) -> str:
        os.environ.pop("LOCAL_WORLD_SIZE", None)
        try:
            TreeAllReduce()
        except ValueError as error:
            return str(error)
        return ""

    assert all("LOCAL_WORLD_SIZE" in message for message in run_distributed(run, 2))


def test_tree_equals_flat_allreduce_on_two_hosts_of_two() -> None:
    def run(rank: int, world: int) -> dict[str, bool]:
        generator = torch.Generator().manual_seed(rank)
        floats = torch.randn(1000, generator=generator)
        integers = torch.randint(-100, 100, (37,), generator=generator).double()
        flat_floats, flat_integers = floats.clone(), integers.clone()
        dist.all_reduce(flat_floats)
        dist.all_reduce(flat_integers)
        results = {}
        os.environ["LOCAL_WORLD_SIZE"] = "2"  # read when ranks_per_host is not given
        for ranks_per_host in (2, 1, 4, None):
            tree = TreeAllReduce(ranks_per_host=ranks_per_host)
            for async_op in (False, True):
                tree_floats, tree_integers = floats.clone(), integers.clone()
                tree.all_reduce([tree_floats, tree_integers], async_op=async_op).wait()
                key = f"{ranks_per_host}-{async_op}"
                results[f"{key}-integers-exact"] = torch.equal(tree_integers, flat_integers)
                results[f"{key}-floats"] = torch.allclose(tree_floats, flat_floats, atol=1e-5)
        return results

    for results in run_distributed(run, 4):
        failed = [name for name, ok in results.items() if not ok]
        assert not failed, failed


def test_only_leaders_cross_hosts_and_fewer_bytes_than_flat() -> None:
    def run(rank: int, world: int) -> dict[str, float]:
        tree = TreeAllReduce(ranks_per_host=2)
        payload = torch.ones(250)  # 1000 bytes
        ledger = CommLedger()
        with track_collectives(ledger):
            tree.all_reduce([payload]).wait()
        return {
            "leader": float(tree.is_leader),
            "counted": ledger.total_bytes(),
            "predicted": tree.bytes_sent(1000),
            "network_per_host": tree.network_bytes_per_host(1000),
            "sum": float(payload[0]),
        }

    results = run_distributed(run, 4)
    assert [r["leader"] for r in results] == [1.0, 0.0, 1.0, 0.0]
    assert all(r["sum"] == 4.0 for r in results)
    for result in results:  # the accounting wrapper agrees with the tree's own cost model
        assert result["counted"] == pytest.approx(result["predicted"])
    # host-level traffic: tree N = 1000 bytes, flat ring over 4 ranks placed host by host 1.5·N
    flat_ring_across_hosts = 2 * (4 - 1) / 4 * 1000
    assert results[0]["network_per_host"] == pytest.approx(1000)
    assert results[0]["network_per_host"] < flat_ring_across_hosts


def test_rounds_with_tree_reduce_equal_flat_reduce() -> None:
    def run(rank: int, world: int) -> list[float]:
        finals = []
        for kind, overlap in (("flat", False), ("tree", False), ("flat", True), ("tree", True)):
            torch.manual_seed(0)
            model = nn.Linear(5, 3)
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
            averaging = ReplicaAveraging(
                model,
                [optimizer],
                PeriodicAverager(),
                AveragingSchedule(period=2, warmup_steps=1),
                build_reduction(kind, ranks_per_host=2),
                overlap=overlap,
                ledger=CommLedger(),
            )
            for step in range(7):
                averaging.synchronize()
                generator = torch.Generator().manual_seed(100 * rank + step)
                inputs = torch.randn(4, 5, generator=generator)
                optimizer.zero_grad()
                model(inputs).pow(2).mean().backward()
                if averaging.in_warmup:
                    averaging.average_gradients()
                optimizer.step()
                averaging.count_optimizer_step()
            averaging.finish()
            finals.append(torch.cat([p.detach().reshape(-1) for p in model.parameters()]))
        return [
            float((finals[0] - finals[1]).abs().max()),  # blocking rounds
            float((finals[2] - finals[3]).abs().max()),  # overlapped rounds (tree on a thread)
            float((finals[0] - finals[2]).abs().max()),  # overlap does change the trajectory
        ]

    for blocking, overlapped, overlap_effect in run_distributed(run, 4):
        assert blocking < 1e-6
        assert overlapped < 1e-6
        assert overlap_effect > 1e-4
