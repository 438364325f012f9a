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
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from types import FrameType
from typing import IO, TextIO

from lightning_parallel.cluster.faults import (
    STEPS_VARIABLE,
    AppliedFault,
    Fault,
    ProcessEnd,
    check_faults,
    reported_step,
)
from lightning_parallel.cluster.local import LocalHosts
from lightning_parallel.cluster.memory import MemoryCaps, OutOfMemory
from lightning_parallel.cluster.network import Host, SimulatedNetwork

__all__: list[str] = []

Hosts = SimulatedNetwork | LocalHosts  # where the processes run: namespaces, or loopback
STRAGGLER_ENV = "LP_STRAGGLER"
INTERFACE_ENV = "LP_CLUSTER_INTERFACE"
TIMEOUT_EXIT_CODE = 124


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


@dataclass
class _Process:
    label: str
    popen: subprocess.Popen[bytes]
    tail: deque[str]
    end: ProcessEnd
    reader: threading.Thread | None = None
    last_output: float = field(default_factory=time.monotonic)  # when it last printed a line
    out_of_memory: OutOfMemory | None = None
    step: int = -1  # the latest training step it reported (``[progress] rank R step N``)


@dataclass
class ClusterRun:
    """How a run on the simulated cluster ended.

    Attributes:
        returncode: 0 when every process succeeded; else the failing process's exit code
            (``128 + signal`` when it was killed by a signal, 124 on timeout).
        failed: label of the process that ended the run (``"host 1"``), if any.
        tail: last output lines of that process (or of all processes on timeout).
        message: one line describing the outcome.
        ends: how each process ended, in rank order (exit code, seconds from the start).
        faults: the faults asked for and when each was applied.
        orphans: processes left in the hosts' namespaces once every started process had ended.
        out_of_memory: processes the kernel killed because their host reached its memory size
            (``memory`` given to :func:`run_on_hosts`); the first one is in ``message``.
    """

    returncode: int
    failed: str | None = None
    tail: list[str] = field(default_factory=list)
    message: str = "all hosts finished"
    ends: list[ProcessEnd] = field(default_factory=list)
    faults: list[AppliedFault] = field(default_factory=list)
    orphans: list[int] = field(default_factory=list)
    out_of_memory: list[OutOfMemory] = field(default_factory=list)

    @property
    def first_fault_s(self) -> float | None:
        """Seconds from the start to the first applied fault (``None``: none applied)."""
        applied = [f.applied_s for f in self.faults if f.applied_s is not None]
        return min(applied) if applied else None

    @property
    def hung(self) -> list[ProcessEnd]:
        return [end for end in self.ends if end.hung]


def _stream(process: _Process, output: IO[str] | None, lock: threading.Lock) -> None:
    assert process.popen.stdout is not None
    for raw in iter(process.popen.stdout.readline, b""):
        line = raw.decode("utf-8", errors="replace").rstrip("\n")
        process.last_output = time.monotonic()
        process.tail.append(line)
        if line.strip():
            process.end.last_line = line.strip()
            step = reported_step(line)
            if step is not None:
                process.step = max(process.step, step)
        if output is not None:
            with lock:
                output.write(f"[{process.label}] {line}\n")
                output.flush()


def _exit_code(returncode: int) -> int:
    return 128 - returncode if returncode < 0 else returncode


def _signal_group(process: _Process, sig: int) -> None:
    if process.popen.poll() is None:
        with suppress(ProcessLookupError, PermissionError):
            os.killpg(process.popen.pid, sig)


def _stop(processes: list[_Process], grace: float) -> None:
    for process in processes:
        _signal_group(process, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and any(p.popen.poll() is None for p in processes):
        time.sleep(0.05)
    for process in processes:
        _signal_group(process, signal.SIGKILL)
        with suppress(subprocess.TimeoutExpired):
            process.popen.wait(timeout=5)
        if process.reader is not None:
            process.reader.join(timeout=2)


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
    processes: list[_Process] = []
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
                process = _Process(label, popen, deque(maxlen=tail_lines), end)
                process.reader = threading.Thread(
                    target=_stream, args=(process, sink, lock), daemon=True
                )
                process.reader.start()
                processes.append(process)
        if not faults:
            return _wait(processes, timeout, grace, memory)
        run = _FaultyRun(network, processes, faults, timeout, hang_after, grace, memory).wait()
        run.orphans = _orphans(network, processes)
        return run
    finally:
        _stop(processes, grace)


def _orphans(network: Hosts, processes: list[_Process]) -> list[int]:
    """Processes left in the namespaces once every started process ended (none expected)."""
    _stop(processes, grace=0.0)  # faulted (frozen) processes are killed first
    started = {p.popen.pid for p in processes}
    return [pid for host in network.hosts for pid in network.pids(host) if pid not in started]


def _record_exit(
    process: _Process, code: int, now: float, memory: MemoryCaps | None
) -> OutOfMemory | None:
    """Record how ``process`` ended; its :class:`OutOfMemory` if its host's cap killed it."""
    if process.end.exit_code is None:
        process.end.exit_code = _exit_code(code)
        process.end.end_s = now
        if memory is not None:
            end = process.end
            process.out_of_memory = memory.out_of_memory(
                end.host, end.rank, end.label, _exit_code(code)
            )
            end.out_of_memory = process.out_of_memory is not None
    return process.out_of_memory


class _FaultyRun:
    """Apply the faults on time; wait for the survivors to end by themselves (see faults.py)."""

    def __init__(
        self,
        network: Hosts,
        processes: list[_Process],
        faults: Sequence[Fault],
        timeout: float | None,
        hang_after: float | None,
        grace: float,
        memory: MemoryCaps | None = None,
    ) -> None:
        self.network = network
        self.memory = memory
        self.processes = processes
        self.pending = [AppliedFault(fault) for fault in faults]
        self.applied: list[AppliedFault] = []
        self.timeout = timeout
        self.hang_after = hang_after
        self.grace = grace
        self.start = time.monotonic()

    def _apply(self, applied: AppliedFault, now: float) -> None:
        fault = applied.fault
        applied.applied_s = now
        if fault.kind == "link":
            self.network.set_link(self.network.hosts[fault.target], up=False)
            return
        process = next(p for p in self.processes if p.end.rank == fault.target)
        if process.popen.poll() is not None:
            applied.note = "the process had already exited"
            return
        _signal_group(process, signal.SIGKILL if fault.kind == "kill" else signal.SIGSTOP)

    def _due(self, fault: Fault, now: float) -> bool:
        """Its second has come, or its target reported the step (``link``: the host's first
        process)."""
        if fault.step is None:
            return fault.at <= now
        if fault.targets_host:
            target = next(p for p in self.processes if p.end.host == fault.target)
        else:
            target = next(p for p in self.processes if p.end.rank == fault.target)
        return target.step >= fault.step

    def wait(self) -> ClusterRun:
        while True:
            now = time.monotonic() - self.start
            for applied in [f for f in self.pending if self._due(f.fault, now)]:
                self.pending.remove(applied)
                self._apply(applied, now)
                self.applied.append(applied)
            for process in self.processes:
                code = process.popen.poll()
                if code is not None:
                    _record_exit(process, code, now, self.memory)
            survivors = [p for p in self.processes if not p.end.faulted]
            failed_early = [
                p for p in survivors if p.end.exit_code not in (None, 0) and not self.applied
            ]
            if failed_early:  # a genuine failure before any fault: as without faults
                return self._finish(failed_early[0].label, "failed before any fault")
            if all(p.end.exit_code is not None for p in survivors):
                return self._finish(None, "")
            first = self.applied[0].applied_s if self.applied else None
            if self.hang_after is not None and first is not None and now - first > self.hang_after:
                silent = [
                    process
                    for process in survivors
                    if process.end.exit_code is None
                    and time.monotonic() - process.last_output > self.hang_after
                ]
                if silent:
                    for process in silent:
                        process.end.hung = True
                    return self._finish(None, f"silent {self.hang_after:g} s after the fault: hung")
            if self.timeout is not None and now > self.timeout:
                for process in survivors:
                    process.end.hung = process.end.exit_code is None
                return self._finish(None, f"timed out after {self.timeout:g} s")
            time.sleep(0.02)

    def _finish(self, failed: str | None, reason: str) -> ClusterRun:
        for process in self.processes:
            if process.end.faulted:  # a frozen process ignores SIGTERM: no grace for it
                _signal_group(process, signal.SIGKILL)
        _stop(self.processes, self.grace)
        for process in self.processes:
            if process.reader is not None:
                process.reader.join(timeout=2)
        survivors = [p.end for p in self.processes if not p.end.faulted]
        hung = [end for end in survivors if end.hung]
        bad = [end for end in survivors if end.exit_code not in (0, None)]
        if hung:
            code, failed = TIMEOUT_EXIT_CODE, hung[0].label
            message = f"{reason}; still running: {', '.join(end.label for end in hung)}"
        elif bad:
            code, failed = bad[0].exit_code or 1, failed or bad[0].label
            message = reason or f"{len(bad)} of {len(survivors)} surviving processes failed"
        else:
            code, message = 0, "every surviving process finished"
        out_of_memory = [p.out_of_memory for p in self.processes if p.out_of_memory is not None]
        if out_of_memory and code != 0:
            message = f"{out_of_memory[0].describe()}; {message}"
        tail = [f"[{p.label}] {line}" for p in self.processes for line in list(p.tail)[-3:] if line]
        return ClusterRun(
            code,
            failed,
            tail,
            message,
            ends=[p.end for p in self.processes],
            faults=self.applied + self.pending,
            out_of_memory=out_of_memory,
        )


def _wait(
    processes: list[_Process], timeout: float | None, grace: float, memory: MemoryCaps | None
) -> ClusterRun:
    start = time.monotonic()
    deadline = None if timeout is None else start + timeout
    while True:
        for process in processes:
            code = process.popen.poll()
            out_of_memory = None
            if code is not None:
                out_of_memory = _record_exit(process, code, time.monotonic() - start, memory)
            if code is not None and code != 0:
                _stop([p for p in processes if p is not process], grace)
                if process.reader is not None:
                    process.reader.join(timeout=2)
                message = f"{process.label} exited with code {_exit_code(code)}"
                if out_of_memory is not None:
                    message = out_of_memory.describe()
                return ClusterRun(
                    _exit_code(code),
                    process.label,
                    list(process.tail),
                    f"{message}; the run was stopped",
                    ends=[p.end for p in processes],
                    out_of_memory=[out_of_memory] if out_of_memory is not None else [],
                )
        if all(p.popen.returncode is not None for p in processes):
            return ClusterRun(0, ends=[p.end for p in processes])
        if deadline is not None and time.monotonic() > deadline:
            running = [p.label for p in processes if p.popen.poll() is None]
            _stop(processes, grace)
            tail = [f"[{p.label}] {line}" for p in processes for line in list(p.tail)[-10:]]
            return ClusterRun(
                TIMEOUT_EXIT_CODE,
                running[0] if running else None,
                tail,
                f"timed out after {timeout:g} s; still running: {', '.join(running)}",
                ends=[p.end for p in processes],
            )
        time.sleep(0.05)
