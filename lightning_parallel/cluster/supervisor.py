"""Watch the processes of a run on the simulated cluster until the run ends, and say how it ended.

:func:`~lightning_parallel.cluster.launcher.run_on_hosts` starts the processes; this module
streams their output and decides the outcome (a :class:`ClusterRun`):

- without faults, the first process that exits non-zero ends the run: the others are stopped
  (SIGTERM to each process group, SIGKILL after ``grace`` seconds) and its exit code (``128 +
  signal`` for a signal) and last output lines are returned; past ``timeout`` every process is
  stopped and the run ends with code 124;
- with faults (:mod:`lightning_parallel.cluster.faults`), each fault is applied when its second
  has come or its target reported its step (``[progress] rank R step N``): ``kill`` sends
  SIGKILL to the target's process group, ``freeze`` SIGSTOP, ``link`` takes the host's link
  down. The run then waits for every survivor to end by itself; a survivor silent for
  ``hang_after`` seconds after the first fault, or still running at ``timeout``, is hung (code
  124). Processes left in the hosts' namespaces afterwards are reported as orphans;
- with memory caps (:class:`~lightning_parallel.cluster.memory.MemoryCaps`), a process ended
  by SIGKILL in a host whose group counts an OOM kill is reported as that host running out of
  memory (:class:`~lightning_parallel.cluster.memory.OutOfMemory`), not as a crash.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from collections import deque
from collections.abc import Sequence
from contextlib import suppress
from dataclasses import dataclass, field
from typing import IO

from lightning_parallel.cluster.faults import AppliedFault, Fault, ProcessEnd, reported_step
from lightning_parallel.cluster.local import LocalHosts
from lightning_parallel.cluster.memory import MemoryCaps, OutOfMemory
from lightning_parallel.cluster.network import SimulatedNetwork

__all__: list[str] = []

Hosts = SimulatedNetwork | LocalHosts  # where the processes run: namespaces, or loopback
TIMEOUT_EXIT_CODE = 124


@dataclass
class RunningProcess:
    """One started process: its output's last lines and reader, how it ended, its last step."""

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
            (``memory`` given to :func:`~lightning_parallel.cluster.launcher.run_on_hosts`);
            the first one is in ``message``.
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


def stream_output(process: RunningProcess, output: IO[str] | None, lock: threading.Lock) -> None:
    """Read ``process``'s output to its end: keep the tail and the last reported step, and
    write each line to ``output`` with the ``[label]`` prefix (the reader thread's body)."""
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


def _signal_group(process: RunningProcess, sig: int) -> None:
    if process.popen.poll() is None:
        with suppress(ProcessLookupError, PermissionError):
            os.killpg(process.popen.pid, sig)


def stop_processes(processes: list[RunningProcess], grace: float) -> None:
    """SIGTERM every process group, SIGKILL what still runs after ``grace`` seconds, and wait
    for the processes and their output readers."""
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


def supervise(
    network: Hosts,
    processes: list[RunningProcess],
    faults: Sequence[Fault],
    timeout: float | None,
    hang_after: float | None,
    grace: float,
    memory: MemoryCaps | None,
) -> ClusterRun:
    """Wait for the started ``processes`` and return how the run ended (see the module doc).

    The caller stops whatever still runs afterwards (:func:`stop_processes`).
    """
    if not faults:
        return _wait(processes, timeout, grace, memory)
    run = _FaultyRun(network, processes, faults, timeout, hang_after, grace, memory).wait()
    run.orphans = _orphans(network, processes)
    return run


def _orphans(network: Hosts, processes: list[RunningProcess]) -> list[int]:
    """Processes left in the namespaces once every started process ended (none expected)."""
    stop_processes(processes, grace=0.0)  # faulted (frozen) processes are killed first
    started = {p.popen.pid for p in processes}
    return [pid for host in network.hosts for pid in network.pids(host) if pid not in started]


def _record_exit(
    process: RunningProcess, code: int, now: float, memory: MemoryCaps | None
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
        processes: list[RunningProcess],
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
        stop_processes(self.processes, self.grace)
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
    processes: list[RunningProcess], timeout: float | None, grace: float, memory: MemoryCaps | None
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
                stop_processes([p for p in processes if p is not process], grace)
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
            stop_processes(processes, grace)
            tail = [f"[{p.label}] {line}" for p in processes for line in list(p.tail)[-10:]]
            return ClusterRun(
                TIMEOUT_EXIT_CODE,
                running[0] if running else None,
                tail,
                f"timed out after {timeout:g} s; still running: {', '.join(running)}",
                ends=[p.end for p in processes],
            )
        time.sleep(0.05)
