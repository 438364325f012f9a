"""Run one command per simulated host (or K per host) with the multi-node environment.

:func:`run_on_hosts` starts, for host ``h`` and local rank ``l`` (``K`` processes per host,
``N`` hosts), the command inside ``h``'s namespace with the variables that Lightning and
``torch.distributed`` read:

=====================  ===============================================
``MASTER_ADDR``        host 0's address; ``MASTER_PORT`` a fixed port
``NODE_RANK``          ``h``
``LOCAL_RANK``         ``l``; ``LOCAL_WORLD_SIZE`` = ``K``
``RANK``               ``h·K + l``; ``WORLD_SIZE`` = ``N·K``
``GLOO_SOCKET_IFNAME`` the host's interface (gloo must not pick loopback)
``OMP_NUM_THREADS``    threads per process (default 1: the hosts share the machine's cores)
``LP_CLUSTER_*``       hosts, processes per host, interface, bandwidth, latency
``LP_STRAGGLER``       ``RANK:FACTOR`` when a straggler is asked for
=====================  ===============================================

Output lines are streamed with a ``[host h]`` prefix (``[host h.l]`` with several processes
per host). The first process that exits non-zero ends the run: the others are terminated
(SIGTERM, then SIGKILL after a grace period) and its exit code and last output lines are
returned. :func:`interrupt_on_signals` turns SIGINT/SIGTERM into an exception so that every
``finally`` (process kill, namespace removal) runs.

With ``memory`` (:class:`~lightning_parallel.cluster.memory.MemoryCaps`) every process starts
inside its host's memory cgroup; a process that ends by SIGKILL in a host whose group counts an
OOM kill is reported as that host running out of memory (:class:`OutOfMemory`, in
:attr:`ClusterRun.out_of_memory` and its message), not as a crash.

This module starts the processes; watching them to the end of the run (output, faults,
stopping, the outcome) is :mod:`lightning_parallel.cluster.supervisor`'s.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from collections import deque
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from types import FrameType
from typing import TextIO

from lightning_parallel.cluster.faults import STEPS_VARIABLE, Fault, ProcessEnd, check_faults
from lightning_parallel.cluster.memory import MemoryCaps
from lightning_parallel.cluster.network import Host
from lightning_parallel.cluster.supervisor import (
    ClusterRun,
    Hosts,
    RunningProcess,
    stop_processes,
    stream_output,
    supervise,
)

__all__: list[str] = []

STRAGGLER_ENV = "LP_STRAGGLER"
INTERFACE_ENV = "LP_CLUSTER_INTERFACE"


class ClusterInterrupted(BaseException):
    """SIGINT or SIGTERM arrived while a simulated cluster ran; everything is being cleaned up."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"interrupted by {signal.Signals(signum).name}")
        self.signum = signum


@contextmanager
def interrupt_on_signals() -> Iterator[None]:
    """Raise :class:`ClusterInterrupted` on SIGINT/SIGTERM inside the block (main thread only)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, frame: FrameType | None) -> None:
        raise ClusterInterrupted(signum)

    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


def cluster_environment(
    network: Hosts,
    host: Host,
    local_rank: int,
    procs_per_host: int = 1,
    master_port: int = 29500,
    threads: int = 1,
    straggler: str | None = None,
) -> dict[str, str]:
    """The environment variables of process ``local_rank`` on ``host`` (see the module doc)."""
    env = {
        "MASTER_ADDR": network.hosts[0].address,
        "MASTER_PORT": str(master_port),
        "NODE_RANK": str(host.index),
        "LOCAL_RANK": str(local_rank),
        "LOCAL_WORLD_SIZE": str(procs_per_host),
        "RANK": str(host.index * procs_per_host + local_rank),
        "WORLD_SIZE": str(len(network.hosts) * procs_per_host),
        "GLOO_SOCKET_IFNAME": host.interface,
        "OMP_NUM_THREADS": str(threads),
        "MKL_NUM_THREADS": str(threads),
        "PYTHONUNBUFFERED": "1",
        # the interface whose counter is the host's traffic: none on loopback, which all share
        INTERFACE_ENV: host.interface if network.shaped else "",
        "LP_CLUSTER_HOSTS": str(len(network.hosts)),
        "LP_CLUSTER_PROCS_PER_HOST": str(procs_per_host),
        "LP_CLUSTER_BANDWIDTH": network.bandwidth,
        "LP_CLUSTER_LATENCY": network.latency,
        "LP_CLUSTER_LATENCY_EMULATED": "1" if network.latency_emulated else "0",
    }
    if straggler:
        env[STRAGGLER_ENV] = straggler
    return env


def run_on_hosts(
    network: Hosts,
    command: Sequence[str],
    procs_per_host: int = 1,
    extra_env: Mapping[str, str] | None = None,
    master_port: int = 29500,
    threads: int = 1,
    straggler: str | None = None,
    timeout: float | None = None,
    output: TextIO | None = None,
    quiet: bool = False,
    tail_lines: int = 40,
    grace: float = 5.0,
    faults: Sequence[Fault] = (),
    hang_after: float | None = None,
    memory: MemoryCaps | None = None,
) -> ClusterRun:
    """Run ``command`` once per process slot of every host and wait for all of them.

    Args:
        network: a created :class:`SimulatedNetwork`, or :class:`LocalHosts` (loopback).
        command: argv of the command each process runs.
        procs_per_host: processes per host (``LOCAL_RANK`` 0..K-1).
        extra_env: more environment variables for every process.
        master_port: ``MASTER_PORT`` (any port: each host has a namespace of its own).
        threads: ``OMP_NUM_THREADS``/``MKL_NUM_THREADS`` of each process.
        straggler: ``"RANK:FACTOR"`` exported as ``LP_STRAGGLER`` for the straggler callback.
        timeout: seconds after which every process is killed (exit code 124).
        output: where the prefixed output lines go (default: ``sys.stdout`` at call time).
        quiet: do not stream the output, only keep the tails.
        tail_lines: lines of output kept per process for the failure report.
        grace: seconds between SIGTERM and SIGKILL when stopping the other processes.
        faults: faults to inject (:mod:`lightning_parallel.cluster.faults`); with faults the run
            waits for every survivor to end by itself instead of stopping at the first failure.
        hang_after: with faults, a survivor still running that has printed nothing for this
            many seconds since the first fault counts as hung, and the run is ended (default:
            ``timeout``'s deadline only).
        memory: created memory caps of ``network``'s hosts: each process starts inside its
            host's group, and a process killed for want of memory is reported as such.

    Returns:
        A :class:`ClusterRun`; it never hangs on a dead host.
    """
    if not command:
        raise ValueError("command is empty; give the program to run on every host")
    if procs_per_host < 1:
        raise ValueError(f"procs_per_host must be >= 1, got {procs_per_host}")
    check_faults(faults, len(network.hosts), len(network.hosts) * procs_per_host)
    lock = threading.Lock()
    sink = None if quiet else (output if output is not None else sys.stdout)
    processes: list[RunningProcess] = []
    faulted = {f.target for f in faults if not f.targets_host}
    steps = sorted({f.step for f in faults if f.step is not None})
    try:
        for host in network.hosts:
            for local_rank in range(procs_per_host):
                env = dict(os.environ)
                if steps:
                    env[STEPS_VARIABLE] = ",".join(str(step) for step in steps)
                env.update(extra_env or {})
                env.update(
                    cluster_environment(
                        network, host, local_rank, procs_per_host, master_port, threads, straggler
                    )
                )
                label = f"host {host.index}" + (f".{local_rank}" if procs_per_host > 1 else "")
                rank = host.index * procs_per_host + local_rank
                argv = network.exec_argv(host, list(command))
                if memory is not None:
                    argv = memory.join_argv(host.index, argv)
                popen = subprocess.Popen(
                    argv,
                    env=env,
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,  # its own process group: killed as a whole
                )
                end = ProcessEnd(label, rank, host.index, faulted=rank in faulted)
                process = RunningProcess(label, popen, deque(maxlen=tail_lines), end)
                process.reader = threading.Thread(
                    target=stream_output, args=(process, sink, lock), daemon=True
                )
                process.reader.start()
                processes.append(process)
        return supervise(network, processes, faults, timeout, hang_after, grace, memory)
    finally:
        stop_processes(processes, grace)
