"""The low-rank route of :class:`~lightning_parallel.compression.HyloExchange`.

Every ``low_rank`` layer (:class:`~lightning_parallel.compression.low_rank.LowRank`) of a step
is exchanged in the step's three rounds, all its layers' factors fused in one allreduce per
round:

1. ``send``: ``M = g + e`` (the residual storage, viewed ``rows x cols``), ``P = M Q`` from the
   layer's warm-start ``Q``; the ``P`` of every layer are allreduced (summed);
2. ``relay``: every rank orthonormalizes the same summed ``P``, computes ``Q = M^T P`` from its
   own ``M``, and the ``Q`` (divided by ``W``) are allreduced;
3. ``receive``: the gradient becomes ``P Q^T`` (the same on every rank: the projection of the
   averaged gradient on the span of ``P``), the residual ``M - P Q^T`` stays in the error
   feedback, and the averaged ``Q`` is the layer's next warm start.

Each rank sends the bytes of an allreduce of ``(rows + cols) r`` values per layer.

On the CPU the two steps that pass over ``M`` twice (``M = g + e`` then ``P = M Q``; the
gradient ``P Q^T`` then ``M - P Q^T``) go block of rows by block of rows
(:func:`~lightning_parallel.compression.low_rank.row_blocks`), so that the second pass reads the
block from cache: the same values for less processor time (on ``vgg_mini``, whose two large
layers go low rank, the exchange thread took 83-91 ms a step against 107-121 ms).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_parallel.comm.accounting import ring_allreduce_bytes
from lightning_parallel.comm.devices import to_group
from lightning_parallel.compression.error_feedback import ErrorFeedback
from lightning_parallel.compression.exchange_residuals import fold_server_residuals
from lightning_parallel.compression.exchange_step import ExchangeRoute, LayerGradient
from lightning_parallel.compression.low_rank import (
    LowRank,
    matrix_shape,
    orthonormalize,
    row_blocks,
)

__all__: list[str] = []


@dataclass
class _Factors:
    """One layer in flight: its compensated matrix and its factors."""

    layer: LayerGradient
    matrix: Tensor  # rows x cols view of the residual storage, holding M = g + e
    p: Tensor  # rows x r: this rank's, then the orthonormalized sum

    @property
    def codec(self) -> LowRank:
        """The layer's codec."""
        codec = self.layer.plan.codec
        assert isinstance(codec, LowRank)
        return codec


class LowRankRoute(ExchangeRoute):
    """One step's low-rank layers: ``P`` summed in round 1, ``Q`` averaged in round 2."""

    def __init__(self, step: Any, layers: list[LayerGradient]) -> None:
        super().__init__(step, layers)
        self._factors: list[_Factors] = []
        self._fused: Tensor | None = None
        self._work: Any = None

    def _allreduce(self, parts: list[Tensor], divide: bool) -> list[Any]:
        step = self.step
        fused = torch.cat([part.reshape(-1) for part in parts])
        if divide:
            fused.div_(step.world)  # before the sum, as DDP's allreduce hook
        fused = to_group(fused, step.group)
        for factors, part in zip(self._factors, parts):
            name = factors.layer.plan.name
            step.clock.reports[name].bytes_sent += ring_allreduce_bytes(
                part.numel() * fused.element_size(), step.world
            )
        self._fused = fused
        self._work = dist.all_reduce(fused, async_op=True, group=step.group)
        return [self._work]

    def _split(self, columns: str) -> list[Tensor]:
        """The fused buffer cut back into one ``(rows or cols) x r`` factor per layer."""
        assert self._fused is not None
        fused = self._fused.to(self.layers[0].gradient.device)
        out, offset = [], 0
        for factors in self._factors:
            rows, cols = matrix_shape(factors.layer.plan.shape)
            length = rows if columns == "p" else cols
            rank = factors.p.shape[1]
            out.append(fused[offset : offset + length * rank].view(length, rank))
            offset += length * rank
        return out

    def send(self) -> list[Any]:
        """Round 1: ``P = M Q`` for every layer; allreduce them (summed)."""
        if not self.layers:
            return []
        step, clock = self.step, self.step.clock
        for layer in self.layers:
            clock.start()
            name, shape = layer.plan.name, layer.plan.shape
            codec = layer.plan.codec
            assert isinstance(codec, LowRank)
            # what the layer kept in the two-phase 2-bit exchange joins its gradient
            fold_server_residuals(step.server_memory, layer, step.world, step.rank, keep=())
            matrix, p = _compensate_and_project(
                step.memory, layer, codec.warm_start(name, shape, layer.gradient)
            )
            self._factors.append(_Factors(layer, matrix, p))
            clock.lap(name, "encode")
        return self._allreduce([factors.p for factors in self._factors], divide=False)

    def relay(self) -> None:
        """Round 2: orthonormalize the summed ``P``; allreduce ``Q = M^T P`` (averaged)."""
        if not self._factors:
            return
        clock = self.step.clock
        qs = []
        for factors, summed in zip(self._factors, self._split("p")):
            clock.start()
            factors.p = orthonormalize(summed)
            # (P^T M)^T: the same product, 18x faster on CPU than M^T P (a transposed read)
            qs.append((factors.p.t() @ factors.matrix).t())
            clock.lap(factors.layer.plan.name, "encode")
        self._allreduce(qs, divide=True)

    def receive(self) -> None:
        """Round 3: gradient ``P Q^T``, residual ``M - P Q^T``, next warm start ``Q``."""
        if not self._factors:
            return
        clock = self.step.clock
        clock.wait([self._work])
        for factors, averaged in zip(self._factors, self._split("q")):
            clock.start()
            layer = factors.layer
            estimate = layer.gradient.view(factors.matrix.shape)
            q_t = averaged.t().contiguous()
            for rows in _blocks(factors.matrix):  # the product, then the residual, per block
                torch.mm(factors.p[rows], q_t, out=estimate[rows])
                factors.matrix[rows].sub_(estimate[rows])
            factors.codec.keep(layer.plan.name, averaged)
            clock.lap(layer.plan.name, "decode")


def _blocks(matrix: Tensor) -> list[slice]:
    rows, cols = matrix.shape
    return row_blocks(rows, cols, matrix.element_size(), matrix.device)


def _compensate_and_project(
    memory: ErrorFeedback, layer: LayerGradient, q: Tensor
) -> tuple[Tensor, Tensor]:
    """``M = g + e`` in the residual storage and ``P = M Q``, block of rows by block of rows
    (:func:`~lightning_parallel.compression.low_rank.row_blocks`): each block's product reads
    it while the residual update has left it in cache. Returns ``M`` (``rows x cols``) and
    ``P``."""
    name = layer.plan.name
    rows, cols = matrix_shape(layer.plan.shape)
    gradient = layer.gradient.view(rows, cols)
    q_t = q.t().contiguous()
    p_t = torch.empty(q_t.shape[0], rows, dtype=gradient.dtype, device=gradient.device)
    for block in _blocks(gradient):
        part = slice(block.start * cols, block.stop * cols)
        matrix = memory.compensate_(name, layer.gradient, part).view(-1, cols)
        # (Q^T M^T)^T: the same product as M Q, 2.2x faster on one CPU thread (4096 x 2048)
        torch.mm(q_t, matrix.t(), out=p_t[:, block])
    residual = memory.residual(name)
    assert residual is not None
    return residual.view(rows, cols), p_t.t()
