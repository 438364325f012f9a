"""Give every simulated host a memory size: one memory cgroup per host, limited to that size.

A host's processes (every process started in its namespace and all their children) share one
limit, as they would share a machine's RAM. When they need more, the kernel's OOM killer kills
one of them (the largest) inside that host only; the launcher then reports *which host ran out
of memory and its size* (:class:`OutOfMemory`) instead of a bare "killed by signal 9". How
cgroup v1 and v2 are found and written is in :mod:`lightning_parallel.cluster.cgroups`.

Layout: ``<base>/lp<pid hex>r<run hex>/h<i>``, named after the run's network (its ``prefix``),
so that a later run removes the groups of a run whose process died (:func:`remove_stale_groups`,
like :func:`~lightning_parallel.cluster.remove_stale` for namespaces).

How processes join (:meth:`MemoryCaps.join_argv`): each host process is started as
``sh -c 'echo $$ > <group>/cgroup.procs && exec "$@"' ip netns exec NS CMD...``. The shell moves
itself into the group and only then replaces itself (``exec``) by ``ip netns exec``, which
replaces itself by the command: the command and everything it starts are inside the group from
their first allocation (a child inherits its parent's cgroup at ``fork``). Writing the pid
after ``Popen`` returns would let the command run, and allocate, uncapped for a moment; a
``preexec_fn`` runs Python between ``fork`` and ``exec``, which is unsafe while the launcher's
output-reader threads run. A shell that cannot join (a removed group) says so and exits with
125 before the command starts.

How an OOM kill is told from a crash (:meth:`MemoryCaps.out_of_memory`): a process that ended by
SIGKILL (exit code ``128 + 9``, also as a shell reports a killed child) in a host whose group
counts at least one OOM kill. A SIGKILL from elsewhere (a ``kill`` fault) leaves the count at 0.

Clean-up (:meth:`MemoryCaps.destroy`, also on an exception, Ctrl-C or SIGTERM through the
``with`` block): every process still in a host's group is killed, then the groups are removed
(retried for a few seconds: a killed process leaves its group once it has exited).
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

from lightning_parallel.cluster.cgroups import MemoryHierarchy, check_memory_requirements
from lightning_parallel.cluster.network import ClusterError, _owner_alive
from lightning_parallel.cluster.units import format_memory_size

__all__: list[str] = []

_GROUP = re.compile(r"^lp([0-9a-f]+)r([0-9a-f]+)$")
_REMOVE_WAIT_S = 5.0
JOIN_FAILED_EXIT_CODE = 125
# joins the group named by $1, then becomes the rest of its arguments (see the module doc)
_JOIN_SCRIPT = (
    'echo $$ > "$1" || { echo "lightning-parallel: cannot join the memory cgroup $1" >&2; '
    f'exit {JOIN_FAILED_EXIT_CODE}; }}; shift; exec "$@"'
)
_NOT_CREATED = "the memory caps are not created; use them as `with MemoryCaps(...)`"


def _kill_all(hierarchy: MemoryHierarchy, group: Path) -> None:
    for pid in hierarchy.procs(group):
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            continue


def _remove_run_group(hierarchy: MemoryHierarchy, run_group: Path) -> list[Path]:
    """Kill what is left in ``run_group``'s host groups and remove them; what stays."""
    if not run_group.is_dir():
        return []
    hosts = sorted(p for p in run_group.iterdir() if p.is_dir() and re.fullmatch(r"h\d+", p.name))
    deadline = time.monotonic() + _REMOVE_WAIT_S
    pending = [*hosts, run_group]  # the run's group last: it is empty once its hosts are gone
    while True:
        busy = []
        for group in pending:
            _kill_all(hierarchy, group)
            try:
                hierarchy.remove_group(group)
            except FileNotFoundError:
                continue
            except OSError:
                busy.append(group)
        pending = busy
        if not pending or time.monotonic() > deadline:
            return pending
        time.sleep(0.05)  # a killed process leaves its group once it has exited


def remove_stale_groups(hierarchy: MemoryHierarchy) -> list[str]:
    """Remove memory groups left by simulated clusters whose process is gone; their names."""
    removed = []
    try:
        entries = list(hierarchy.base.iterdir())
    except OSError:
        return []
    for entry in entries:
        match = _GROUP.match(entry.name)
        if not match or not entry.is_dir():
            continue
        try:
            created: float | None = entry.stat().st_mtime
        except OSError:
            created = None
        owner_gone = not _owner_alive(int(match.group(1), 16), created)
        if owner_gone and not _remove_run_group(hierarchy, entry):
            removed.append(entry.name)
    return removed


@dataclass(frozen=True)
class OutOfMemory:
    """A process that the kernel killed because its host reached its memory size.

    Attributes:
        host: the host index; ``rank`` the killed process's global rank; ``label`` its label.
        limit_bytes: the host's memory size.
        kills: OOM kills counted in the host's group (more than one process may have died).
    """

    host: int
    rank: int
    label: str
    limit_bytes: int
    kills: int = 1

    def describe(self) -> str:
        """``host 1 ran out of memory: its 2 GB cap (--memory-per-host) was reached and the
        kernel killed rank 1``."""
        more = f" ({self.kills} processes killed there)" if self.kills > 1 else ""
        return (
            f"host {self.host} ran out of memory: its {format_memory_size(self.limit_bytes)} "
            f"cap (--memory-per-host) was reached and the kernel killed rank {self.rank}{more}"
        )


class MemoryCaps:
    """One memory cgroup per simulated host, each limited to ``limit_bytes`` (see the module doc).

    Use it as a context manager next to the network: the groups exist inside the ``with``
    block and are removed on exit, also after an exception or Ctrl-C.

    Args:
        prefix: the run's name, :attr:`SimulatedNetwork.prefix` (``lp<pid hex>r<run hex>``).
        hosts: number of hosts.
        limit_bytes: memory size of every host, in bytes.
        hierarchy: where to make the groups (default: :func:`check_memory_requirements`).

    Example::

        with SimulatedNetwork(2) as network, MemoryCaps(network.prefix, 2, 2 * 10**9) as caps:
            run_on_hosts(network, ["python", "train.py"], memory=caps)
    """

    def __init__(
        self,
        prefix: str,
        hosts: int,
        limit_bytes: int,
        hierarchy: MemoryHierarchy | None = None,
    ) -> None:
        if not _GROUP.match(prefix):
            raise ValueError(f"prefix must look like lp<hex>r<hex>, got {prefix!r}")
        if hosts < 1:
            raise ValueError(f"hosts must be >= 1, got {hosts}")
        if limit_bytes < 1:
            raise ValueError(f"limit_bytes must be positive, got {limit_bytes}")
        self.prefix = prefix
        self.hosts = hosts
        self.limit_bytes = limit_bytes
        self.hierarchy = hierarchy
        self.notes: list[str] = []
        self.created = False

    def __enter__(self) -> MemoryCaps:
        return self.create()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.destroy()

    @property
    def run_group(self) -> Path:
        if self.hierarchy is None:
            raise ClusterError(_NOT_CREATED)
        return self.hierarchy.base / self.prefix

    def group(self, host: int) -> Path:
        """The cgroup directory of host ``host``."""
        return self.run_group / f"h{host}"

    def create(self) -> MemoryCaps:
        """Make and limit every host's group; undo everything if a step fails."""
        if self.hierarchy is None:
            self.hierarchy = check_memory_requirements()
        hierarchy = self.hierarchy
        remove_stale_groups(hierarchy)
        self.created = True
        try:
            hierarchy.prepare(self.run_group)
            notes: list[str] = []
            for host in range(self.hosts):
                group = self.group(host)
                try:
                    hierarchy.make_group(group)
                except OSError as error:
                    raise ClusterError(
                        f"cannot create the memory cgroup {group}: {error.strerror or error}"
                    ) from error
                notes += hierarchy.limit(group, self.limit_bytes)
        except BaseException:
            self.destroy()
            raise
        for note in dict.fromkeys(notes):
            self.notes.append(note)
            warnings.warn(note, RuntimeWarning, stacklevel=3)
        return self

    def join_argv(self, host: int, argv: Sequence[str]) -> list[str]:
        """``argv`` run so that it starts inside host ``host``'s group (see the module doc)."""
        if not self.created or self.hierarchy is None:
            raise ClusterError(_NOT_CREATED)
        shell = shutil.which("sh") or "/bin/sh"
        join = str(self.hierarchy.join_file(self.group(host)))
        return [shell, "-c", _JOIN_SCRIPT, "lightning-parallel-join", join, *argv]

    def oom_kills(self, host: int) -> int:
        """Processes of host ``host`` killed by the kernel for want of memory so far."""
        if self.hierarchy is None:
            return 0
        return self.hierarchy.oom_kills(self.group(host))

    def out_of_memory(self, host: int, rank: int, label: str, exit_code: int) -> OutOfMemory | None:
        """An :class:`OutOfMemory` when a process that ended with ``exit_code`` was killed by
        SIGKILL (``128 + 9``, also as a shell reports it) in a host whose group counts OOM
        kills; else ``None`` (a crash, or a SIGKILL from someone else)."""
        if exit_code != 128 + signal.SIGKILL:
            return None
        kills = self.oom_kills(host)
        return OutOfMemory(host, rank, label, self.limit_bytes, kills) if kills else None

    def leftovers(self) -> list[Path]:
        """This run's groups that exist now."""
        if self.hierarchy is None:
            return []
        run_group = self.run_group
        if not run_group.exists():
            return []
        return [*sorted(p for p in run_group.iterdir() if p.is_dir()), run_group]

    def destroy(self) -> None:
        """Kill every process left in the hosts' groups and remove the groups.

        Idempotent and best-effort: a group that cannot be removed within a few seconds is named
        in a ``RuntimeWarning`` (the next run removes it once this process is gone).
        """
        if not self.created or self.hierarchy is None:
            return
        stuck = _remove_run_group(self.hierarchy, self.run_group)
        self.created = False
        if stuck:
            warnings.warn(
                f"memory cgroups not removed: {', '.join(map(str, stuck))} (still busy)",
                RuntimeWarning,
                stacklevel=2,
            )
