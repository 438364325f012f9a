"""Sum flat buffers over all ranks: a flat allreduce or the host-shaped tree of ``comm.tree``."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal, Protocol

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_parallel.comm.accounting import ring_allreduce_bytes
from lightning_parallel.comm.devices import copy_back, to_group
from lightning_parallel.comm.groups import new_group
from lightning_parallel.comm.tree import TreeAllReduce

__all__: list[str] = []

ReduceKind = Literal["flat", "tree"]
REDUCE_KINDS: tuple[str, ...] = ("flat", "tree")


class ReductionWork(Protocol):
    """A reduction in flight; ``wait()`` returns when the buffers hold the sums (and may return
    the number of ranks they sum, where that can be fewer than the reduction's world size:
    :func:`counted`)."""

    def wait(self) -> int | None: ...


class Reduction(Protocol):
    """Sums tensors in place over all ranks, blocking or asynchronously."""

    @property
    def world_size(self) -> int: ...

    def all_reduce(self, tensors: Sequence[Tensor], async_op: bool = False) -> ReductionWork: ...

    def bytes_sent(self, nbytes: float) -> float: ...


class _FlatWork:
    def __init__(self, works: list[dist.Work], placed: list[tuple[Tensor, Tensor]]) -> None:
        self._works = works
        self._placed = placed  # (buffer, the copy on the group's device) where they differ

    def wait(self) -> None:
        for work in self._works:
            work.wait()
        with torch.no_grad():
            for buffer, placed in self._placed:
                copy_back(buffer, placed)
        self._works, self._placed = [], []


class FlatAllReduce:
    """One ``all_reduce(SUM)`` per buffer over every rank, on a process group of its own.

    The group is private so that an asynchronous round in flight never interleaves with the
    collectives Lightning runs on the default group (barriers, metric syncs, checkpoints).
    Every rank must construct it at the same point of the program (``new_group`` is collective).
    """

    def __init__(self) -> None:
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                "FlatAllReduce needs an initialised default process group; call "
                "torch.distributed.init_process_group first"
            )
        self._world_size = dist.get_world_size()
        self.group = new_group(list(range(self._world_size)))

    @property
    def world_size(self) -> int:
        """Ranks taking part in the reduction."""
        return self._world_size

    def all_reduce(self, tensors: Sequence[Tensor], async_op: bool = False) -> _FlatWork:
        """Replace each tensor by its sum over all ranks; with ``async_op`` return at once."""
        works = []
        placements = []
        with torch.no_grad():
            for tensor in tensors:
                placed = to_group(tensor, self.group)  # comm.devices: the group's device
                work = dist.all_reduce(placed, group=self.group, async_op=async_op)
                if work is not None:
                    works.append(work)
                if placed is not tensor:
                    placements.append((tensor, placed))
        result = _FlatWork(works, placements)
        if not async_op:
            result.wait()
        return result

    def bytes_sent(self, nbytes: float) -> float:
        """Bytes this rank sends for a payload of ``nbytes`` (ring allreduce)."""
        return ring_allreduce_bytes(nbytes, self._world_size)


def counted(work: ReductionWork, default: int) -> int:
    """Wait for ``work``; the number of ranks its sums hold (``default`` unless it says)."""
    count = work.wait()
    return count if isinstance(count, int) else default


def build_reduction(kind: str, ranks_per_host: int | None = None) -> Reduction:
    """The reduction named ``kind`` (``"flat"`` or ``"tree"``) over the default group."""
    if kind == "flat":
        return FlatAllReduce()
    if kind == "tree":
        return TreeAllReduce(ranks_per_host=ranks_per_host)
    raise ValueError(f"reduce must be one of {', '.join(map(repr, REDUCE_KINDS))}; got {kind!r}")
