"""Hosts with a memory size, on this machine's real cgroups: the cap holds, OOM is reported.

Each test builds a simulated cluster whose hosts get a memory cgroup (v1 or v2, whichever this
machine has: ``detect_hierarchy``). A process that allocates past its host's size is killed by
the kernel, and the run says which host ran out of memory and its size.
"""

import io
import subprocess
import sys
import time

import pytest

from lightning_parallel.cluster import (
    MemoryCaps,
    SimulatedNetwork,
    detect_hierarchy,
    memory_unavailable_reason,
    netns_unavailable_reason,
    run_on_hosts,
)
from lightning_parallel.cluster.command import main as cluster_main

REASON = netns_unavailable_reason() or memory_unavailable_reason()
pytestmark = [pytest.mark.netns, pytest.mark.skipif(REASON is not None, reason=REASON or "")]

MiB = 2**20
# rank 1 writes SIZE MiB (bytes multiplication touches every page), then everyone sleeps a bit
_ALLOCATE = (
    "import os, sys, time\n"
    "if os.environ['RANK'] == '1':\n"
    "    block = b'x' * (int(sys.argv[1]) << 20)\n"
    "    print('allocated', len(block) >> 20, 'MiB', flush=True)\n"
    "time.sleep(float(sys.argv[2]))\n"
)


def _limit_file(group):
    name = "memory.max" if detect_hierarchy().version == 2 else "memory.limit_in_bytes"
    return int((group / name).read_text())


def test_a_host_over_its_memory_size_is_oom_killed_and_reported():
    # the allocating python is a child of a shell (which reports its death as exit code 137):
    # the cap covers a host's children too
    child = f'{sys.executable} -c "$0" 400 30; exit $?'
    with (
        SimulatedNetwork(2, "1gbit") as network,
        MemoryCaps(network.prefix, 2, 100 * MiB) as caps,
    ):
        start = time.monotonic()
        result = run_on_hosts(
            network, ["sh", "-c", child, _ALLOCATE], quiet=True, grace=1.0, memory=caps
        )
        groups = [caps.group(0), caps.group(1)]
        assert all(group.is_dir() for group in groups)
    assert time.monotonic() - start < 20, "host 0 was not stopped after host 1 died"
    assert result.returncode == 128 + 9 and result.failed == "host 1"
    (oom,) = result.out_of_memory
    assert (oom.host, oom.rank, oom.limit_bytes) == (1, 1, 100 * MiB) and oom.kills >= 1
    assert result.message.startswith(
        "host 1 ran out of memory: its 100 MiB cap (--memory-per-host) was reached and the "
        "kernel killed rank 1"
    )
    assert [end.out_of_memory for end in result.ends] == [False, True]
    assert not any("allocated" in line for line in result.tail)
    assert not any(group.exists() for group in groups) and caps.leftovers() == []


def test_a_host_under_its_memory_size_runs_inside_its_group():
    # each host's shell starts a child (grep) that shows its memory cgroup; rank 1 allocates
    # 40 MiB under a 200 MiB cap
    pattern = ":memory:" if detect_hierarchy().version == 1 else "^0::"
    script = f"grep -E '{pattern}' /proc/self/cgroup; exec {sys.executable} -c \"$0\" 40 0"
    with (
        SimulatedNetwork(2, "1gbit") as network,
        MemoryCaps(network.prefix, 2, 200 * MiB) as caps,
    ):
        output = io.StringIO()
        result = run_on_hosts(network, ["sh", "-c", script, _ALLOCATE], output=output, memory=caps)
        lines = output.getvalue().splitlines()
        limits = [_limit_file(caps.group(host)) for host in (0, 1)]
        prefix = network.prefix
    assert result.returncode == 0, result.message
    assert result.out_of_memory == []
    assert limits == [200 * MiB, 200 * MiB]
    assert "[host 1] allocated 40 MiB" in lines
    for host in (0, 1):
        (membership,) = [
            line for line in lines if line.startswith(f"[host {host}] ") and ":" in line
        ]
        assert membership.endswith(f"/{prefix}/h{host}"), membership
    assert caps.leftovers() == []


def test_the_groups_are_removed_after_an_exception_with_their_processes():
    with (
        pytest.raises(RuntimeError, match="boom"),
        SimulatedNetwork(1, "1gbit") as network,
        MemoryCaps(network.prefix, 1, 100 * MiB) as caps,
    ):
        host = network.hosts[0]
        # a daemon that left the launcher's process group still sits in the host's group
        sleeper = subprocess.Popen(
            caps.join_argv(0, network.exec_argv(host, ["sleep", "60"])), start_new_session=True
        )
        deadline = time.monotonic() + 10
        while sleeper.pid not in caps.hierarchy.procs(caps.group(0)):
            assert time.monotonic() < deadline, "the process never joined its group"
            time.sleep(0.05)
        group = caps.group(0)
        raise RuntimeError("boom")
    assert sleeper.wait(timeout=10) == -9
    assert not group.exists() and not group.parent.exists()


def test_cli_reports_the_host_that_ran_out_of_memory(capsys):
    code = cluster_main(
        ["--hosts", "2", "--memory-per-host", "100MB", "--",
         sys.executable, "-c", _ALLOCATE, "400", "30"]
    )  # fmt: skip
    assert code == 128 + 9
    err = capsys.readouterr().err
    assert (
        "error: host 1 ran out of memory: its 100 MB cap (--memory-per-host) was reached and the "
        "kernel killed rank 1" in err
    )
