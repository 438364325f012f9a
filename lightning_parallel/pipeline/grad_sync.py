"""Partition-based delayed allreduce: a stage's gradients averaged across groups as one bucket.

GroPipe replicates each pipeline (a *group* of ``p`` stages) ``g`` times and averages gradients
across the replicas of each stage. Instead of waiting for the whole pipeline to drain (as
DeepSpeed's pipeline engine does), each stage starts its allreduce as soon as its own last
micro-batch backward is done, so that it overlaps the backward still running on the stages
before it:

1. :meth:`PartitionGradientSync.launch`, right after the stage's last backward: flatten the
   stage's gradients into one bucket and start ``all_reduce(bucket, group=data_parallel)``
   asynchronously; a completion callback timestamps the end of the transfer;
2. the stage goes on (forwarding the last gradients to the previous stage, the end-of-step
   bookkeeping of the runtime);
3. :meth:`PartitionGradientSync.finish`, when the gradients are needed: wait, divide by ``g``,
   copy back into ``.grad``.

Telemetry: ``duration`` is launch to completion; ``exposed`` is the time :meth:`finish`
blocked. Called after the whole group's pipeline has drained (the runtime's end-of-step
synchronization), ``exposed`` is what the allreduce adds to the step, and
``duration − exposed`` is hidden behind other stages' backward.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from lightning_parallel.comm.devices import to_group

__all__: list[str] = []


@dataclass
class SyncTiming:
    """Seconds of one stage's gradient allreduce in one step."""

    duration: float = 0.0
    exposed: float = 0.0
    bytes: int = 0
    launched_at: float = 0.0  # time.perf_counter() at launch

    @property
    def hidden(self) -> float:
        return max(self.duration - self.exposed, 0.0)


class PartitionGradientSync:
    """Average one stage's gradients across data-parallel groups, overlapped with backward.

    Args:
        parameters: the stage's parameters.
        group: the data-parallel process group (this stage in every group).
        group_size: number of groups ``g`` (the size of ``group``).
    """

    def __init__(
        self,
        parameters: Sequence[torch.nn.Parameter],
        group: dist.ProcessGroup | None,
        group_size: int,
    ) -> None:
        if group_size < 1:
            raise ValueError(f"group_size must be at least 1, got {group_size}")
        self.parameters = [p for p in parameters if p.requires_grad]
        self.group = group
        self.group_size = group_size
        self._bucket: torch.Tensor | None = None
        self._work: dist.Work | None = None
        self._launched_at = 0.0
        self._completed_at: list[float] = []
        self.last = SyncTiming()

    @property
    def active(self) -> bool:
        return self.group_size > 1

    def launch(self) -> None:
        """Start averaging the current gradients (no-op with one group)."""
        if not self.active or self._work is not None:
            return
        grads = [p.grad for p in self.parameters if p.grad is not None]
        if not grads:
            self._bucket = None
            return
        bucket = to_group(torch.cat([g.reshape(-1) for g in grads]), self.group)
        self._bucket = bucket
        self._launched_at = time.perf_counter()
        self._completed_at = []
        work = dist.all_reduce(bucket, group=self.group, async_op=True)
        assert work is not None
        self._work = work
        completed = self._completed_at
        work.get_future().then(lambda _future: completed.append(time.perf_counter()))

    def finish(self) -> SyncTiming:
        """Wait for the allreduce, write the averaged gradients back; returns the timing."""
        if self._work is None or self._bucket is None:
            self.last = SyncTiming()
            return self.last
        start = time.perf_counter()
        self._work.wait()
        end = time.perf_counter()
        bucket = self._bucket.div_(self.group_size)
        offset = 0
        for parameter in self.parameters:
            if parameter.grad is None:
                continue
            count = parameter.grad.numel()
            parameter.grad.copy_(bucket[offset : offset + count].view_as(parameter.grad))
            offset += count
        completed = self._completed_at[0] if self._completed_at else end
        self.last = SyncTiming(
            duration=max(completed, start) - self._launched_at,
            exposed=max(min(completed, end) - start, 0.0),
            bytes=bucket.numel() * bucket.element_size(),
            launched_at=self._launched_at,
        )
        self._work, self._bucket = None, None
        return self.last
