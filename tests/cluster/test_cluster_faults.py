"""Fault injection in the simulated cluster: kill, freeze, link, hang detection, orphans."""

import sys
import textwrap

import pytest

from lightning_parallel.cluster import SimulatedNetwork, netns_unavailable_reason, run_on_hosts
from lightning_parallel.cluster.command import main as cluster_main
from lightning_parallel.cluster.faults import (
    Fault,
    check_faults,
    fault_report,
    parse_fault,
    reported_step,
)

REASON = netns_unavailable_reason()
needs_netns = pytest.mark.skipif(REASON is not None, reason=REASON or "")


def test_parse_fault_reads_the_three_kinds():
    assert parse_fault("kill:1@20") == Fault("kill", 1, 20.0)
    assert parse_fault("freeze:0@2.5") == Fault("freeze", 0, 2.5)
    assert parse_fault("link:3@10s") == Fault("link", 3, 10.0)
    assert str(parse_fault("kill:1@20")) == "kill:1@20"
    assert parse_fault("freeze:1@step30") == Fault("freeze", 1, 0.0, step=30)
    assert str(parse_fault("kill:1@ step 7")) == "kill:1@step7"


def test_a_progress_line_tells_the_step():
    assert reported_step("[progress] rank 1 step 30") == 30
    assert reported_step("[progress] rank 1 step x") is None
    assert reported_step("rank 1 step 30") is None


@pytest.mark.parametrize(
    "text", ["kill:1", "stop:1@2", "kill:-1@2", "kill:a@1", "kill:1@", "kill:1@step2.5"]
)
def test_parse_fault_rejects_malformed_text_naming_the_form(text):
    with pytest.raises(ValueError, match=r"kill:RANK@SECONDS"):
        parse_fault(text)


def test_check_faults_rejects_missing_ranks_and_hosts():
    with pytest.raises(ValueError, match="no rank 4"):
        check_faults([parse_fault("kill:4@1")], hosts=2, world_size=4)
    with pytest.raises(ValueError, match="no host 2"):
        check_faults([parse_fault("link:2@1")], hosts=2, world_size=4)
    with pytest.raises(ValueError, match="already faulted"):
        check_faults([parse_fault("kill:1@1"), parse_fault("freeze:1@2")], hosts=2, world_size=2)
    check_faults([parse_fault("link:1@1"), parse_fault("kill:1@2")], hosts=2, world_size=2)


# every rank prints, then waits for its peer over TCP (rank 0 serves, rank 1 connects); the
# peer that loses the other raises within ~2 s (a dead socket, or no byte for 2 s)
PEERS = textwrap.dedent(
    """
    import os, socket, sys, time
    rank = int(os.environ["RANK"])
    address = (os.environ["MASTER_ADDR"], 29700)
    if rank == 0:
        server = socket.create_server(address)
        connection, _ = server.accept()
    else:
        for _ in range(100):
            try:
                connection = socket.create_connection(address)
                break
            except OSError:
                time.sleep(0.05)
    connection.settimeout(2.0)
    print(f"rank {rank} connected", flush=True)
    for step in range(200):
        print(f"[progress] rank {rank} step {step}", flush=True)
        connection.sendall(b"x")
        if not connection.recv(1):
            sys.exit("RuntimeError: the peer closed the connection")
        time.sleep(0.05)
    """
)


def _run_peers(tmp_path, faults, hang_after=20.0, script=PEERS, hosts=2):
    path = tmp_path / "peers.py"
    path.write_text(script)
    with SimulatedNetwork(hosts, "1gbit", "0") as network:
        return run_on_hosts(
            network,
            [sys.executable, str(path)],
            faults=faults,
            hang_after=hang_after,
            quiet=True,
            timeout=60,
        )


@pytest.mark.parametrize("kind", ["kill", "freeze", "link"])
@pytest.mark.faults
@pytest.mark.netns
@needs_netns
def test_a_fault_ends_the_survivor_and_is_recorded(tmp_path, kind):
    """The fault waits for the target's step 20 (its 21st exchange), however long start-up
    took; the survivor's last line shows it had got that far too."""
    run = _run_peers(tmp_path, [parse_fault(f"{kind}:1@step20")])
    assert run.faults[0].applied_s is not None
    survivor, target = run.ends
    assert survivor.rank == 0 and not survivor.faulted and not survivor.hung
    assert target.faulted is (kind != "link")
    assert survivor.exit_code == 1 and "Error" in survivor.last_line
    after = survivor.after_fault(run.first_fault_s)
    assert after is not None and 0 <= after < 5  # the socket timeout is 2 s
    if kind == "link":  # the cut-off host's process is a survivor too, and it ended
        assert target.exit_code == 1 and not target.hung
    else:
        assert target.exit_code == 128 + 9 or kind == "freeze"
    assert run.orphans == [] and run.returncode == 1
    report = "\n".join(fault_report(run.faults, run.ends, run.orphans))
    assert f"fault {kind}:1@step20" in report and "orphaned processes: 0" in report


@pytest.mark.faults
@pytest.mark.netns
@needs_netns
def test_a_survivor_that_never_ends_counts_as_hung_and_is_killed(tmp_path):
    script = "import time\nprint('up', flush=True)\ntime.sleep(600)\n"
    run = _run_peers(tmp_path, [parse_fault("kill:1@1")], hang_after=2.0, script=script)
    survivor = run.ends[0]
    assert survivor.hung and survivor.rank == 0
    assert run.returncode == 124 and "still running: host 0" in run.message
    assert run.orphans == []


@pytest.mark.faults
@pytest.mark.netns
@needs_netns
def test_a_failure_before_any_fault_ends_the_run_as_without_faults(tmp_path):
    script = "import os, sys, time\nif os.environ['RANK'] == '0': sys.exit(3)\ntime.sleep(60)\n"
    run = _run_peers(tmp_path, [parse_fault("kill:1@30")], script=script)
    assert run.returncode == 3 and run.failed == "host 0"
    assert run.faults[0].applied_s is None  # the run ended first


@pytest.mark.faults
@pytest.mark.netns
@needs_netns
def test_cluster_command_takes_faults_and_prints_the_report(tmp_path, capsys):
    path = tmp_path / "peers.py"
    path.write_text(PEERS)
    code = cluster_main(
        ["--hosts", "2", "--fault", "freeze:1@2", "--hang-after", "20", "--",
         sys.executable, str(path)]
    )  # fmt: skip
    err = capsys.readouterr().err
    assert code == 1
    assert "[faults] fault freeze:1@2: rank 1 frozen (SIGSTOP)" in err
    assert "[faults] rank 0 (host 0): exited with code 1" in err
    assert "[faults] orphaned processes: 0" in err


def test_cluster_command_rejects_a_fault_on_a_missing_rank(capsys):
    assert cluster_main(["--hosts", "2", "--fault", "kill:5@1", "--", "true"]) == 2
    assert "no rank 5" in capsys.readouterr().err
