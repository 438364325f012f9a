"""Find the memory cgroup controller (cgroup v1 or v2) and name its files.

:func:`detect_hierarchy` reads ``/proc/self/mountinfo``: the memory controller lives in a v1
hierarchy when one is mounted with it (hybrid systems mount cgroup2 beside it, without memory),
otherwise in the v2 (unified) hierarchy. The two differ as follows:

=========================  ===================================  ==================================
                           cgroup v2 (unified)                  cgroup v1 (``memory`` hierarchy)
=========================  ===================================  ==================================
groups made under          the hierarchy's root                 the launcher's own memory cgroup
                           (``/sys/fs/cgroup``)                 (``/sys/fs/cgroup/memory/<own>``)
controller                 ``+memory`` written to the parents'  always on in its own hierarchy
                           ``cgroup.subtree_control`` if absent
the limit                  ``memory.max``                       ``memory.limit_in_bytes``
swap (so the cap is real)  ``memory.swap.max`` = 0              ``memory.memsw.limit_in_bytes`` =
                                                                the limit (if swap accounting is on)
OOM kills counted in       ``memory.events``: ``oom_kill``      ``memory.oom_control``: ``oom_kill``
                                                                (before Linux 4.13: ``failcnt``)
joined by writing a pid    ``cgroup.procs``                     ``cgroup.procs``
=========================  ===================================  ==================================

cgroup v2 forbids a cgroup that holds processes to hand controllers to its children (the
"no internal processes" rule; the root is exempt), and the launcher's own cgroup holds the
launcher: so on v2 the groups are made at the root of the hierarchy, where systemd has usually
enabled ``memory`` already. cgroup v1 has no such rule, and nesting the groups in the launcher's
own cgroup keeps every limit the launcher runs under (a container's, a job's) over the hosts too.
"""

from __future__ import annotations

import abc
import errno
import os
import re
from pathlib import Path

from lightning_parallel.cluster.network import ClusterError

__all__: list[str] = []


def _read(path: Path) -> str:
    return path.read_text()


def _write(path: Path, value: str) -> None:
    try:
        with open(path, "w") as control:
            control.write(value)
    except OSError as error:
        raise ClusterError(
            f"cannot write {value.strip()!r} to {path}: {error.strerror or error}"
        ) from error


def _counter(path: Path, key: str) -> int | None:
    """The value of ``key N`` in a flat-keyed cgroup file (``None``: no such key or file)."""
    try:
        lines = _read(path).splitlines()
    except OSError:
        return None
    for line in lines:
        name, _, value = line.partition(" ")
        if name == key and value.strip().isdigit():
            return int(value)
    return None


def _swap_in_use() -> bool:
    try:
        return len(Path("/proc/swaps").read_text().splitlines()) > 1
    except OSError:
        return False


class MemoryHierarchy(abc.ABC):
    """A place to make memory cgroups and the names of their files (one subclass per version).

    The kernel-facing operations (:meth:`make_group`, :meth:`remove_group`) are methods so that a
    test can stand in for the kernel with a plain directory tree.

    Args:
        base: the directory under which the run's groups are made.
    """

    version = 0

    def __init__(self, base: Path) -> None:
        self.base = Path(base)

    def __repr__(self) -> str:
        return f"cgroup v{self.version} at {self.base}"

    def make_group(self, path: Path) -> None:
        """Create the cgroup ``path`` (the kernel fills it with its control files)."""
        path.mkdir()

    def remove_group(self, path: Path) -> None:
        """Remove the empty cgroup ``path``."""
        path.rmdir()

    def procs(self, group: Path) -> list[int]:
        """The processes in ``group`` now."""
        try:
            return [int(pid) for pid in _read(group / "cgroup.procs").split()]
        except (OSError, ValueError):
            return []

    def join_file(self, group: Path) -> Path:
        """The file a process writes its pid to in order to enter ``group``."""
        return group / "cgroup.procs"

    @abc.abstractmethod
    def prepare(self, run_group: Path) -> None:
        """Make ``run_group`` under :attr:`base`, ready to hold memory-limited children."""

    @abc.abstractmethod
    def limit(self, group: Path, size: int) -> list[str]:
        """Cap ``group`` at ``size`` bytes, swap included; notes on what could not be done."""

    @abc.abstractmethod
    def oom_kills(self, group: Path) -> int:
        """How many processes of ``group`` the kernel's OOM killer has killed."""


class CgroupV2(MemoryHierarchy):
    """The unified hierarchy: ``memory.max``, ``memory.swap.max``, ``memory.events``."""

    version = 2

    def _enable_memory(self, group: Path) -> None:
        control = group / "cgroup.subtree_control"
        try:
            enabled = _read(control).split()
        except OSError as error:
            raise ClusterError(f"cannot read {control}: {error.strerror or error}") from error
        if "memory" in enabled:
            return
        try:
            with open(control, "w") as file:
                file.write("+memory")
        except OSError as error:
            if error.errno == errno.EBUSY:
                raise ClusterError(
                    f"cannot enable the memory controller in {control}: {group} holds processes "
                    "of its own, and cgroup v2 lets only a cgroup without processes (or the "
                    "root) hand controllers to its children; move those processes into a child "
                    f"cgroup (e.g. `mkdir {group}/init` and write their pids to "
                    f"{group}/init/cgroup.procs), then run again"
                ) from error
            raise ClusterError(
                f"cannot enable the memory controller (+memory) in {control}: "
                f"{error.strerror or error}"
            ) from error

    def prepare(self, run_group: Path) -> None:
        controllers = self.base / "cgroup.controllers"
        try:
            available = _read(controllers).split()
        except OSError as error:
            raise ClusterError(f"cannot read {controllers}: {error.strerror or error}") from error
        if "memory" not in available:
            raise ClusterError(
                f"the memory cgroup controller is not available: cgroup v2 at {self.base} offers "
                f"only [{' '.join(available)}] in {controllers}; enable `memory` in its "
                "parent's cgroup.subtree_control (or boot with cgroup_enable=memory)"
            )
        self._enable_memory(self.base)
        self.make_group(run_group)
        self._enable_memory(run_group)

    def limit(self, group: Path, size: int) -> list[str]:
        _write(group / "memory.max", str(size))
        if (group / "memory.swap.max").exists():
            _write(group / "memory.swap.max", "0")
            return []
        if _swap_in_use():
            return [
                "swap is not capped (no memory.swap.max: swap accounting is off); a host over "
                "its memory size may swap instead of being killed"
            ]
        return []

    def oom_kills(self, group: Path) -> int:
        return _counter(group / "memory.events", "oom_kill") or 0


class CgroupV1(MemoryHierarchy):
    """The v1 ``memory`` hierarchy: ``memory.limit_in_bytes``, ``memory.memsw.limit_in_bytes``,
    ``memory.oom_control``."""

    version = 1

    def prepare(self, run_group: Path) -> None:
        if not (self.base / "memory.limit_in_bytes").exists():
            raise ClusterError(
                f"{self.base} is not a cgroup v1 memory hierarchy (no memory.limit_in_bytes); "
                "the memory cgroup controller is not available"
            )
        self.make_group(run_group)

    def limit(self, group: Path, size: int) -> list[str]:
        # the memory limit first: memory+swap may never be below it
        _write(group / "memory.limit_in_bytes", str(size))
        if (group / "memory.memsw.limit_in_bytes").exists():
            _write(group / "memory.memsw.limit_in_bytes", str(size))
            return []
        if _swap_in_use():
            return [
                "swap is not capped (no memory.memsw.limit_in_bytes: boot with "
                "swapaccount=1); a host over its memory size may swap instead of being killed"
            ]
        return []

    def oom_kills(self, group: Path) -> int:
        kills = _counter(group / "memory.oom_control", "oom_kill")
        if kills is not None:
            return kills
        # kernels before 4.13 count no kills: a hit limit is the best evidence there is
        hits = [_counter_file(group / name) for name in ("memory.failcnt", "memory.memsw.failcnt")]
        return 1 if any(hits) else 0


def _counter_file(path: Path) -> int:
    try:
        return int(_read(path).strip() or 0)
    except (OSError, ValueError):
        return 0


def _unescape(field: str) -> str:
    """A mountinfo path field: spaces and the like are written as octal ``\\040``."""
    return re.sub(r"\\([0-7]{3})", lambda match: chr(int(match.group(1), 8)), field)


def _own_memory_path(membership: str) -> str:
    """This process's cgroup path in the v1 memory hierarchy (``/proc/self/cgroup``)."""
    for line in membership.splitlines():
        _, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if "memory" in controllers.split(","):
            return path
    return "/"


def detect_hierarchy(
    mountinfo: Path = Path("/proc/self/mountinfo"), membership: Path = Path("/proc/self/cgroup")
) -> MemoryHierarchy:
    """Which cgroup version holds the memory controller here, and where to make groups.

    The memory controller lives in a v1 hierarchy when one is mounted with it (hybrid systems
    mount cgroup2 beside it without memory); otherwise in the v2 hierarchy.

    Raises:
        ClusterError: no mounted hierarchy has the memory controller.
    """
    try:
        mounts = mountinfo.read_text().splitlines()
        own = membership.read_text()
    except OSError as error:
        raise ClusterError(f"cannot read the cgroup mounts: {error}") from error
    unified: Path | None = None
    for line in mounts:
        left, _, right = line.partition(" - ")
        fields, described = left.split(), right.split()
        if len(fields) < 5 or len(described) < 3:
            continue
        root, mountpoint = _unescape(fields[3]), Path(_unescape(fields[4]))
        fstype, options = described[0], described[2].split(",")
        if fstype == "cgroup" and "memory" in options:
            path = _own_memory_path(own)
            # the mount shows the hierarchy from `root` down (a container's bind mount)
            relative = os.path.relpath(path, root) if path.startswith(root) else "."
            base = (mountpoint / relative).resolve()
            return CgroupV1(base if base.is_dir() else mountpoint)
        if fstype == "cgroup2" and unified is None:
            unified = mountpoint
    if unified is not None:
        hierarchy = CgroupV2(unified)
        try:
            available = _read(unified / "cgroup.controllers").split()
        except OSError:
            available = []
        if "memory" in available:
            return hierarchy
        raise ClusterError(
            "the memory cgroup controller is not available: no cgroup v1 hierarchy is mounted "
            f"with it, and cgroup v2 at {unified} offers only [{' '.join(available)}]; enable "
            "it (e.g. boot with cgroup_enable=memory, or free it from a v1 mount)"
        )
    raise ClusterError(
        "the memory cgroup controller is not available: no cgroup filesystem is mounted "
        "(mount cgroup2 on /sys/fs/cgroup, or cgroup v1's memory hierarchy)"
    )


def check_memory_requirements() -> MemoryHierarchy:
    """The hierarchy to cap hosts in, after checking that this process may do it.

    Raises:
        ClusterError: not root, or no memory controller; the message says which and the fix.
    """
    if os.geteuid() != 0:
        raise ClusterError(
            "--memory-per-host needs root: creating memory cgroups and moving processes into "
            "them needs write access to /sys/fs/cgroup; run the command as root (e.g. with sudo)"
        )
    return detect_hierarchy()


def memory_unavailable_reason() -> str | None:
    """Why hosts cannot be given a memory size here, or ``None`` if they can."""
    try:
        check_memory_requirements()
    except ClusterError as error:
        return f"memory cgroups: {error}"
    return None
