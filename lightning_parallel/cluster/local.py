"""N "hosts" that are plain processes of this machine, talking over loopback: no namespaces, no
shaping, no root.

:class:`LocalHosts` stands where :class:`~lightning_parallel.cluster.SimulatedNetwork` stands
for :func:`~lightning_parallel.cluster.run_on_hosts` and the bench (``--network local``). Each
host's processes get the same multi-node environment (``NODE_RANK``, ``LOCAL_RANK``, ...), with
``MASTER_ADDR=127.0.0.1`` and ``lo`` for gloo's interface. The links are whatever loopback
gives (no bandwidth or latency is imposed), so a run measures compute and the strategies' own
overheads, not a network. It is for machines where namespaces or ``tc`` are missing (a GPU
image without iproute2, a container without ``CAP_NET_ADMIN``) and for timing compute alone.

Limits against the simulated network: no link faults (``link:HOST``; a process kill or freeze
works), no per-host traffic counter (loopback carries every host's traffic), and the master
port must be free on this machine (:func:`free_port` picks one).
"""

from __future__ import annotations

import itertools
import os
import socket

from lightning_parallel.cluster.network import ClusterError, Host

__all__: list[str] = []

_RUNS = itertools.count()
UNSHAPED = "unshaped"


def free_port() -> int:
    """A TCP port that nothing listens on now (the kernel's choice)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


class LocalHosts:
    """``hosts`` hosts on this machine's loopback; the interface of a simulated network. There
    is nothing to create or remove, so unlike a simulated network it needs no ``with`` block.

    Example::

        run_on_hosts(LocalHosts(2), ["python", "train.py"], master_port=free_port())
    """

    shaped = False  # no link shaping and no per-host traffic counter
    bandwidth = UNSHAPED
    latency = "0"
    latency_emulated = True  # no latency is asked for, so none is missing

    def __init__(self, hosts: int) -> None:
        if hosts < 1:
            raise ValueError(f"hosts must be >= 1, got {hosts}")
        self.prefix = f"lp{os.getpid():x}l{next(_RUNS) % 256:x}"
        self.hosts = [
            Host(index=i, namespace="", interface="lo", address="127.0.0.1", bridge_port="")
            for i in range(hosts)
        ]
        self.notes: list[str] = []

    def exec_argv(self, host: Host, argv: list[str]) -> list[str]:
        """``argv`` itself: every host is this machine."""
        return list(argv)

    def set_link(self, host: Host, up: bool) -> None:
        """Refused: loopback has no per-host link to cut."""
        raise ClusterError(
            "a link fault needs the simulated network (--network netns): loopback hosts share "
            "one link"
        )

    def pids(self, host: Host) -> list[int]:
        """None: the processes of loopback hosts are not told apart from the machine's."""
        return []
