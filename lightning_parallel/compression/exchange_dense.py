"""The dense route of :class:`~lightning_parallel.compression.HyloExchange`, kernels included.

``dense`` layers (small layers, biases, norms) and the kernels that ``kernel`` layers
(convolutions, :class:`~lightning_parallel.compression.KernelTopK`) select travel in one fused
allreduce, as DDP sends a bucket:

1. ``send``: every rank computes the per-kernel norms of its ``p = g + e`` and the norms of all
   kernel layers are allreduced in one buffer (one ``importance_dtype`` value per kernel);
2. ``relay``: every rank selects the same top kernels from the summed norms and leaves the
   others in its residual ``e``; the dense layers (first joined by what they kept while they
   were compressed) and the selected kernels' values are fused, divided by ``W`` (before the
   sum, as torch's allreduce hook, so that no compression equals DDP bit for bit) and
   allreduced;
3. ``receive``: the dense layers are copied back, and each kernel layer is zero but for its
   selected kernels' averages.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_parallel.comm.accounting import ring_allreduce_bytes
from lightning_parallel.comm.devices import to_group
from lightning_parallel.compression.exchange_residuals import flush_residuals
from lightning_parallel.compression.exchange_step import (
    ExchangeRoute,
    ExchangeStep,
    LayerGradient,
)
from lightning_parallel.compression.kernel_topk import KernelTopK

__all__: list[str] = []


class DenseRoute(ExchangeRoute):
    """One step's dense layers (:attr:`layers`) and kernel layers (:attr:`kernels`)."""

    def __init__(
        self,
        step: ExchangeStep,
        layers: list[LayerGradient],
        kernels: list[LayerGradient],
        importance_dtype: torch.dtype,
    ) -> None:
        super().__init__(step, layers)
        self.kernels = kernels
        self.importance_dtype = importance_dtype
        self._compensated: list[Tensor] = []  # each kernel layer's p = g + e (its residual)
        self._norms: list[Tensor] = []  # each kernel layer's local norms
        self._summed: Tensor | None = None  # the allreduced norms of all kernel layers
        self._selections: list[tuple[LayerGradient, Tensor, torch.Size]] = []
        self._fused: Tensor | None = None  # the dense allreduce's buffer
        self._works: list[Any] = []

    def send(self) -> list[Any]:
        """Round 1: allreduce the kernel layers' norms."""
        if not self.kernels:
            return []
        step, clock = self.step, self.step.clock
        for layer in self.kernels:
            clock.start()
            codec = layer.plan.codec
            assert isinstance(codec, KernelTopK)
            p = step.memory.compensate_(layer.plan.name, layer.gradient)
            self._compensated.append(p)
            self._norms.append(codec.importance(p.view(layer.plan.shape)))
            clock.lap(layer.plan.name, "encode")
        summed = to_group(torch.cat(self._norms).to(self.importance_dtype), step.group)
        work = dist.all_reduce(summed, async_op=True, group=step.group)
        for layer, norm in zip(self.kernels, self._norms):
            clock.reports[layer.plan.name].bytes_sent += ring_allreduce_bytes(
                norm.numel() * summed.element_size(), step.world
            )
        self._summed = summed
        return [work]

    def relay(self) -> None:
        """Round 2: select the kernels; allreduce the dense layers and the selected values."""
        step, clock, world = self.step, self.step.clock, self.step.world
        for layer in self.layers:
            flush_residuals(step.memory, step.server_memory, layer, world, step.rank)
        pieces: list[Tensor] = [layer.gradient for layer in self.layers]
        if self._summed is not None:
            global_norms = self._summed.float().split([n.numel() for n in self._norms])
            for layer, p, importance in zip(self.kernels, self._compensated, global_norms):
                clock.start()
                codec = layer.plan.codec
                assert isinstance(codec, KernelTopK)
                indices = codec.select(importance, layer.plan.shape)
                kernels = p.view(codec.kernel_layout(layer.plan.shape))
                values = kernels.index_select(0, indices)
                kernels.index_fill_(0, indices, 0.0)  # the residual: what was not sent
                pieces.append(values.reshape(-1))
                self._selections.append((layer, indices, values.shape))
                clock.reports[layer.plan.name].bytes_sent += ring_allreduce_bytes(
                    values.numel() * values.element_size(), world
                )
                clock.lap(layer.plan.name, "encode")
        if not pieces:
            return
        # Divide before summing, as torch's allreduce hook does, so that no compression equals
        # DDP bit for bit.
        fused = to_group(torch.cat(pieces).div_(world), step.group)
        self._works.append(dist.all_reduce(fused, async_op=True, group=step.group))
        for layer in self.layers:
            clock.reports[layer.plan.name].bytes_sent += ring_allreduce_bytes(
                layer.gradient.numel() * fused.element_size(), world
            )
        self._fused = fused

    def receive(self) -> None:
        """Round 3: wait for the allreduce; write the dense layers and the selected kernels."""
        clock = self.step.clock
        clock.wait(self._works)
        if self._fused is None:
            return
        fused = self._fused
        offset = 0
        for layer in self.layers:
            numel = layer.gradient.numel()
            layer.gradient.copy_(fused[offset : offset + numel])
            offset += numel
        for layer, indices, shape in self._selections:
            clock.start()
            count = shape[0] * shape[1]
            averaged = fused[offset : offset + count].view(shape)
            offset += count
            layer.gradient.zero_()
            layer.gradient.view(-1, shape[1]).index_copy_(0, indices, averaged)
            clock.lap(layer.plan.name, "decode")
