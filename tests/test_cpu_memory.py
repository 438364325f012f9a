"""``hold_freed_memory``: a convolution's weight copies stop faulting in on every call."""

from __future__ import annotations

import ctypes
import ctypes.util
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lightning_parallel import cpu_memory
from lightning_parallel.bench.runner import BenchConfig, _worker_command

GLIBC = platform.libc_ver()[0] == "glibc"
needs_glibc_and_onednn = pytest.mark.skipif(
    not GLIBC or not torch.backends.mkldnn.is_available(),
    reason="glibc's mallopt, and oneDNN's weight copies to fault on",
)

# oneDNN copies a 512 -> 512, 3x3 convolution's weights (9.4 MB) to its blocked layout in the
# forward and the backward; on a 1x1 map that copying is most of the call
PROGRAM = """
import json, resource, sys
import torch
if sys.argv[1] == "held":
    from lightning_parallel.cpu_memory import hold_freed_memory
    assert hold_freed_memory()
torch.set_num_threads(1)
conv = torch.nn.Conv2d(512, 512, 3, padding=1, bias=False)
x = torch.randn(8, 512, 1, 1, requires_grad=True)
for _ in range(3):
    conv(x).sum().backward()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(10):
    conv(x).sum().backward()
after = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
print(json.dumps((after - before) / 10))
"""


def _faults_per_call(mode: str, variables: dict[str, str] | None = None) -> float:
    environment = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    environment.update(variables or {})
    done = subprocess.run(
        [sys.executable, "-c", PROGRAM, mode],
        capture_output=True,
        text=True,
        env=environment,
        check=True,
        timeout=120,
    )
    return float(json.loads(done.stdout.strip().splitlines()[-1]))


@needs_glibc_and_onednn
def test_held_freed_memory_ends_the_page_faults_of_a_convolution_s_weight_copies() -> None:
    system, held = _faults_per_call("system"), _faults_per_call("held")
    # at glibc's defaults each copy's 9.4 MB is mapped afresh: 2,300 pages a copy
    assert system > 2000
    assert held < 50


def test_without_glibc_s_mallopt_nothing_is_changed(monkeypatch) -> None:
    monkeypatch.setattr(ctypes.util, "find_library", lambda name: None)
    assert cpu_memory.hold_freed_memory() is False


class _Library:
    """A C library whose ``mallopt`` refuses the mmap threshold (as a 32-bit glibc refuses
    32 MiB) and records every call."""

    def __init__(self, name: str) -> None:
        self.calls: list[tuple[int, int]] = []
        library = self

        def mallopt(parameter: int, value: int) -> int:
            library.calls.append((parameter, value))
            return 0 if parameter == cpu_memory.M_MMAP_THRESHOLD else 1

        self.mallopt = mallopt


def test_a_refused_mmap_threshold_leaves_the_trim_threshold_alone(monkeypatch) -> None:
    # one setting alone turns glibc's adjustment off and is worse than neither
    libraries: list[_Library] = []
    monkeypatch.setattr(ctypes.util, "find_library", lambda name: "libc.so.6")
    monkeypatch.setattr(
        ctypes, "CDLL", lambda name: libraries.append(_Library(name)) or libraries[-1]
    )
    assert cpu_memory.hold_freed_memory() is False
    assert libraries[0].calls == [(cpu_memory.M_MMAP_THRESHOLD, cpu_memory.MMAP_THRESHOLD_BYTES)]


def test_the_bench_s_ranks_hold_freed_memory_unless_told_otherwise() -> None:
    held = _worker_command("ddp", BenchConfig(), Path("run.json"))
    assert held[held.index("--malloc") + 1] == "held"
    system = _worker_command("ddp", BenchConfig(malloc="system"), Path("run.json"))
    assert system[system.index("--malloc") + 1] == "system"
    with pytest.raises(ValueError, match="malloc must be one of held, system"):
        BenchConfig(malloc="jemalloc").validate()


@needs_glibc_and_onednn
def test_the_shell_s_variables_hold_freed_memory_as_the_call_does() -> None:
    assert _faults_per_call("system", cpu_memory.ENVIRONMENT) < 50
    # one of the two alone turns glibc's own adjustment off and is no better
    mapped_only = {"MALLOC_MMAP_THRESHOLD_": cpu_memory.ENVIRONMENT["MALLOC_MMAP_THRESHOLD_"]}
    assert _faults_per_call("system", mapped_only) > 2000
