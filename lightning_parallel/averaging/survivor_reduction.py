"""Averaging rounds that go on without a lost replica: the reduction over the survivors.

:class:`SurvivorAllReduce` is a :class:`~lightning_parallel.averaging.reduction.Reduction`
whose sums run as agreed collectives of :class:`~lightning_parallel.comm.survivors.Survivors`
on its ``"rounds"`` lane: while every rank is in the run, through the reduction the user chose
(the flat allreduce, on its private group, or the host-shaped tree); after a loss, as a flat
allreduce over the survivors' group. A sum that a lost rank left unfinished on some survivors is
run again over the survivors, from the same inputs: every survivor then holds the same sums,
of ``count`` ranks, which :meth:`_SurvivorWork.wait` returns so that the caller divides by the
ranks that really took part (a round started before a loss may still hold the lost rank's
contribution, if every member finished it).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_parallel.averaging.quantized_gather import ROUNDS_LANE
from lightning_parallel.averaging.reduction import FlatAllReduce, Reduction
from lightning_parallel.comm.accounting import ring_allreduce_bytes
from lightning_parallel.comm.devices import to_group
from lightning_parallel.comm.survivors import Pending, Survivors
from lightning_parallel.comm.tree import TreeAllReduce

__all__: list[str] = []


class _SurvivorWork:
    """A sum in flight; :meth:`wait` writes it into the caller's tensors and returns ``count``."""

    def __init__(self, pending: Pending[list[Tensor]], tensors: Sequence[Tensor]) -> None:
        self._pending: Pending[list[Tensor]] | None = pending
        self._tensors = list(tensors)
        self.count: int | None = None

    def wait(self) -> int:
        if self._pending is not None:
            sums = self._pending.wait()
            with torch.no_grad():
                for tensor, total in zip(self._tensors, sums, strict=True):
                    tensor.copy_(total)
            self.count = len(self._pending.members)
            self._pending = None
        assert self.count is not None
        return self.count


class SurvivorAllReduce:
    """Sum tensors over the ranks still in the run (see the module docstring).

    Args:
        survivors: the run's agreed collectives; its ``"rounds"`` lane's first group must be
            ``first``'s (:func:`rounds_lane`).
        first: the reduction while no rank is lost (``FlatAllReduce`` or ``TreeAllReduce``).
    """

    def __init__(self, survivors: Survivors, first: Reduction) -> None:
        self.survivors = survivors
        self.first = first

    @property
    def world_size(self) -> int:
        """Ranks in the run now."""
        return len(self.survivors.members)

    def all_reduce(self, tensors: Sequence[Tensor], async_op: bool = False) -> _SurvivorWork:
        """Sum ``tensors`` over the survivors; the result is agreed (repeated after a loss)."""
        inputs = [tensor.detach() for tensor in tensors]

        def summed(group: Any, members: list[int]) -> list[Tensor]:
            copies = [tensor.clone() for tensor in inputs]  # a repeat starts from the inputs
            if isinstance(group, TreeAllReduce):
                group.all_reduce(copies).wait()
                return copies
            placed = [to_group(copy, group) for copy in copies]
            for buffer in placed:
                dist.all_reduce(buffer, group=group)
            return placed

        work = _SurvivorWork(self.survivors.run(ROUNDS_LANE, summed), tensors)
        if not async_op:
            work.wait()
        return work

    def bytes_sent(self, nbytes: float) -> float:
        """Bytes this rank sends for ``nbytes``: the first reduction's count, then a ring's."""
        if self.survivors.view.number == 0:
            return self.first.bytes_sent(nbytes)
        return ring_allreduce_bytes(nbytes, self.world_size)


def rounds_lane(first: Reduction) -> Any:
    """What the rounds lane runs on before any loss: the flat reduction's private group, or
    the tree itself (its own groups)."""
    if isinstance(first, FlatAllReduce):
        return first.group
    if isinstance(first, TreeAllReduce):
        return first
    raise TypeError(f"no lane for a reduction of type {type(first).__name__}")
