import signal
import subprocess
import sys
import textwrap
import warnings

import pytest

from lightning_parallel.cluster import (
    SimulatedNetwork,
    leftovers,
    netns_unavailable_reason,
    remove_stale,
)

REASON = netns_unavailable_reason()
pytestmark = [pytest.mark.netns, pytest.mark.skipif(REASON is not None, reason=REASON or "")]


def _in_host(network, host, code):
    argv = network.exec_argv(host, [sys.executable, "-c", textwrap.dedent(code)])
    return subprocess.run(argv, capture_output=True, text=True, timeout=30)


def test_hosts_reach_each_other_and_everything_is_removed_after():
    with SimulatedNetwork(3, "100mbit", "0") as network:
        names = leftovers(network.prefix)
        assert len([n for n in names if n.endswith(("h0", "h1", "h2"))]) == 3
        assert network.bridge in names
        server, client = network.hosts[0], network.hosts[2]
        listener = subprocess.Popen(
            network.exec_argv(
                server,
                [sys.executable, "-c",
                 "import socket; s=socket.socket(); s.bind(('0.0.0.0', 5055)); s.listen(1);"
                 "print('ready', flush=True); c,_=s.accept(); c.sendall(c.recv(5))"],
            ),
            stdout=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        assert listener.stdout is not None and listener.stdout.readline().strip() == "ready"
        reply = _in_host(
            network,
            client,
            f"""
            import socket
            s = socket.create_connection(("{server.address}", 5055), timeout=10)
            s.sendall(b"hello"); print(s.recv(5).decode())
            """,
        )
        listener.wait(timeout=10)
        assert reply.stdout.strip() == "hello", reply.stderr
        loopback = _in_host(
            network,
            server,
            """
            import socket
            s = socket.socket(); s.bind(("127.0.0.1", 0)); s.listen(1)
            socket.create_connection(s.getsockname(), timeout=5); print("lo up")
            """,
        )
        assert loopback.stdout.strip() == "lo up", loopback.stderr
        assert network.tx_bytes(client) > 0
    assert leftovers(network.prefix) == []


def test_failed_setup_removes_what_it_created(monkeypatch):
    network = SimulatedNetwork(2, "100mbit")
    original = network._shape

    def broken(host):
        if host.index == 1:
            raise RuntimeError("shaping failed")
        original(host)

    monkeypatch.setattr(network, "_shape", broken)
    with pytest.raises(RuntimeError, match="shaping failed"):
        network.create()
    assert leftovers(network.prefix) == []


def test_stale_namespaces_of_a_killed_run_are_removed():
    script = textwrap.dedent(
        """
        import os, sys, time
        from lightning_parallel.cluster import SimulatedNetwork
        network = SimulatedNetwork(2, "1gbit").create()
        print(network.prefix, flush=True)
        time.sleep(60)
        """
    )
    owner = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    assert owner.stdout is not None
    prefix = owner.stdout.readline().strip()
    assert len(leftovers(prefix)) == 5  # 2 namespaces, 2 bridge ports, 1 bridge
    owner.send_signal(signal.SIGKILL)  # no cleanup can run
    owner.wait()
    assert leftovers(prefix), "the killed run left nothing behind to clean"
    removed = remove_stale()
    assert set(leftovers(prefix)) == set()
    assert any(name.startswith(prefix) for name in removed)


def test_live_runs_are_not_stale():
    with SimulatedNetwork(2, "1gbit") as network:
        remove_stale()
        assert len(leftovers(network.prefix)) == 5


def test_latency_is_emulated_or_reported_as_not_emulated():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        network = SimulatedNetwork(2, "1gbit", "20ms").create()
    try:
        if not network.latency_emulated:  # kernel without sch_netem: said loudly, not hidden
            assert "NOT emulated" in network.notes[0] and "netem" in network.notes[0]
            assert any("NOT emulated" in str(w.message) for w in caught)
            return
        server, client = network.hosts
        listener = subprocess.Popen(
            network.exec_argv(
                server,
                [sys.executable, "-c",
                 "import socket; s=socket.socket(); s.bind(('0.0.0.0', 5056)); s.listen(1);"
                 "print('ready', flush=True); s.accept()"],
            ),
            stdout=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        assert listener.stdout is not None and listener.stdout.readline()
        connect = _in_host(
            network,
            client,
            f"""
            import socket, time
            start = time.perf_counter()
            socket.create_connection(("{server.address}", 5056), timeout=10)
            print(time.perf_counter() - start)
            """,
        )
        listener.wait(timeout=10)
        assert float(connect.stdout) >= 2 * 0.020 * 0.9  # SYN and SYN-ACK each delayed 20 ms
    finally:
        network.destroy()
