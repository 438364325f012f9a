"""The collective laws: their arithmetic, and their bytes and seconds against the kernel's
counters of real gloo collectives on 2, 4 and 8 simulated hosts."""

from __future__ import annotations

import io
import json
import statistics
import sys
from dataclasses import replace
from typing import Any

import pytest

from lightning_parallel.cluster import SimulatedNetwork, netns_unavailable_reason, run_on_hosts
from lightning_parallel.plan.framing import ETHERNET, HEADER_BYTES, VETH, wire_bytes
from lightning_parallel.plan.network import (
    Cluster,
    Link,
    Transfer,
    all_gather,
    all_reduce,
    broadcast,
    gather,
    reduce_scatter,
    ring_segments,
    scatter,
    send,
)

MB = 1e6


def _cluster(hosts: int, processes_per_host: int = 1, **kwargs: Any) -> Cluster:
    return Cluster.parse(hosts, processes_per_host, "1gbit", "1ms", **kwargs)


# ---------------------------------------------------------------------------- the arithmetic


@pytest.mark.parametrize("hosts", [2, 4, 8])
def test_ring_all_reduce_sends_two_w_minus_one_over_w_of_the_tensor(hosts):
    cluster = _cluster(hosts)
    transfer = all_reduce(cluster, 4 * MB)
    assert transfer.payload_bytes == pytest.approx(2 * (hosts - 1) / hosts * 4 * MB)
    assert transfer.messages == 2 * (hosts - 1)
    chunk_s = 1e-3 + (4 * MB / hosts) * 8 * VETH.shaping_factor / 1e9
    assert transfer.seconds == pytest.approx(2 * (hosts - 1) * chunk_s)


def test_gloo_cuts_a_ring_all_reduce_into_two_segments_a_rank_up_to_2_mib_each():
    assert ring_segments(2, 2048) == 4
    assert ring_segments(8, 2048) == 16
    assert ring_segments(2, 8, element_bytes=8) == 1  # one float64: one segment holds data
    assert ring_segments(4, 8) == 2  # two float32 elements
    assert ring_segments(2, 5 * 2**20) == 4  # ⌈5/2⌉ = 3 pieces, at least 2W
    assert ring_segments(2, 25 * 2**20) == 14  # a 25 MiB bucket: 13 pieces, rounded to W
    # every host sends and receives 2(W-1)/W of them: on 2 hosts a 2 kB all-reduce is 8
    # messages a host, where one a round would be 4
    cluster = _cluster(2)
    framing = cluster.framing
    small = all_reduce(cluster, 2048)
    assert small.wire_bytes == pytest.approx(wire_bytes(2048, 2048, 4, 4, framing))


def test_tree_all_reduce_sends_log2_w_tensors_from_the_root():
    transfer = all_reduce(_cluster(8), 4 * MB, algorithm="tree")
    assert transfer.payload_bytes == pytest.approx(3 * 4 * MB)
    assert transfer.messages == 6
    with pytest.raises(ValueError, match="'ring' or 'tree'"):
        all_reduce(_cluster(2), 1.0, algorithm="bcube")


def test_all_gather_broadcast_scatter_gather_and_send_bytes():
    cluster = _cluster(8)
    assert all_gather(cluster, MB).payload_bytes == pytest.approx(7 * MB)
    assert broadcast(cluster, MB).payload_bytes == pytest.approx(3 * MB)
    assert broadcast(_cluster(5), MB).payload_bytes == pytest.approx(3 * MB)  # ⌈log2 5⌉
    assert scatter(cluster, MB).payload_bytes == pytest.approx(7 * MB)
    assert gather(cluster, MB).payload_bytes == pytest.approx(MB)
    # the root's inbound link carries the seven others' bytes
    assert gather(cluster, MB).seconds == pytest.approx(send(cluster, 7 * MB).seconds)
    assert send(cluster, MB).payload_bytes == MB
    assert send(cluster, MB).seconds == pytest.approx(1e-3 + MB * 8 * 1514 / 1448 / 1e9)


def test_reduce_scatter_ring_sends_half_what_gloo_does():
    cluster = _cluster(4)
    ring = reduce_scatter(cluster, 4 * MB)
    assert ring.payload_bytes == pytest.approx(3 / 4 * 4 * MB)
    assert reduce_scatter(cluster, 4 * MB, algorithm="allreduce") == all_reduce(cluster, 4 * MB)
    with pytest.raises(ValueError, match="'ring' or 'allreduce'"):
        reduce_scatter(cluster, 1.0, algorithm="tree")


def test_one_host_sends_nothing_across_hosts_and_uses_the_intra_link():
    cluster = _cluster(1, processes_per_host=4)
    transfer = all_reduce(cluster, 4 * MB)
    assert transfer.payload_bytes == 0.0 and transfer.wire_bytes == 0.0
    intra = cluster.intra
    assert transfer.seconds == pytest.approx(6 * intra.seconds(MB, cluster.framing))
    assert send(cluster, MB).seconds == pytest.approx(intra.seconds(MB, cluster.framing))
    assert all_reduce(_cluster(1), 4 * MB) == Transfer(0.0, 0.0, 0.0, 0)


def test_ranks_of_a_host_share_its_one_ring_edge_and_wait_for_the_slower_link():
    cluster = _cluster(2, processes_per_host=4)  # W = 8
    transfer = all_reduce(cluster, 8 * MB)
    assert transfer.payload_bytes == pytest.approx(2 * 7 / 8 * 8 * MB)
    slow_intra = replace(cluster, intra=Link(1e8, 0.0))
    slower = slow_intra.intra.seconds(MB, cluster.framing)
    assert all_reduce(slow_intra, 8 * MB).seconds == pytest.approx(14 * slower)


def test_hosts_sharing_an_uplink_divide_its_bandwidth():
    alone, shared = _cluster(8), _cluster(8, hosts_per_link=4)
    chunk = 4 * MB / 8 * 8 * VETH.shaping_factor / 1e9
    assert all_reduce(shared, 4 * MB).seconds == pytest.approx(14 * (1e-3 + 4 * chunk))
    assert all_reduce(shared, 4 * MB).payload_bytes == all_reduce(alone, 4 * MB).payload_bytes
    # a lone sender has the uplink to itself
    assert send(shared, MB).seconds == send(alone, MB).seconds
    # broadcast: 1, 2, then 4 hosts send at once
    one = 8 * MB * VETH.shaping_factor / 1e9
    assert broadcast(shared, MB).seconds == pytest.approx(3e-3 + one * (1 + 2 + 4))


def test_wire_bytes_law():
    # on veth: one 66-byte header a 45-segment packet, one ACK a packet received
    packet = 45 * 1448
    assert wire_bytes(packet * 10, 0.0) == pytest.approx(packet * 10 + 10 * HEADER_BYTES)
    assert wire_bytes(0.0, packet * 10) == pytest.approx(10 * HEADER_BYTES)
    # a NIC that counts segments, ACKing every second one: 4.6% + 2.3% of framing
    counted = wire_bytes(1448 * 100, 1448 * 100, framing=ETHERNET)
    assert counted == pytest.approx(1448 * 100 + 66 * 100 + 66 * 50)
    # gloo's preamble and ready notification, each in a packet of its own
    assert wire_bytes(0.0, 0.0, 1, 1) == pytest.approx(2 * (VETH.message_bytes + HEADER_BYTES))


def test_cluster_parse_and_validation():
    cluster = Cluster.parse(4, 2, "100mbit", "1ms", intra_bandwidth="10gbps", hosts_per_link=2)
    assert cluster.world == 8
    assert cluster.inter == Link(1e8, 1e-3)
    assert cluster.intra.bandwidth == 80e9 and cluster.intra.latency == pytest.approx(5e-6)
    assert cluster.sharing(8) == 2 and cluster.sharing(1) == 1
    with pytest.raises(ValueError, match="not understood"):
        Cluster.parse(2, 1, "fast", "0")
    with pytest.raises(ValueError, match="must be >= 1"):
        Cluster(0)
    with pytest.raises(ValueError, match="bandwidth > 0"):
        Link(0.0, 0.0)


# ------------------------------------------------------------------- against the kernel's counters

REASON = netns_unavailable_reason()


def netns(test: Any) -> Any:
    """Mark ``test`` as needing network namespaces (skipped where they cannot be made)."""
    return pytest.mark.netns(pytest.mark.skipif(REASON is not None, reason=REASON or "")(test))


# Each host runs each collective (once to warm up, then `repeats` times, each after a barrier;
# 20 times below 64 kB, whose bytes are few beside the barriers'), and reports its interface's
# tx_bytes and tx_packets per collective, less what the same loop of barriers and the pause
# after it (for the last delayed ACKs) cost alone, and the median seconds a collective took.
_PROBE = """
import json, os, statistics, sys, time
import torch, torch.distributed as dist
torch.set_num_threads(1)
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
sizes, repeats = json.loads(sys.argv[1]), int(sys.argv[2])
base = f"/sys/class/net/{os.environ['GLOO_SOCKET_IFNAME']}/statistics/"
def counters():
    return [int(open(base + name).read()) for name in ("tx_bytes", "tx_packets")]
def run(op, t):
    if op in ("all_reduce", "loss", "small"): dist.all_reduce(t)
    elif op in ("all_gather", "small_gather"):
        dist.all_gather_into_tensor(torch.empty(world * t.numel()), t)
    elif op == "broadcast": dist.broadcast(t, 0)
    elif op == "reduce_scatter": dist.reduce_scatter_tensor(torch.empty(t.numel() // world), t)
    elif op == "send" and rank == 0: dist.send(t, 1)
    elif op == "send" and rank == 1: dist.recv(t, 0)
def settle():
    dist.barrier(); time.sleep(0.3)
def delta(start): return [b - a for a, b in zip(start, counters())]
settle()
report = {}
for op, nbytes in sizes.items():
    tensor = torch.ones(1, dtype=torch.float64) if op == "loss" else torch.ones(int(nbytes) // 4)
    count = repeats if nbytes >= 65536 else 20
    run(op, tensor); settle()
    start = counters()
    for _ in range(count):
        dist.barrier()
    settle()
    idle = delta(start)
    seconds, start = [], counters()
    for _ in range(count):
        dist.barrier()
        begin = time.perf_counter(); run(op, tensor); seconds.append(time.perf_counter() - begin)
    settle()
    sent, packets = [(d - i) / count for d, i in zip(delta(start), idle)]
    report[op] = {"tx_bytes": sent, "tx_packets": packets, "seconds": statistics.median(seconds)}
print(json.dumps(report), flush=True)
dist.destroy_process_group()
"""

SIZES = {"all_reduce": 4 * MB, "all_gather": MB, "broadcast": 2 * MB, "send": 4 * MB,
         "reduce_scatter": 2 * MB, "loss": 8, "small": 2048, "small_gather": 2048}  # fmt: skip


def _measure(hosts: int, sizes: dict[str, float], bandwidth: str, repeats: int) -> list[dict]:
    """Per host (by index), per collective: tx_bytes, tx_packets and seconds."""
    output = io.StringIO()
    with SimulatedNetwork(hosts, bandwidth, "0") as network:
        argv = [sys.executable, "-c", _PROBE, json.dumps(sizes), str(repeats)]
        result = run_on_hosts(network, argv, output=output, timeout=240)
        assert result.returncode == 0, result.tail
    rows = {int(line.split("]", 1)[0].split()[-1]): json.loads(line.split("] ", 1)[1])
            for line in output.getvalue().splitlines() if "] {" in line}  # fmt: skip
    assert sorted(rows) == list(range(hosts))
    return [rows[i] for i in range(hosts)]


def _payload(row: dict) -> float:
    """Payload bytes of a counter reading: every packet carries one 66-byte header."""
    return row["tx_bytes"] - HEADER_BYTES * row["tx_packets"]


def _check(law: Transfer, row: dict, what: str) -> None:
    counter, payload = row["tx_bytes"], _payload(row)
    print(f"{what}: law {law.wire_bytes:,.0f} B wire, {law.payload_bytes:,.0f} B payload; "
          f"counter {counter:,.0f} B, payload {payload:,.0f} B")  # fmt: skip
    # measured within 0.1% on 2, 4 and 8 hosts; the bounds leave room for GSO packets a few
    # times smaller than 45 segments (what a slower link gives: 53 kB at 100mbit), not for
    # the per-segment framing of a NIC (4.6% more)
    assert law.wire_bytes == pytest.approx(counter, rel=0.02), what
    assert law.payload_bytes == pytest.approx(payload, rel=0.01), what


@netns
@pytest.mark.parametrize("hosts", [2, 4, 8])
def test_gloo_collectives_send_what_the_laws_say(hosts):
    # one launch a host count runs every collective (pytest-xdist would repeat a shared
    # fixture's launch on each of its workers)
    rows = _measure(hosts, SIZES, "1gbit", repeats=2)
    for op in ("all_reduce", "all_gather"):
        _check_ring(hosts, rows, op)
    _check_ring_not_tree(hosts, rows)
    _check_reduce_scatter(hosts, rows)
    _check_broadcast_and_send(hosts, rows)
    _check_one_element_all_reduce(hosts, rows)
    _check_small_all_reduce(hosts, rows)


def _check_ring(hosts: int, rows: list[dict], op: str) -> None:
    """Every host sends ``2(W-1)/W · N`` (all_reduce) or ``(W-1) · n`` (all_gather)."""
    law = {"all_reduce": all_reduce, "all_gather": all_gather}[op]
    cluster = Cluster.parse(hosts, 1, "1gbit", "0")
    transfer = law(cluster, SIZES[op])
    for index, row in enumerate(rows):
        _check(transfer, row[op], f"{op} on {hosts} hosts, host {index}")
    # veth counts GSO packets, one header each, not the segments a NIC would count
    per_segment = law(replace(cluster, framing=ETHERNET), SIZES[op]).wire_bytes
    assert all(row[op]["tx_bytes"] < per_segment / 1.04 for row in rows)


def _check_ring_not_tree(hosts: int, rows: list[dict]) -> None:
    """No host sends the ``log2(W) · N`` of a tree's root."""
    cluster = Cluster.parse(hosts, 1, "1gbit", "0")
    tree = all_reduce(cluster, SIZES["all_reduce"], algorithm="tree").payload_bytes
    busiest = max(_payload(row["all_reduce"]) for row in rows)
    if hosts > 2:  # on 2 hosts the two send N each
        assert busiest < 0.9 * tree


def _check_reduce_scatter(hosts: int, rows: list[dict]) -> None:
    """gloo's reduce_scatter_tensor sends a whole allreduce's bytes, twice the ring's."""
    cluster = Cluster.parse(hosts, 1, "1gbit", "0")
    gloo = reduce_scatter(cluster, SIZES["reduce_scatter"], algorithm="allreduce")
    ring = reduce_scatter(cluster, SIZES["reduce_scatter"])
    for index, row in enumerate(rows):
        _check(gloo, row["reduce_scatter"], f"reduce_scatter on {hosts} hosts, host {index}")
        assert _payload(row["reduce_scatter"]) > 1.5 * ring.payload_bytes


def _check_one_element_all_reduce(hosts: int, rows: list[dict]) -> None:
    """The averaging's loss (one float64): gloo sends no empty segment, so the one segment
    goes round the ring, ``2(W-1)/W`` messages a host on average, not ``4(W-1)`` (two segments
    a rank). Measured: 482 B a host on 2 hosts, 383-761 on 4, 152-832 on 8 (mean 550-570; on 2
    hosts 119-581 across runs); the law: 400, 600 and 700 B, about the top of that spread."""
    cluster = Cluster.parse(hosts, 1, "1gbit", "0")
    law = all_reduce(cluster, 8, element_bytes=8)
    every_segment = all_reduce(cluster, 2 * 8 * hosts, element_bytes=8)
    counted = [row["loss"]["tx_bytes"] for row in rows]
    print(f"loss on {hosts} hosts: law {law.wire_bytes:,.0f} B, counters {counted}, "
          f"every segment sent {every_segment.wire_bytes:,.0f} B")  # fmt: skip
    # a few hundred bytes a host, ACKs and all: the counters of so small a collective vary
    # (on 2 hosts 119-581 B a host across runs; on 4 hosts a mean of 255 B in one run, 550 in
    # another), so the law is checked as the bound it is
    assert statistics.mean(counted) < 1.2 * law.wire_bytes
    if hosts > 2:
        assert every_segment.wire_bytes > 1.5 * max(counted)


def _check_small_all_reduce(hosts: int, rows: list[dict]) -> None:
    """A 2 kB all-reduce (a PowerSGD factor, a pipeline's step summary): gloo's ring sends it
    in ``2W`` segments, ``4(W-1)`` messages a host, whose framing is most of the bytes.
    Measured, hosts' mean: 3.5 kB on 2 hosts, 7.7 kB on 4, 14.5 kB on 8 (the law 3.6, 7.8
    and 14.6 kB; one message a round would say 2.9, 5.6 and 9.5 kB)."""
    cluster = Cluster.parse(hosts, 1, "1gbit", "0")
    law = all_reduce(cluster, SIZES["small"])
    counted = statistics.mean(row["small"]["tx_bytes"] for row in rows)
    print(f"2 kB all-reduce on {hosts} hosts: law {law.wire_bytes:,.0f} B, mean {counted:,.0f} B")
    # the ACKs of so few packets vary with the load: on 2 hosts 3.39-3.54 kB across runs (the
    # law 3.62 kB, one message a round 2.89 kB)
    assert law.wire_bytes == pytest.approx(counted, rel=0.1)
    # gloo's all-gather: two messages' framing a round each way (2 kB a rank: 2.8, 8.4 and
    # 19.8 kB a host counted; the law 2.8, 8.5 and 19.9 kB, one message a round 2.4, 7.3, 17.1)
    gathered = all_gather(cluster, SIZES["small_gather"])
    counted = statistics.mean(row["small_gather"]["tx_bytes"] for row in rows)
    print(
        f"2 kB all-gather on {hosts} hosts: law {gathered.wire_bytes:,.0f} B, mean {counted:,.0f}"
    )
    assert gathered.wire_bytes == pytest.approx(counted, rel=0.1)


def _check_broadcast_and_send(hosts: int, rows: list[dict]) -> None:
    """The binomial tree's root sends ``⌈log2 W⌉ · N``; a send's sender ``N``."""
    cluster = Cluster.parse(hosts, 1, "1gbit", "0")
    # the binomial tree's root (rank 0) sends the most; a lone send comes from rank 0
    assert max(range(hosts), key=lambda i: rows[i]["broadcast"]["tx_bytes"]) == 0
    _check(broadcast(cluster, SIZES["broadcast"]), rows[0]["broadcast"], f"broadcast, {hosts}")
    _check(send(cluster, SIZES["send"]), rows[0]["send"], f"send on {hosts} hosts")
    # the receiver sends its ACKs and ready notification: about 1/1000 of the payload
    assert rows[1]["send"]["tx_bytes"] < 0.005 * SIZES["send"]


@netns
def test_all_reduce_takes_the_predicted_seconds_at_100mbit():
    # 4 MB on 2 hosts at 100mbit: 2 rounds of 2 MB, 0.3346 s with the framing (0.320 s
    # without). Load on this shared machine only slows a collective: the best of up to three
    # runs (each the median of three) must come within 15%, and none may beat the shaper.
    predicted = all_reduce(Cluster.parse(2, 1, "100mbit", "0"), 4 * MB).seconds
    measured = []
    for _ in range(3):
        rows = _measure(2, {"all_reduce": 4 * MB}, "100mbit", repeats=3)
        measured.append(max(row["all_reduce"]["seconds"] for row in rows))
        print(f"all_reduce 4 MB, 2 hosts, 100mbit: predicted {predicted:.4f} s, {measured}")
        assert measured[-1] > 0.85 * predicted
        if measured[-1] == pytest.approx(predicted, rel=0.15):
            break
    assert min(measured) == pytest.approx(predicted, rel=0.15)
    assert statistics.median(measured) > 0.85 * predicted
