"""The two-phase 2-bit route of :class:`~lightning_parallel.compression.HyloExchange`.

A compressed allreduce of Hylo's 2-bit codes (as DeepSpeed's 1-bit allreduce), with bytes per
rank flat in ``W``, for every piece of a 2-bit layer
(:class:`~lightning_parallel.compression.TwoBitQuantizer`):

1. ``send``: every rank quantizes ``p = g + e`` with its own scales ``s``, one per block
   (residual ``e <- p - Q(p)``), pads the codes to ``W`` chunks of ``c`` values
   (:func:`two_phase_chunk`: whole packed words and whole blocks) and sends chunk ``j`` with its
   blocks' scales to rank ``j``: one ``all_to_all`` per message of pieces (a reduce-scatter of
   packed codes);
2. ``relay``: as each message arrives, rank ``j`` decodes the ``W`` codes of its chunk of every
   piece, averages them (``m = sum_i s_i * sign_i / W``), adds its second residual
   ``u = m + e2`` (:mod:`~lightning_parallel.compression.exchange_residuals`), re-quantizes
   ``u`` (``e2 <- u - Q(u)``) and allgathers its packed chunks with their scales;
3. ``receive``: every rank decodes all owners' chunks into the gradients.

Each rank sends ``2 (W-1)/W * n/16`` words: the bytes of an allreduce of the codes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_parallel.comm.devices import empty_like, to_group
from lightning_parallel.compression.exchange_residuals import fold_server_residuals, server_key
from lightning_parallel.compression.exchange_step import (
    Batches,
    LayerGradient,
    MessageRoute,
    part_of,
    start_of,
)
from lightning_parallel.compression.packing import pack_2bit
from lightning_parallel.compression.two_bit import TwoBitQuantizer

__all__: list[str] = []


def two_phase_chunk(numel: int, world_size: int, align: int = 16) -> int:
    """Values per rank's chunk in the two-phase exchange: a multiple of ``align``, ``W`` cover all.

    ``align`` is 16 (whole packed words), or the 2-bit block size, so that every chunk holds
    whole blocks and carries their scales with it.
    """
    per_rank = math.ceil(numel / world_size)
    return max(align, align * math.ceil(per_rank / align))


def _chunk_scales(codec: TwoBitQuantizer, scales: Tensor, world: int, chunk: int) -> Tensor:
    """``(W, scales per chunk)`` float32: each chunk's block scales (zero for padding blocks)."""
    if codec.block_size is None:
        return scales.reshape(1, 1).expand(world, 1).contiguous()
    per_chunk = chunk // codec.block_size
    padded = torch.zeros(world * per_chunk, dtype=torch.float32, device=scales.device)
    padded[: scales.numel()] = scales
    return padded.view(world, per_chunk)


def _widths(codec: TwoBitQuantizer, chunk: int) -> tuple[int, int]:
    """A packed chunk's int32 columns: its scales, then its words of codes."""
    return (1 if codec.block_size is None else chunk // codec.block_size), chunk // 16


def _unpack(
    rows: Tensor, offset: int, codec: TwoBitQuantizer, chunk: int, out: Tensor
) -> tuple[Tensor, Tensor, int]:
    """The packed chunks of one piece, at column ``offset`` of ``rows`` (one row per rank):
    their block scales ``(W, scales per chunk)`` float32, their codes ``(W, chunk)`` int8 (in
    ``out``), and the column after them."""
    per_chunk, words = _widths(codec, chunk)
    block_scales = rows[:, offset : offset + per_chunk].contiguous()
    block_scales = block_scales.view(torch.float32)
    block = rows[:, offset + per_chunk : offset + per_chunk + words]
    signs = codec.signs_from_words(block, chunk, out=out)
    return block_scales, signs, offset + per_chunk + words


@dataclass
class _ChunkPiece:
    """One piece of a 2-bit layer in the two-phase exchange: its codes cut into ``W`` chunks."""

    layer: LayerGradient
    part: slice | None  # of the layer's values; None: all of them
    key: str  # of this rank's second residual (its chunk of the piece)
    chunk: int  # values per rank's chunk
    row: Tensor  # (W, scales + words): the packed chunk for each rank

    @property
    def codec(self) -> TwoBitQuantizer:
        """The layer's codec."""
        codec = self.layer.plan.codec
        assert isinstance(codec, TwoBitQuantizer)
        return codec

    @property
    def numel(self) -> int:
        """Values of the piece."""
        if self.part is None:
            return self.layer.gradient.numel()
        return self.part.stop - self.part.start


@dataclass
class _ChunkMessage:
    """The two collectives of a group of pieces: codes scattered, then chunks gathered."""

    pieces: list[_ChunkPiece]
    received: Tensor  # round 1: every rank's codes of this rank's chunks
    work: Any  # round 1's all_to_all
    gathered: list[Tensor] = field(default_factory=list)  # round 2: every owner's chunks
    gathering: Any = None  # round 2's allgather


class TwoPhaseRoute(MessageRoute[_ChunkMessage]):
    """One step's 2-bit layers, exchanged in two phases."""

    def send(self) -> list[Any]:
        """Round 1: quantize each piece into ``W`` chunks; send chunk ``j`` to rank ``j``."""
        step, clock, world, rank = self.step, self.step.clock, self.step.world, self.step.rank
        batches: Batches[_ChunkPiece, _ChunkMessage] = Batches(step.message_numel, self._scatter)
        for layer in self.layers:
            codec = layer.plan.codec
            assert isinstance(codec, TwoBitQuantizer)
            name = layer.plan.name
            parts = step.pieces(layer, chunks=world)
            keys = [server_key(name, rank, world, part) for part in parts]
            fold_server_residuals(step.server_memory, layer, world, rank, keep=keys)
            for part, key in zip(parts, keys):
                clock.start()
                p = step.memory.compensate_(name, layer.gradient, part)
                chunk = two_phase_chunk(p.numel(), world, codec.block_size or 16)
                # The codes live in a zeroed buffer of W chunks: the padding stays code 0.
                at = start_of(part)
                shape = (world * chunk,)
                codes = step.workspaces.buffer(f"{name}/codes@{at}", shape, torch.int8, p.device)
                workspace = part_of(step.workspaces.like(name, layer.gradient), part)
                _, scale = codec.quantize_(p, workspace, codes_out=codes)  # p: the residual
                words = pack_2bit(codes.view(torch.uint8).view(world, chunk))  # (W, chunk / 16)
                scale_bits = _chunk_scales(codec, scale, world, chunk).view(torch.int32)
                row = torch.cat([scale_bits, words], dim=1)
                clock.reports[name].bytes_sent += (world - 1) * row.shape[1] * 4
                clock.lap(name, "encode")
                batches.add(_ChunkPiece(layer, part, key, chunk, row), p.numel())
        self.messages = batches.close()
        return []

    def receive(self) -> None:
        """Round 3: decode every owner's chunks as they arrive."""
        for message in self.messages:
            self.step.clock.wait([message.gathering])
            self._decode_chunks(message)

    def _scatter(self, pieces: list[_ChunkPiece]) -> _ChunkMessage:
        group = self.step.group
        send = to_group(torch.cat([piece.row for piece in pieces], dim=1).contiguous(), group)
        received = empty_like(send)
        work = dist.all_to_all_single(received, send, async_op=True, group=group)
        return _ChunkMessage(pieces, received, work)

    def arrived(self, message: _ChunkMessage) -> None:
        """Round 2: average this rank's chunk of every piece, re-quantize it, allgather."""
        step, clock, world, rank = self.step, self.step.clock, self.step.world, self.step.rank
        received = message.received  # (W, sum of scales + words): row i from rank i
        sends: list[Tensor] = []
        offset = 0
        for piece in message.pieces:
            layer, chunk, codec = piece.layer, piece.chunk, piece.codec
            clock.start()
            per_chunk, words = _widths(codec, chunk)
            # (W, chunk) int8: row i holds rank i's codes of the chunk this rank owns
            key = piece.key
            shape = (world, 16 * words)
            buffer = step.workspaces.buffer(f"{key}/signs", shape, torch.int8, received.device)
            block_scales, signs, offset = _unpack(received, offset, codec, chunk, buffer)
            mean = step.workspaces.like(key, signs[0].to(torch.float32))
            term = step.workspaces.like(f"{key}/term", mean)
            # the scales stay on the device (no host round trip): sign * s is exact, so the
            # sum is the same with or without blocks
            codec.dequantize(signs[0], block_scales[0], mean)
            for source in range(1, world):  # a loop over ranks; each step whole-tensor
                mean.add_(codec.dequantize(signs[source], block_scales[source], term))
            mean.div_(world)
            s = step.server_memory.compensate_(key, mean)  # second error feedback
            valid = max(0, min(chunk, piece.numel - rank * chunk))
            codes_out = buffer.view(-1)
            if codec.block_size is None:
                _, scale = codec.quantize_(
                    s, mean, tau=codec.threshold(s[:valid]), codes_out=codes_out
                )
            else:  # blocks of the valid values only (as the workers' last, partial block)
                codes_out[valid:chunk].zero_()
                _, scale = codec.quantize_(s[:valid], mean, codes_out=codes_out)
            scale_rows = _chunk_scales(codec, scale, 1, chunk)
            server_codes = codes_out[:chunk].view(torch.uint8)
            scale_bits = scale_rows.reshape(per_chunk).view(torch.int32)
            sends.append(torch.cat([scale_bits, pack_2bit(server_codes)]))
            clock.reports[layer.plan.name].bytes_sent += (world - 1) * (per_chunk + words) * 4
            clock.lap(layer.plan.name, "decode")
        send = to_group(torch.cat(sends), step.group)
        message.gathered = [empty_like(send) for _ in range(world)]
        message.gathering = dist.all_gather(message.gathered, send, async_op=True, group=step.group)

    def _decode_chunks(self, message: _ChunkMessage) -> None:
        """Write every rank's re-quantized chunks of the message's pieces into the gradients."""
        step, clock, world = self.step, self.step.clock, self.step.world
        gathered = torch.stack(message.gathered)  # (W, sum of scales + words)
        offset = 0
        for piece in message.pieces:
            layer, chunk, codec = piece.layer, piece.chunk, piece.codec
            clock.start()
            # (W, chunk) int8: row j holds chunk j as re-quantized by its owner, rank j
            at = start_of(piece.part)
            shape = (world, 16 * (chunk // 16))
            key = f"{layer.plan.name}/decoded@{at}"
            buffer = step.workspaces.buffer(key, shape, torch.int8, gathered.device)
            block_scales, signs, offset = _unpack(gathered, offset, codec, chunk, buffer)
            gradient = part_of(layer.gradient, piece.part)
            for owner in range(world):  # a loop over ranks; each step whole-tensor
                start, stop = owner * chunk, min(piece.numel, (owner + 1) * chunk)
                if stop > start:
                    target = gradient[start:stop]
                    codec.dequantize(signs[owner, : stop - start], block_scales[owner], target)
            clock.lap(layer.plan.name, "decode")
