import io
import json
import signal
import subprocess
import sys
import time

import pytest

from lightning_parallel.cluster import (
    SimulatedNetwork,
    leftovers,
    netns_unavailable_reason,
    run_on_hosts,
)
from lightning_parallel.cluster.command import main as cluster_main

REASON = netns_unavailable_reason()
pytestmark = [pytest.mark.netns, pytest.mark.skipif(REASON is not None, reason=REASON or "")]

_KEYS = [
    "MASTER_ADDR",
    "MASTER_PORT",
    "NODE_RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "RANK",
    "LOCAL_WORLD_SIZE",
    "GLOO_SOCKET_IFNAME",
    "OMP_NUM_THREADS",
    "LP_STRAGGLER",
]
_PRINT_ENV = f"import json, os; print(json.dumps({{k: os.environ.get(k) for k in {_KEYS!r}}}))"


def _json_lines(text):
    rows = {}
    for line in text.splitlines():
        label, _, payload = line.partition("] ")
        if payload.startswith("{"):
            rows[label.lstrip("[")] = json.loads(payload)
    return rows


def test_every_process_gets_the_multi_node_environment():
    output = io.StringIO()
    with SimulatedNetwork(2, "1gbit") as network:
        result = run_on_hosts(
            network,
            [sys.executable, "-c", _PRINT_ENV],
            procs_per_host=2,
            straggler="3:2",
            output=output,
        )
        host0 = network.hosts[0].address
        interfaces = [h.interface for h in network.hosts]
    assert result.returncode == 0
    rows = _json_lines(output.getvalue())
    assert sorted(rows) == ["host 0.0", "host 0.1", "host 1.0", "host 1.1"]
    for label, env in rows.items():
        node, local = (int(x) for x in label.split()[1].split("."))
        assert env["MASTER_ADDR"] == host0
        assert env["NODE_RANK"] == str(node) and env["LOCAL_RANK"] == str(local)
        assert env["RANK"] == str(2 * node + local)
        assert env["WORLD_SIZE"] == "4" and env["LOCAL_WORLD_SIZE"] == "2"
        assert env["GLOO_SOCKET_IFNAME"] == interfaces[node]
        assert env["OMP_NUM_THREADS"] == "1"
        assert env["LP_STRAGGLER"] == "3:2"


def test_a_crashed_host_ends_the_run_with_its_exit_code_and_output():
    script = (
        "import os, sys, time\n"
        "if os.environ['NODE_RANK'] == '1':\n"
        "    print('host one gives up', flush=True); sys.exit(7)\n"
        "time.sleep(120)\n"
    )
    start = time.monotonic()
    with SimulatedNetwork(3, "1gbit") as network:
        result = run_on_hosts(network, [sys.executable, "-c", script], quiet=True, grace=1.0)
        prefix = network.prefix
    assert time.monotonic() - start < 30, "the others were not stopped"
    assert result.returncode == 7
    assert result.failed == "host 1"
    assert "host one gives up" in result.tail
    assert leftovers(prefix) == []


def test_a_host_killed_by_a_signal_reports_128_plus_signal():
    script = "import os, signal, time\nif os.environ['RANK'] == '0': os.kill(os.getpid(), 9)\ntime.sleep(60)"
    with SimulatedNetwork(2, "1gbit") as network:
        result = run_on_hosts(network, [sys.executable, "-c", script], quiet=True, grace=1.0)
    assert result.returncode == 128 + 9 and result.failed == "host 0"


def test_timeout_kills_every_host():
    with SimulatedNetwork(2, "1gbit") as network:
        result = run_on_hosts(network, ["sleep", "60"], quiet=True, timeout=1.0, grace=0.5)
    assert result.returncode == 124 and "timed out" in result.message


def test_cli_runs_a_command_and_reports_failure(capsys):
    assert cluster_main(["--hosts", "2", "--", "sh", "-c", "echo from $NODE_RANK"]) == 0
    out = capsys.readouterr().out
    assert "[host 0] from 0" in out and "[host 1] from 1" in out
    assert cluster_main(["--hosts", "2", "--", "sh", "-c", "exit $((3 + NODE_RANK))"]) in (3, 4)
    assert "exited with code" in capsys.readouterr().err


def test_cli_rejects_bad_arguments_with_the_fix(capsys):
    assert cluster_main(["--hosts", "2", "sleep", "1"]) == 2
    assert "after `--`" in capsys.readouterr().err
    assert cluster_main(["--bandwidth", "fast", "--", "true"]) == 2
    assert "bandwidth" in capsys.readouterr().err
    assert cluster_main(["--hosts", "2", "--straggler", "5:2", "--", "true"]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_sigterm_to_the_cluster_command_stops_hosts_and_removes_namespaces():
    command = [
        sys.executable, "-m", "lightning_parallel.cluster.command", "--hosts", "2", "--",
        "sh", "-c", "echo started; sleep 120",
    ]  # fmt: skip
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    seen = 0
    deadline = time.monotonic() + 60
    while seen < 2 and time.monotonic() < deadline:
        if "started" in proc.stdout.readline():
            seen += 1
    assert seen == 2
    prefix = f"lp{proc.pid:x}r"
    assert any(name.startswith(prefix) for name in leftovers())
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 128 + signal.SIGTERM
    assert not any(name.startswith(prefix) for name in leftovers())
    assert "removed" in proc.stderr.read()
