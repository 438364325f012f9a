"""Keep freed memory in the process: CPU training without a page fault per large tensor.

On Linux with glibc, ``malloc`` serves a request above its *mmap threshold* with a fresh
``mmap`` and gives it back with ``munmap`` on ``free``: every page of such a block faults on
first touch and is zeroed by the kernel, each time the block is allocated again. The threshold
starts at 128 KiB and rises by itself to the size of the largest mmapped block freed so far
(up to 32 MiB), and memory at the heap's top above twice that is handed back (trimmed) and
faults in again when the heap grows. So whether a training step's temporary tensors fault,
unmapped or trimmed, depends on what the process freed before:
on the same run and the same numbers, GroPipe's stage holding torchvision ResNet-18's first
``layer4`` block (micro-batches of 8 at 32 pixels) took 17-21 ms a micro-batch in 11 of 13
launches and 31-40 ms in the other two. A convolution of 512 to 512 channels on a 1x1 map
(batch 8, one thread) does most of its work copying the weights to and from oneDNN's blocked
layout: its forward and backward took 11-13 ms with 4,576 page faults a call at glibc's
defaults (after three calls: the faults do not go away by themselves), and 3.8-4.5 ms with
none with the two settings below.

:func:`hold_freed_memory` fixes both settings for the rest of the process (``mallopt``):

- ``M_MMAP_THRESHOLD`` at 32 MiB, glibc's largest: blocks under 32 MiB come from the heap
  and are reused;
- ``M_TRIM_THRESHOLD`` at 256 MiB: the heap keeps up to 256 MiB of freed memory at its top
  instead of handing it back and faulting it in again.

A block of 32 MiB or more is still mapped afresh each time (``vgg_mini``'s 2048 x 4096 layer's
32 MiB gradient: 8,193 page faults each time it is made).

Setting one alone turns the automatic adjustment off and is worse than neither (9,220 faults a
call in the measurement above). The same two settings from the shell, for processes not yet
started: ``MALLOC_MMAP_THRESHOLD_=33554432 MALLOC_TRIM_THRESHOLD_=268435456``. The cost is
memory: a process keeps what it freed (up to the trim threshold) for its next allocation.

Accelerators are unaffected (their memory has its own caching allocator); other C libraries
(musl, macOS) have no ``mallopt`` and are left as they are. ``lightning-parallel bench`` runs
every rank and the plan's profile this way, so that a profile and a run are timed alike.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os

__all__ = ["hold_freed_memory"]

#: how a process's C library is run: ``held`` (:func:`hold_freed_memory`) or ``system``
#: (the library's defaults); the bench's and the plan's ``--malloc``
MALLOC_MODES = ("held", "system")

#: glibc's ``mallopt`` parameter numbers (``malloc.h``)
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3

#: the largest mmap threshold glibc accepts on a 64-bit system
MMAP_THRESHOLD_BYTES = 32 * 1024 * 1024
TRIM_THRESHOLD_BYTES = 256 * 1024 * 1024

#: the same settings as environment variables, for a process about to be started
ENVIRONMENT = {
    "MALLOC_MMAP_THRESHOLD_": str(MMAP_THRESHOLD_BYTES),
    "MALLOC_TRIM_THRESHOLD_": str(TRIM_THRESHOLD_BYTES),
}

#: what ``lightning-parallel plan`` prints under a profile timed this way
HELD_NOTE = (
    "compute was timed with freed memory held (lightning_parallel.hold_freed_memory); on CPU, "
    "call it at the top of your training script, or start it with "
    + " ".join(f"{name}={value}" for name, value in ENVIRONMENT.items())
    + ", to train as planned"
)


def hold_freed_memory() -> bool:
    """Set glibc's mmap and trim thresholds as the module docstring says, for this process.

    Returns:
        Whether both were set: ``False`` where the C library has no ``mallopt`` (not glibc)
        or refused the mmap threshold (then neither is changed).
    """
    name = ctypes.util.find_library("c")
    if name is None or os.name != "posix":
        return False
    try:
        mallopt = ctypes.CDLL(name).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    # setting either one ends glibc's own adjustment of both, and one alone is worse than
    # neither: the trim threshold only once the mmap threshold was taken (a 32-bit glibc
    # refuses 32 MiB, and then nothing is changed)
    if mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) != 1:
        return False
    return mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES) == 1
