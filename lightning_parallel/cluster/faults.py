"""Faults injected into a simulated cluster run: kill a rank, freeze it, or cut a host's link.

A fault is written ``KIND:TARGET@SECONDS`` and happens ``SECONDS`` after the run's processes
start, or ``KIND:TARGET@stepN`` and happens once the targeted process says it finished
training step ``N`` (:func:`parse_fault`). A step does not move when start-up is slow (a busy
machine, a cold cache), so tests and comparisons across runs inject by step. The process says
so by printing ``[progress] rank R step N`` (the benchmark's worker does, for the steps listed
in :data:`STEPS_VARIABLE`); for ``link`` the step is the host's first process's:

=================  ===========================================================================
``kill:R@S``       SIGKILL to global rank ``R``'s process group: the process dies at once, the
                   kernel closes its sockets, so its peers see "connection closed".
``freeze:R@S``     SIGSTOP to rank ``R``'s process group: every thread stops, the sockets stay
                   open, nothing is answered; its peers only see silence (a timeout).
``link:H@S``       host ``H``'s link goes down (its bridge port, root namespace): its processes
                   live on, but no packet leaves or reaches the host.
=================  ===========================================================================

How the run ends when faults are given (:func:`lightning_parallel.cluster.run_on_hosts`):
a process that a ``kill`` or ``freeze`` targets is *faulted*; every other process (those of a
cut-off host included) is a *survivor* and must end on its own. The run waits until every
survivor has exited; a survivor still running that has been silent (no output line) for
``hang_after`` seconds since the first fault counts as *hung*, and the run is ended. A survivor
that goes on without the lost rank and keeps printing (the benchmark's worker prints a progress
line every few seconds when faults are injected) is not hung. A survivor that fails before any
fault happened ends the run as without faults. What each process did and when is kept in
:class:`ProcessEnd` records.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

__all__: list[str] = []

FAULT_KINDS = ("kill", "freeze", "link")
_FAULT = re.compile(r"^\s*([a-z]+)\s*:\s*(\d+)\s*@\s*(step)?\s*(\d+(?:\.\d+)?)\s*(s?)\s*$")
#: the environment variable that lists, comma-separated, the steps a process is to report
STEPS_VARIABLE = "LIGHTNING_PARALLEL_REPORT_STEPS"
_REPORT = re.compile(r"^\[progress\] rank \d+ step (\d+)\s*$")


def progress_line(rank: int, step: int) -> str:
    """The line a training process prints to say it finished ``step`` (:func:`reported_step`)."""
    return f"[progress] rank {rank} step {step}"


def reported_step(line: str) -> int | None:
    """The step in a :func:`progress_line`, else ``None``."""
    match = _REPORT.match(line.strip())
    return int(match.group(1)) if match else None


@dataclass(frozen=True)
class Fault:
    """One fault: ``kind`` (kill, freeze, link), its target and when it happens.

    Attributes:
        kind: ``"kill"``, ``"freeze"`` (target: a global rank) or ``"link"`` (target: a host).
        target: the global rank, or the host index for ``link``.
        at: seconds after the run's processes start (0 for a fault at a step).
        step: the training step after which it happens (``None``: at ``at`` seconds).
    """

    kind: str
    target: int
    at: float
    step: int | None = None

    def __str__(self) -> str:
        when = f"step{self.step}" if self.step is not None else f"{self.at:g}"
        return f"{self.kind}:{self.target}@{when}"

    @property
    def targets_host(self) -> bool:
        return self.kind == "link"

    def describe(self) -> str:
        """``"rank 1 killed"``, ``"rank 0 frozen"``, ``"host 1 cut off"``."""
        if self.kind == "kill":
            return f"rank {self.target} killed (SIGKILL)"
        if self.kind == "freeze":
            return f"rank {self.target} frozen (SIGSTOP)"
        return f"host {self.target}'s link dropped"


def parse_fault(text: str) -> Fault:
    """``"kill:1@20"`` -> ``Fault("kill", 1, 20.0)``; ``"kill:1@step30"`` -> ``Fault("kill", 1,
    0.0, step=30)``.

    Raises:
        ValueError: an unknown kind or a malformed text; the message shows the form.
    """
    match = _FAULT.match(text.lower())
    by_step = match is not None and match.group(3) is not None
    if (
        not match
        or match.group(1) not in FAULT_KINDS
        or (by_step and ("." in match.group(4) or match.group(5)))
    ):
        raise ValueError(
            f"fault {text!r} is not understood; write kill:RANK@SECONDS (SIGKILL), "
            "freeze:RANK@SECONDS (SIGSTOP) or link:HOST@SECONDS (drop the host's link), "
            "e.g. kill:1@20, or @stepN for once the rank finished training step N: kill:1@step30"
        )
    if by_step:
        return Fault(match.group(1), int(match.group(2)), 0.0, step=int(match.group(4)))
    return Fault(match.group(1), int(match.group(2)), float(match.group(4)))


def check_faults(faults: Sequence[Fault], hosts: int, world_size: int) -> None:
    """Raise ``ValueError`` for a rank or host that does not exist, or a rank faulted twice."""
    seen: set[int] = set()
    for fault in faults:
        if fault.targets_host:
            if fault.target >= hosts:
                raise ValueError(f"fault {fault}: there is no host {fault.target} ({hosts} hosts)")
            continue
        if fault.target >= world_size:
            raise ValueError(
                f"fault {fault}: there is no rank {fault.target} (world size {world_size})"
            )
        if fault.target in seen:
            raise ValueError(f"fault {fault}: rank {fault.target} is already faulted once")
        seen.add(fault.target)


@dataclass
class AppliedFault:
    """A fault and when it was applied (seconds after the start; ``None``: the run ended first)."""

    fault: Fault
    applied_s: float | None = None
    note: str = ""


@dataclass
class ProcessEnd:
    """How one process of a run ended.

    Attributes:
        label: ``"host 1"`` (``"host 1.0"`` with several processes per host).
        rank: its global rank; ``host`` its host index.
        faulted: a ``kill``/``freeze`` fault targeted it.
        exit_code: its exit code (``128 + signal`` when a signal ended it); ``None`` while it ran.
        end_s: seconds from the start to its exit (``None``: it did not exit by itself).
        hung: it was still running, silent for ``hang_after`` seconds after the first fault,
            and was killed.
        last_line: its last non-empty output line.
        out_of_memory: the kernel killed it because its host reached its memory size.
    """

    label: str
    rank: int
    host: int
    faulted: bool = False
    exit_code: int | None = None
    end_s: float | None = None
    hung: bool = False
    last_line: str = ""
    out_of_memory: bool = False

    def after_fault(self, fault_s: float | None) -> float | None:
        """Seconds from ``fault_s`` to this process's exit."""
        if fault_s is None or self.end_s is None:
            return None
        return self.end_s - fault_s


def fault_report(
    faults: Sequence[AppliedFault], ends: Sequence[ProcessEnd], orphans: Sequence[int] = ()
) -> list[str]:
    """Lines that say which faults happened when, and how and when every survivor ended."""
    lines = []
    applied = [f.applied_s for f in faults if f.applied_s is not None]
    first = min(applied) if applied else None
    for item in faults:
        when = (
            "not applied: the run ended first"
            if item.applied_s is None
            else (f"at {item.applied_s:.1f} s")
        )
        lines.append(f"fault {item.fault}: {item.fault.describe()} {when} {item.note}".rstrip())
    for end in ends:
        if end.faulted:
            continue
        after = end.after_fault(first)
        if end.hung:
            what = "HUNG: still running, killed"
        elif end.out_of_memory:
            what = "ran out of memory (killed by the kernel under its host's cap)"
        elif end.exit_code is None:
            what = "did not exit"
        else:
            what = f"exited with code {end.exit_code}"
        timing = "" if after is None else f" {after:.1f} s after the fault"
        line = f"rank {end.rank} ({end.label}): {what}{timing}"
        if end.last_line and end.exit_code not in (0, None):
            line += f": {end.last_line[:300]}"
        lines.append(line)
    lines.append(f"orphaned processes: {len(orphans)}" + (f" {list(orphans)}" if orphans else ""))
    return lines
