"""Weights that several stages use: one copy per stage, their gradients summed every step.

Language models tie the input embedding and the output head (GPT-2, BERT): the first stage
looks tokens up in the matrix and the last stage multiplies by it. A pipeline cannot keep one
tensor on two ranks, so, as DeepSpeed's ``TiedLayerSpec`` and Megatron's embedding group do,
every stage that uses a tied tensor holds its own copy and the copies stay equal:

1. at assembly the copies start equal: broadcast from the first stage that uses the tensor
   to the others (:meth:`TiedWeights.synchronize`; a stage materialized from ``meta`` has
   its own random values until then);
2. every step, after each stage's gradient is complete (and averaged across data-parallel
   groups), the copies' gradients are **summed** over the stages that hold them
   (:meth:`TiedWeights.sum_gradients`): the gradient of a shared tensor is the sum of the
   gradients of its uses, which is what one device computes;
3. the optimizers of those stages then apply the same update to the same value with the same
   state, so the copies stay equal without another transfer;
4. the whole model's gradient norm counts the tensor once (:meth:`TiedWeights.counted`: on the
   first stage that holds it), and a checkpoint holds it once under each of its names.

The process group of each set of stages holding a tied tensor is created at assembly by every
rank (``new_group`` is collective), one per pipeline.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_parallel.comm.devices import broadcast_, to_group
from lightning_parallel.comm.groups import new_group
from lightning_parallel.pipeline.topology import PipelineTopology

__all__: list[str] = []


def tied_stages(stage_tensors: Sequence[Sequence[Tensor]]) -> dict[int, list[int]]:
    """``id(tensor) -> the stages that use it`` for every tensor used by more than one stage,
    from each stage's tensors."""
    where: dict[int, list[int]] = {}
    for stage, tensors in enumerate(stage_tensors):
        for tensor in tensors:
            stages = where.setdefault(id(tensor), [])
            if stage not in stages:
                stages.append(stage)
    return {key: stages for key, stages in where.items() if len(stages) > 1}


def tied_layers(layers: Sequence[Any]) -> tuple[tuple[int, tuple[int, ...]], ...]:
    """Each tensor that several of ``layers`` (modules) use: its bytes and those layers'
    indices, as the partitioner takes them (:attr:`~.profile.ModelProfile.tied`)."""
    from lightning_parallel.pipeline.ownership import stage_tensors

    per_layer = [stage_tensors(layer) for layer in layers]
    size = {id(t): t.numel() * t.element_size() for tensors in per_layer for t in tensors}
    return tuple((size[key], tuple(where)) for key, where in tied_stages(per_layer).items())


class TiedWeights:
    """This rank's share of the tied tensors: which it holds, with whom, over which group.

    Args:
        tied: ``name -> the stages that use it`` for every tied tensor of the model.
        held: ``name -> tensor`` of this rank's tied tensors (a subset of ``tied``).
        topology: the placement; ``rank`` this rank's global rank.

    Every rank must construct it at the same point (it creates process groups).
    """

    def __init__(
        self,
        tied: Mapping[str, Sequence[int]],
        held: Mapping[str, Tensor],
        topology: PipelineTopology,
        rank: int,
    ) -> None:
        self.names = sorted(tied)
        stage, group_index = topology.stage_of(rank), topology.group_of(rank)
        self._entries: list[tuple[Tensor, dist.ProcessGroup | None, int]] = []
        self._not_counted: set[int] = set()
        groups: dict[tuple[int, ...], dict[int, dist.ProcessGroup | None]] = {}
        for name in self.names:
            stages = tuple(sorted(tied[name]))
            if stages not in groups:  # one group per set of stages and pipeline, made by all
                groups[stages] = {}
                for g in range(topology.groups):
                    ranks = [topology.rank(g, s) for s in stages]
                    made = new_group(ranks) if dist.is_initialized() else None
                    groups[stages][g] = made
            if stage in stages and name in held:
                source = topology.rank(group_index, stages[0])
                self._entries.append((held[name], groups[stages][group_index], source))
                if stage != stages[0]:
                    self._not_counted.add(id(held[name]))

    def __bool__(self) -> bool:
        return bool(self._entries)

    @torch.no_grad()
    def synchronize(self) -> None:
        """Make every copy equal to the first stage's (at assembly)."""
        for tensor, group, source in self._entries:
            if group is not None:
                broadcast_(tensor, source, group)

    @torch.no_grad()
    def sum_gradients(self) -> None:
        """Sum each tied tensor's gradient over the stages that hold it (a missing gradient
        counts as zero)."""
        for tensor, group, _ in self._entries:
            if group is None:
                continue
            if tensor.grad is None:
                tensor.grad = torch.zeros_like(tensor)
            total = to_group(tensor.grad.detach().clone(), group)
            dist.all_reduce(total, group=group)
            tensor.grad.copy_(total)

    def delayed(self, lag: int, rank: int) -> DelayedTiedSum:
        """The exchange a pipeline without flushes uses (:class:`DelayedTiedSum`)."""
        return DelayedTiedSum(self._entries, lag, rank)

    def counted(self, tensor: Tensor) -> bool:
        """Whether this rank counts ``tensor`` in the whole model's gradient norm (a tied
        tensor counts on the first stage that holds it only)."""
        return id(tensor) not in self._not_counted


class DelayedTiedSum:
    """Tied tensors in a pipeline without flushes (SpecTrain): one owner, stale copies.

    Each stage updates once per micro-batch, but stage 0 reaches its update ``v`` about ``p``
    micro-batches after the last stage, in another Lightning step, so a blocking exchange at
    update ``v`` would make the last stage wait across a step boundary. And the stages' learning
    rates differ (SpecTrain scales a stale stage's), so equal gradients would not keep copies
    equal. Instead the first stage that holds the tensor *owns* it and the others hold a copy
    (:meth:`exchange`, at every holder's update ``v``):

    1. every holder starts an asynchronous sum of its gradient over the holders (after
       clipping); the owner starts an asynchronous broadcast of its current value;
    2. the owner trains the tensor with the sum started ``lag`` updates before (none for the
       first ``lag`` updates): the gradient of both uses, ``lag`` updates old;
    3. a copy is not trained (its gradient is dropped): it takes the owner's value broadcast
       ``lag`` updates before, so it is ``lag + 1`` updates stale, as SpecTrain's stale
       stages are.

    With ``lag >= p`` no wait crosses a step: when the last stage makes update ``v``, stage 0
    has run the backward of micro-batch ``v - p`` and started that update's exchange.
    :meth:`settle` (at a drain, where every rank is at the same point) makes the copies equal
    to the owner.
    """

    def __init__(
        self, entries: Sequence[tuple[Tensor, dist.ProcessGroup | None, int]], lag: int, rank: int
    ) -> None:
        if lag < 1:
            raise ValueError(f"lag must be at least 1, got {lag}")
        self.lag = lag
        self._entries = [(t, g, source == rank, source) for t, g, source in entries if g]
        # per update: (sum in flight, its buffer, broadcast in flight, its buffer); the
        # broadcast is None once settle() superseded its value
        self._pending: list[list[tuple[Any, Tensor, Any, Tensor | None]]] = []

    @torch.no_grad()
    def exchange(self) -> None:
        """At this holder's next update (see the class docstring)."""
        if not self._entries:
            return
        started: list[tuple[Any, Tensor, Any, Tensor | None]] = []
        for tensor, group, _, source in self._entries:
            own = tensor.grad if tensor.grad is not None else torch.zeros_like(tensor)
            total = to_group(own.detach().clone(), group)
            summing = dist.all_reduce(total, group=group, async_op=True)
            current = to_group(tensor.detach().clone(), group)
            sending = dist.broadcast(current, source, group=group, async_op=True)
            started.append((summing, total, sending, current))
        self._pending.append(started)
        due = self._pending.pop(0) if len(self._pending) > self.lag else None
        for index, (tensor, _, owner, _) in enumerate(self._entries):
            tensor.grad = None  # a copy is not trained; the owner gets the due sum
            if due is None:
                continue
            summing, total, sending, value = due[index]
            if owner:
                summing.wait()
                tensor.grad = total.to(tensor.device).view_as(tensor)
            elif value is not None:
                sending.wait()
                tensor.copy_(value.to(tensor.device).view_as(tensor))

    @torch.no_grad()
    def settle(self) -> None:
        """Complete the exchanges in flight and make every copy the owner's value now
        (collective over the holders: at a drain)."""
        for started in self._pending:  # the sums stay due; the stale values are superseded
            for index, (summing, total, sending, _) in enumerate(started):
                summing.wait()
                if sending is not None:
                    sending.wait()
                started[index] = (summing, total, None, None)
        for tensor, group, _, source in self._entries:
            broadcast_(tensor, source, group)
