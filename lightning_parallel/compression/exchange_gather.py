"""The gather route of :class:`~lightning_parallel.compression.HyloExchange`: codes allgathered.

Peer codecs (top-k, QSGD, TernGrad, signSGD) and 2-bit codes where they are allgathered (at
``W = 2``, or with ``two_bit_exchange="allgather"``) cannot be summed on the wire:

1. ``send``: every rank encodes its ``p = g + e`` piece after piece (the residual ``e`` keeps
   what was not sent); the payloads of a message's pieces are laid end to end in one byte
   buffer, each segment 8-byte aligned so that it can be viewed as any dtype, and the message
   is allgathered as soon as it is full;
2. ``relay``: as each message arrives, every rank decodes every rank's payloads of its pieces,
   sums them and divides by ``W``;
3. ``receive``: nothing is left.

Bytes per rank grow with ``W``, as in GRACE's allgather communicator.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_parallel.comm.devices import empty_like, to_group
from lightning_parallel.compression.codec import Encoded
from lightning_parallel.compression.exchange_step import (
    Batches,
    LayerGradient,
    MessageRoute,
    part_of,
)

__all__: list[str] = []

_ALIGN = 8  # bytes: every payload segment starts aligned so it can be viewed as any dtype

_Layout = list[tuple[int, torch.dtype, tuple[int, ...]]]
_Piece = tuple[LayerGradient, slice | None, Encoded]


def _to_bytes(tensors: list[Tensor]) -> tuple[Tensor, _Layout]:
    """One ``uint8`` buffer of ``tensors`` (each segment 8-byte aligned) and its layout."""
    segments: list[Tensor] = []
    layout: _Layout = []
    offset = 0
    for tensor in tensors:
        raw = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
        padding = -raw.numel() % _ALIGN
        segments.append(raw)
        if padding:
            segments.append(torch.zeros(padding, dtype=torch.uint8, device=raw.device))
        layout.append((offset, tensor.dtype, tuple(tensor.shape)))
        offset += raw.numel() + padding
    return torch.cat(segments), layout


def _from_bytes(buffer: Tensor, layout: _Layout) -> list[Tensor]:
    """Inverse of :func:`_to_bytes` for one rank's buffer."""
    tensors = []
    for offset, dtype, shape in layout:
        nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        tensors.append(buffer[offset : offset + nbytes].view(dtype).reshape(shape))
    return tensors


@dataclass
class _Message:
    """One allgather in flight: the pieces it carries and where their payloads lie."""

    pieces: list[_Piece]
    layout: _Layout
    gathered: list[Tensor]
    work: Any


class GatherRoute(MessageRoute[_Message]):
    """One step's layers whose payloads are allgathered."""

    def send(self) -> list[Any]:
        """Round 1: encode the layers piece by piece and allgather each message once it is full."""
        step, clock = self.step, self.step.clock
        batches: Batches[_Piece, _Message] = Batches(step.message_numel, self._send_message)
        for layer in self.layers:
            for part in step.pieces(layer):
                clock.start()
                name, codec = layer.plan.name, layer.plan.codec
                p = step.memory.compensate_(name, layer.gradient, part)
                # p becomes the residual, what was not sent (a whole layer keeps its shape)
                shaped = p.view(layer.plan.shape) if part is None else p
                workspace = part_of(step.workspaces.like(name, layer.gradient), part)
                encoded = codec.encode_(shaped, workspace)
                clock.reports[name].bytes_sent += (step.world - 1) * encoded.nbytes()
                clock.lap(name, "encode")
                batches.add((layer, part, encoded), p.numel())
        self.messages = batches.close()
        return []

    def receive(self) -> None:
        """Round 3: nothing left (round 2 decoded every message as it arrived)."""

    def _send_message(self, pieces: list[_Piece]) -> _Message:
        send, layout = _to_bytes([part for _, _, encoded in pieces for part in encoded.payload])
        send = to_group(send, self.step.group)
        gathered = [empty_like(send) for _ in range(self.step.world)]
        work = dist.all_gather(gathered, send, async_op=True, group=self.step.group)
        return _Message(pieces, layout, gathered, work)

    def arrived(self, message: _Message) -> None:
        """Round 2: average the message's pieces: decode every rank's payload, sum, / W."""
        step, clock = self.step, self.step.clock
        per_rank = [_from_bytes(buffer, message.layout) for buffer in message.gathered]
        start = 0
        for layer, part, encoded in message.pieces:
            clock.start()
            count = len(encoded.payload)
            target = part_of(layer.gradient, part)
            target.zero_()
            # the layer's encode workspace is free again: the codec may decode into it
            workspace = part_of(step.workspaces.like(layer.plan.name, layer.gradient), part)
            for tensors in per_rank:  # a loop over ranks; each decode is whole-tensor
                payload = tensors[start : start + count]
                layer.plan.codec.decode_add_(Encoded(payload, encoded.context), target, workspace)
            start += count
            target.div_(step.world)
            clock.lap(layer.plan.name, "decode")
