"""Memory cgroups of cgroup v1 and v2 on a fake directory tree: the files written and read.

A small fake kernel stands in for cgroupfs: ``make_group`` creates the control files a real
``mkdir`` would, ``remove_group`` refuses a group with children or processes, as ``rmdir`` does.
The real hierarchy of this machine is exercised in ``test_cluster_memory.py``.
"""

import errno
import os
import shutil
import subprocess

import pytest

from lightning_parallel.cluster import ClusterError, MemoryCaps, OutOfMemory, detect_hierarchy
from lightning_parallel.cluster import cgroups as cgroups_module
from lightning_parallel.cluster import memory as memory_module
from lightning_parallel.cluster.cgroups import CgroupV1, CgroupV2, check_memory_requirements
from lightning_parallel.cluster.command import main as cluster_main
from lightning_parallel.cluster.memory import remove_stale_groups

SIZE = 2 * 10**9
V2_FILES = {
    "cgroup.procs": "",
    "cgroup.controllers": "cpu memory pids",
    "cgroup.subtree_control": "",
    "memory.max": "max\n",
    "memory.swap.max": "max\n",
    "memory.events": "low 0\nhigh 0\nmax 0\noom 0\noom_kill 0\n",
}
V1_FILES = {
    "cgroup.procs": "",
    "memory.limit_in_bytes": "9223372036854771712\n",
    "memory.memsw.limit_in_bytes": "9223372036854771712\n",
    "memory.oom_control": "oom_kill_disable 0\nunder_oom 0\noom_kill 0\n",
    "memory.failcnt": "0\n",
}


def _populate(path, files):
    for name, content in files.items():
        (path / name).write_text(content)


def _rmdir_like_the_kernel(path):
    if any(p.is_dir() for p in path.iterdir()) or (path / "cgroup.procs").read_text().strip():
        raise OSError(errno.EBUSY, "Device or resource busy", str(path))
    shutil.rmtree(path)


class FakeV2(CgroupV2):
    def __init__(self, base, files=V2_FILES):
        super().__init__(base)
        self.files = files

    def make_group(self, path):
        path.mkdir()
        _populate(path, self.files)

    def remove_group(self, path):
        _rmdir_like_the_kernel(path)


class FakeV1(CgroupV1):
    def __init__(self, base, files=V1_FILES):
        super().__init__(base)
        self.files = files

    def make_group(self, path):
        path.mkdir()
        _populate(path, self.files)

    def remove_group(self, path):
        _rmdir_like_the_kernel(path)


@pytest.fixture
def v2_root(tmp_path):
    _populate(
        tmp_path, {"cgroup.controllers": "cpu io memory pids", "cgroup.subtree_control": "cpu"}
    )
    return tmp_path


@pytest.fixture
def v1_base(tmp_path):
    _populate(tmp_path, V1_FILES)
    return tmp_path


def test_v2_enables_memory_caps_the_host_and_its_swap(v2_root):
    caps = MemoryCaps("lp1r0", 2, SIZE, hierarchy=FakeV2(v2_root))
    with caps:
        assert "memory" in (v2_root / "cgroup.subtree_control").read_text()
        assert "memory" in (v2_root / "lp1r0" / "cgroup.subtree_control").read_text()
        for host in (0, 1):
            group = v2_root / "lp1r0" / f"h{host}"
            assert caps.group(host) == group
            assert (group / "memory.max").read_text() == str(SIZE)
            assert (group / "memory.swap.max").read_text() == "0"
        assert caps.oom_kills(1) == 0
        (v2_root / "lp1r0" / "h1" / "memory.events").write_text("oom 1\noom_kill 2\n")
        assert caps.oom_kills(1) == 2 and caps.oom_kills(0) == 0
    assert not (v2_root / "lp1r0").exists()
    assert caps.leftovers() == []


def test_v2_without_swap_accounting_writes_no_swap_file(v2_root):
    files = {k: v for k, v in V2_FILES.items() if k != "memory.swap.max"}
    with MemoryCaps("lp1r0", 1, SIZE, hierarchy=FakeV2(v2_root, files)) as caps:
        assert not (caps.group(0) / "memory.swap.max").exists()
        assert (caps.group(0) / "memory.max").read_text() == str(SIZE)


def test_v2_names_the_missing_controller_and_leaves_nothing(v2_root):
    (v2_root / "cgroup.controllers").write_text("cpu io pids")
    with pytest.raises(
        ClusterError, match=r"memory cgroup controller is not available.*cpu io pids"
    ):
        MemoryCaps("lp1r0", 2, SIZE, hierarchy=FakeV2(v2_root)).create()
    assert not (v2_root / "lp1r0").exists()


def test_v2_explains_the_no_internal_process_rule(v2_root, monkeypatch):
    real_open = open

    def busy_open(path, mode="r", *args, **kwargs):
        if str(path).endswith("cgroup.subtree_control") and "w" in mode:
            raise OSError(errno.EBUSY, "Device or resource busy", str(path))
        return real_open(path, mode, *args, **kwargs)

    monkeypatch.setattr(cgroups_module, "open", busy_open, raising=False)
    with pytest.raises(ClusterError, match="holds processes of its own"):
        MemoryCaps("lp1r0", 2, SIZE, hierarchy=FakeV2(v2_root)).create()


def test_v1_caps_memory_and_memory_plus_swap(v1_base):
    with MemoryCaps("lp2r1", 2, SIZE, hierarchy=FakeV1(v1_base)) as caps:
        for host in (0, 1):
            group = v1_base / "lp2r1" / f"h{host}"
            assert (group / "memory.limit_in_bytes").read_text() == str(SIZE)
            assert (group / "memory.memsw.limit_in_bytes").read_text() == str(SIZE)
        (caps.group(0) / "memory.oom_control").write_text(
            "oom_kill_disable 0\nunder_oom 0\noom_kill 1\n"
        )
        assert caps.oom_kills(0) == 1 and caps.oom_kills(1) == 0
    assert not (v1_base / "lp2r1").exists()


def test_v1_without_memsw_and_before_linux_4_13(v1_base):
    files = {k: v for k, v in V1_FILES.items() if k != "memory.memsw.limit_in_bytes"}
    files["memory.oom_control"] = "oom_kill_disable 0\nunder_oom 0\n"  # no kill counter yet
    with MemoryCaps("lp2r1", 1, SIZE, hierarchy=FakeV1(v1_base, files)) as caps:
        assert not (caps.group(0) / "memory.memsw.limit_in_bytes").exists()
        assert caps.oom_kills(0) == 0
        (caps.group(0) / "memory.failcnt").write_text("3\n")  # the limit was hit
        assert caps.oom_kills(0) == 1


def test_v1_base_without_the_memory_controller(tmp_path):
    with pytest.raises(ClusterError, match="memory cgroup controller is not available"):
        MemoryCaps("lp2r1", 1, SIZE, hierarchy=FakeV1(tmp_path)).create()


def test_out_of_memory_needs_sigkill_and_a_counted_kill(v2_root):
    with MemoryCaps("lp1r0", 2, SIZE, hierarchy=FakeV2(v2_root)) as caps:
        assert caps.out_of_memory(1, 1, "host 1", 128 + 9) is None  # a kill fault, not the cap
        (caps.group(1) / "memory.events").write_text("oom_kill 1\n")
        assert caps.out_of_memory(1, 1, "host 1", 1) is None  # a crash, not a kill
        oom = caps.out_of_memory(1, 1, "host 1", 128 + 9)
    assert oom == OutOfMemory(host=1, rank=1, label="host 1", limit_bytes=SIZE, kills=1)
    assert oom.describe() == (
        "host 1 ran out of memory: its 2 GB cap (--memory-per-host) was reached and the kernel "
        "killed rank 1"
    )


def test_the_join_wrapper_enters_the_group_then_runs_the_command(v2_root):
    with MemoryCaps("lp1r0", 2, SIZE, hierarchy=FakeV2(v2_root)) as caps:
        argv = caps.join_argv(1, ["sh", "-c", 'echo "ran as $$"'])
        done = subprocess.run(argv, capture_output=True, text=True, timeout=10)
        joined = (caps.group(1) / "cgroup.procs").read_text().strip()
        (caps.group(1) / "cgroup.procs").write_text("")  # the fake kernel's process has exited
    assert done.returncode == 0
    # the shell wrote its own pid and then became the command: same process
    assert done.stdout.strip() == f"ran as {joined}"


def test_a_group_that_cannot_be_joined_stops_before_the_command(v2_root, tmp_path):
    with MemoryCaps("lp1r0", 1, SIZE, hierarchy=FakeV2(v2_root)) as caps:
        argv = caps.join_argv(0, ["sh", "-c", "echo should not run"])
    done = subprocess.run(argv, capture_output=True, text=True, timeout=10)  # group removed
    assert done.returncode == memory_module.JOIN_FAILED_EXIT_CODE
    assert "cannot join the memory cgroup" in done.stderr and "should not run" not in done.stdout


def test_a_failed_setup_removes_what_it_made(v2_root):
    class FailsOnSecondHost(FakeV2):
        def limit(self, group, size):
            if group.name == "h1":
                raise ClusterError("cannot write memory.max")
            return super().limit(group, size)

    with pytest.raises(ClusterError, match=r"memory\.max"):
        MemoryCaps("lp1r0", 2, SIZE, hierarchy=FailsOnSecondHost(v2_root)).create()
    assert not (v2_root / "lp1r0").exists()


def test_a_busy_group_is_named_in_a_warning(v2_root, monkeypatch):
    monkeypatch.setattr(memory_module, "_REMOVE_WAIT_S", 0.2)
    caps = MemoryCaps("lp1r0", 1, SIZE, hierarchy=FakeV2(v2_root))
    caps.create()
    (caps.group(0) / "sub").mkdir()  # something the run did not make keeps it busy
    with pytest.warns(RuntimeWarning, match="memory cgroups not removed: .*h0"):
        caps.destroy()


def test_stale_groups_of_a_dead_owner_are_removed(v2_root):
    dead = 2**22 + 1  # above pid_max: no such process
    FakeV2(v2_root).make_group(v2_root / f"lp{dead:x}r0")
    FakeV2(v2_root).make_group(v2_root / f"lp{dead:x}r0" / "h0")
    FakeV2(v2_root).make_group(v2_root / f"lp{os.getpid():x}r7")
    assert remove_stale_groups(FakeV2(v2_root)) == [f"lp{dead:x}r0"]
    assert not (v2_root / f"lp{dead:x}r0").exists()
    assert (v2_root / f"lp{os.getpid():x}r7").exists()  # its owner, this process, lives


def _mountinfo(tmp_path, lines):
    path = tmp_path / "mountinfo"
    path.write_text("\n".join(lines) + "\n")
    return path


def test_detect_a_hybrid_system_takes_v1_memory_under_the_own_group(tmp_path):
    (tmp_path / "memory" / "jobs" / "mine").mkdir(parents=True)
    (tmp_path / "unified").mkdir()
    mountinfo = _mountinfo(
        tmp_path,
        [
            f"41 31 0:38 / {tmp_path}/unified rw,relatime - cgroup2 cgroup2 rw",
            f"35 31 0:32 / {tmp_path}/memory rw,relatime - cgroup cgroup rw,memory",
        ],
    )
    membership = tmp_path / "cgroup"
    membership.write_text("4:memory:/jobs/mine\n1:cpu:/\n0::/\n")
    hierarchy = detect_hierarchy(mountinfo, membership)
    assert isinstance(hierarchy, CgroupV1)
    assert hierarchy.base == tmp_path / "memory" / "jobs" / "mine"


def test_detect_a_container_bind_mount_takes_the_mount_itself(tmp_path):
    (tmp_path / "memory").mkdir()
    mountinfo = _mountinfo(
        tmp_path, [f"35 31 0:32 /docker/abc {tmp_path}/memory rw - cgroup cgroup rw,memory"]
    )
    membership = tmp_path / "cgroup"
    membership.write_text("4:memory:/docker/abc\n")
    assert detect_hierarchy(mountinfo, membership).base == tmp_path / "memory"


def test_detect_unified_v2_with_and_without_memory(tmp_path):
    root = tmp_path / "cg"
    root.mkdir()
    (root / "cgroup.controllers").write_text("cpu io memory pids\n")
    mountinfo = _mountinfo(tmp_path, [f"30 23 0:26 / {root} rw - cgroup2 cgroup2 rw,nsdelegate"])
    membership = tmp_path / "cgroup"
    membership.write_text("0::/user.slice/session-1.scope\n")
    hierarchy = detect_hierarchy(mountinfo, membership)
    assert isinstance(hierarchy, CgroupV2) and hierarchy.base == root
    (root / "cgroup.controllers").write_text("cpu io pids\n")
    with pytest.raises(
        ClusterError, match=r"memory cgroup controller is not available.*cpu io pids"
    ):
        detect_hierarchy(mountinfo, membership)
    empty = _mountinfo(tmp_path, ["22 1 0:21 / /proc rw - proc proc rw"])
    with pytest.raises(ClusterError, match="no cgroup filesystem is mounted"):
        detect_hierarchy(empty, membership)


def test_without_root_the_error_says_so(monkeypatch):
    monkeypatch.setattr(cgroups_module.os, "geteuid", lambda: 1000)
    with pytest.raises(ClusterError, match="--memory-per-host needs root"):
        check_memory_requirements()


def test_cli_rejects_a_bad_memory_size(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cluster_main(["--hosts", "2", "--memory-per-host", "2 gigs", "--", "true"])
    assert exit_info.value.code == 2
    assert "memory size '2 gigs' is not understood" in capsys.readouterr().err
