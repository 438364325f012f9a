"""A shaped link moves a gloo allreduce at its configured rate (within 15%).

The rate is never above the configured one; where it falls short, the check allows for the
machine's own allreduce cost, measured in the same test (see the test's comments).
"""

import io
import json
import sys

import pytest

from lightning_parallel.cluster import (
    SimulatedNetwork,
    netns_unavailable_reason,
    parse_bandwidth,
    run_on_hosts,
)

REASON = netns_unavailable_reason()
pytestmark = [pytest.mark.netns, pytest.mark.skipif(REASON is not None, reason=REASON or "")]

# Each host allreduces a 25 MB tensor `iterations` times and reports the bytes its interface
# sent (kernel counter) and the time the allreduces took.
_PROBE = """
import json, os, sys, time
import torch, torch.distributed as dist
torch.set_num_threads(1)
dist.init_process_group("gloo")
megabytes, iterations = float(sys.argv[1]), int(sys.argv[2])
counter = f"/sys/class/net/{os.environ['GLOO_SOCKET_IFNAME']}/statistics/tx_bytes"
tensor = torch.ones(int(megabytes * 1e6) // 4)
dist.all_reduce(tensor.clone())  # connections up, pages touched
dist.barrier()
before, start = int(open(counter).read()), time.perf_counter()
for _ in range(iterations):
    dist.all_reduce(tensor)
seconds, sent = time.perf_counter() - start, int(open(counter).read()) - before
print(json.dumps({"sent": sent, "seconds": seconds}), flush=True)
dist.destroy_process_group()
"""


def _measure(bandwidth: str, iterations: int) -> list[dict[str, float]]:
    output = io.StringIO()
    with SimulatedNetwork(2, bandwidth, "0") as network:
        result = run_on_hosts(
            network,
            [sys.executable, "-c", _PROBE, "25", str(iterations)],
            output=output,
            timeout=120,
        )
        assert result.returncode == 0, result.tail
        wire = [network.tx_bytes(host) for host in network.hosts]
    rows = [json.loads(line.split("] ", 1)[1]) for line in output.getvalue().splitlines()
            if "] {" in line]  # fmt: skip
    assert len(rows) == 2 and all(w > 0 for w in wire)
    return rows


def _cpu_times() -> tuple[int, int]:
    """(steal, total) jiffies of all CPUs since boot, from /proc/stat (zeros where absent)."""
    try:
        with open("/proc/stat") as stat:
            fields = [int(value) for value in stat.readline().split()[1:]]
    except (OSError, ValueError):
        return 0, 0
    # user nice system idle iowait irq softirq steal guest guest_nice; guests are in user
    return (fields[7] if len(fields) > 7 else 0), sum(fields[:8])


def _rate(row: dict[str, float]) -> float:
    return 8 * row["sent"] / row["seconds"]


@pytest.mark.parametrize(("bandwidth", "iterations"), [("100mbit", 2), ("1gbit", 6)])
def test_allreduce_moves_at_the_configured_rate(bandwidth, iterations):
    configured = parse_bandwidth(bandwidth)
    # CPU contention from other processes can only slow a transfer below the shaped rate, never
    # speed it above: the best of up to five attempts measures the link, not the machine's load
    # (a loaded run once measured 82 Mbit/s at 100 Mbit/s as its best of three 2 s transfers)
    best: list[dict[str, float]] = []
    steal_start, total_start = _cpu_times()
    for _ in range(5):
        rows = _measure(bandwidth, iterations)
        for row in rows:
            # ring allreduce on 2 ranks: each rank sends the whole 25 MB once per allreduce
            assert row["sent"] >= 0.95 * 25e6 * iterations
            # the shaper caps the rate whatever the machine does
            assert _rate(row) <= 1.15 * configured, f"{bandwidth}: {_rate(row) / 1e6:.1f} Mbit/s"
        if not best or min(map(_rate, rows)) > min(map(_rate, best)):
            best = rows
        if all(_rate(row) == pytest.approx(configured, rel=0.15) for row in rows):
            return
    # Still short: on a loaded machine gloo's own work (copies, the reduction) is part of every
    # allreduce. Measure the machine's rate on a link ten times faster; even if all of that work
    # were serial with the transfer, a link at the configured rate gives
    # 1 / (1/configured + 1/machine). Below 80% of that, the shaper is at fault: the token
    # bucket's 2 ms burst also loses rate when the machine delays its timer, which no
    # measurement here isolates (a run with M = 3.6 Gbit/s gave 82 Mbit/s at 100 Mbit/s, 84%).
    machine = min(map(_rate, _measure("10gbit", iterations)))
    floor = 1.0 / (1.0 / configured + 1.0 / machine)
    # A virtual machine whose hypervisor takes CPU time away delays the shaper's timer and
    # gloo alike (measured: 45% steal, 50 Mbit/s at 100 Mbit/s): the bound shrinks by the share
    # of CPU time stolen during the test (/proc/stat), and is the same as above without steal.
    steal_end, total_end = _cpu_times()
    steal = (steal_end - steal_start) / max(1, total_end - total_start)
    floor *= 0.80 * (1.0 - steal)
    for row in best:
        assert _rate(row) >= floor, (
            f"{bandwidth}: measured {_rate(row) / 1e6:.1f} Mbit/s; this machine's allreduce "
            f"alone moves {machine / 1e6:.0f} Mbit/s and {steal:.0%} of its CPU time was "
            f"stolen, so the link should give at least {floor / 1e6:.0f}"
        )
