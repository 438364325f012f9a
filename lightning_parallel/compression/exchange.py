"""Allreduce-compatible exchanges: average compressed gradients with bytes per rank flat in W.

Sparse top-k and 2-bit codes cannot be summed by a plain allreduce. :class:`HyloExchange`
averages the gradients of one DDP bucket across the ``W`` ranks of a group, each layer by the
route its :class:`~lightning_parallel.compression.policy.LayerPlan` names, in two rounds of
asynchronous collectives (so every round costs one latency, whatever the number of layers):

``dense`` (small layers, biases, norms)
    fused into one buffer, divided by ``W`` and allreduced (round 2), as DDP does.

``kernel`` (convolutions, :class:`~lightning_parallel.compression.KernelTopK`)
    1. every rank computes its per-kernel norms of ``p = g + e`` and the norms are allreduced
       (round 1, one bfloat16 per kernel);
    2. every rank selects the same top kernels from the summed norms, and the selected kernels'
       values ride in the dense allreduce (round 2); the rest stays in the residual ``e``.

``two_bit`` (fully-connected, :class:`~lightning_parallel.compression.TwoBitQuantizer`),
two-phase compressed allreduce (as DeepSpeed's 1-bit allreduce; here with Hylo's codes):
    1. every rank quantizes ``p = g + e`` with its own scales ``s``, one per block (residual
       ``e <- p - Q(p)``), pads the codes to ``W`` chunks of ``c`` values (``c`` a multiple of
       16 and of the block size, so chunks hold whole blocks) and sends chunk ``j`` with its
       blocks' scales to rank ``j`` (``all_to_all``: a reduce-scatter of packed codes, round 1);
    2. rank ``j`` decodes the ``W`` codes of its chunk, averages them
       (``m = sum_i s_i * sign_i / W``), adds its second error-feedback residual
       ``u = m + e2``, re-quantizes ``u`` (threshold ``factor * mean|u|`` per block,
       ``e2 <- u - Q(u)``), and allgathers its packed chunk with its scales (round 2); every rank
       decodes all chunks.
    Each rank sends ``2 (W-1)/W * n/16`` words: the bytes of an allreduce of the codes, flat in
    ``W``. With ``two_bit_exchange="allgather"`` the codes are allgathered instead (the simple
    fallback: ``(W-1) * n/16`` words, growing with ``W``).

``gather`` (peer codecs: top-k, QSGD, TernGrad, signSGD; 2-bit codes at ``W = 2``)
    every rank's payload is allgathered in one byte buffer (round 1) and every rank decodes and
    averages all of them: bytes per rank grow with ``W``, as in GRACE's allgather communicator.

Pipelined pieces (gather route). A large 2-bit layer is cut into pieces of about
``piece_numel`` values (whole blocks: a block's codes depend on that block alone, so the
result is bit for bit the one-piece result), and the payloads travel in messages of about
``piece_numel`` values, each allgathered as soon as it is encoded. While message ``k`` is on
the wire, message ``k + 1`` is encoded, and message ``k`` is decoded while ``k + 1`` travels:
the link is busy from the first message's encoding to the last one's decoding, instead of
waiting for every code of the bucket before the first byte leaves. On calibration steps the
bucket travels in one message, so that the cost model's waits measure the link alone.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_parallel.comm.devices import empty_like, to_group
from lightning_parallel.compression.codec import Encoded
from lightning_parallel.compression.error_feedback import ErrorFeedback
from lightning_parallel.compression.kernel_topk import KernelTopK
from lightning_parallel.compression.packing import pack_2bit
from lightning_parallel.compression.policy import DENSE, GATHER, KERNEL, TWO_BIT, LayerPlan
from lightning_parallel.compression.two_bit import TwoBitQuantizer

__all__: list[str] = []

TWO_BIT_EXCHANGES = ("auto", "two_phase", "allgather")
#: values per pipelined piece of a 2-bit layer (its codes: 128 KiB, 10 ms at 100 Mbit/s)
PIECE_NUMEL = 1 << 19


def check_piece_numel(setting: int | str | None) -> int | str | None:
    """Return ``setting`` if it is ``"auto"``, ``None`` or a positive int; raise otherwise."""
    if setting is None or setting == "auto":
        return setting
    if isinstance(setting, bool) or not isinstance(setting, int) or setting < 1:
        raise ValueError(
            f"piece_numel must be a positive number of values, None (each bucket in one "
            f'message) or "auto" ({PIECE_NUMEL} for CPU gradients, None for CUDA ones), got '
            f"{setting!r}"
        )
    return setting


def resolve_piece_numel(setting: int | str | None, device: torch.device) -> int | None:
    """The pieces for gradients on ``device``: ``"auto"`` pipelines on the CPU, where pieces
    paid, and not on CUDA, where each piece costs kernel launches and collectives of its own:
    on an H200 shared by two ranks over gloo they were 1.7-2.1x slower on ``vgg_mini`` and
    6-11% faster on ``resnet18`` (two runs; ``docs/gpu.md``)."""
    if setting == "auto":
        return PIECE_NUMEL if device.type == "cpu" else None
    assert not isinstance(setting, str)
    return setting


_ALIGN = 8  # bytes: every payload segment starts aligned so it can be viewed as any dtype


@dataclass
class LayerGradient:
    """One parameter's gradient inside a bucket: read the local one, write back the average."""

    plan: LayerPlan
    gradient: Tensor  # 1-D view into the bucket buffer


@dataclass
class LayerReport:
    """What one layer cost in one exchange (this rank)."""

    bytes_sent: float = 0.0
    dense_bytes: float = 0.0
    encode_s: float = 0.0
    decode_s: float = 0.0

    @property
    def compression_ratio(self) -> float:
        """Dense bytes over the bytes actually sent (1 for uncompressed layers)."""
        return self.dense_bytes / self.bytes_sent if self.bytes_sent > 0 else 1.0


def ring_allreduce_bytes(nbytes: float, world_size: int) -> float:
    """Bytes one rank sends in a ring allreduce of ``nbytes`` (reduce-scatter + allgather)."""
    return 2.0 * (world_size - 1) / world_size * nbytes


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


def _no_sync() -> None:
    return None


class _Clock:
    """Accumulate seconds per (layer, phase); ``sync`` waits for the device's queued work
    before each reading (CUDA runs kernels after their launch returns)."""

    def __init__(
        self, reports: dict[str, LayerReport], sync: Callable[[], None] = _no_sync
    ) -> None:
        self.reports = reports
        self.sync = sync
        self._start = 0.0

    def start(self) -> None:
        self.sync()
        self._start = time.perf_counter()

    def lap(self, name: str, phase: str) -> None:
        self.sync()
        now = time.perf_counter()
        report = self.reports[name]
        if phase == "encode":
            report.encode_s += now - self._start
        else:
            report.decode_s += now - self._start
        self._start = now


_Layout = list[tuple[int, torch.dtype, tuple[int, ...]]]


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


class HyloExchange:
    """Average one bucket's gradients across a process group, each layer by its route.

    Residuals are kept flat (one 1-D tensor per parameter, like the bucket's slices) and
    updated in place; large per-layer workspaces are allocated once and reused, because a fresh
    multi-megabyte tensor per step costs more in page faults than the arithmetic on it.

    Args:
        memory: the workers' error-feedback residuals (keyed by parameter name).
        server_memory: the second residuals of the two-phase 2-bit exchange (keyed by parameter
            name and chunk).
        two_bit_exchange: ``"two_phase"`` (bytes flat in ``W``), ``"allgather"``, or ``"auto"``
            (``allgather`` at ``W = 2``, where both send the same bytes and allgather quantizes
            once instead of twice; ``two_phase`` above).
        importance_dtype: dtype of the allreduced per-kernel norms (only their ranking matters).
        group: the process group (``None``: the default group).
        piece_numel: values per pipelined piece of a large 2-bit layer with blocks (cut into
            whole blocks), on the allgather and the two-phase routes alike; ``None``: every
            layer in one piece, each bucket in one message.
    """

    def __init__(
        self,
        memory: ErrorFeedback,
        server_memory: ErrorFeedback,
        two_bit_exchange: str = "auto",
        importance_dtype: torch.dtype = torch.bfloat16,
        group: Any = None,
        piece_numel: int | None = PIECE_NUMEL,
    ) -> None:
        check_piece_numel(piece_numel)
        if piece_numel == "auto":
            raise ValueError(
                'piece_numel="auto" depends on the gradients\' device: pass '
                "resolve_piece_numel(setting, device), a positive int or None"
            )
        if two_bit_exchange not in TWO_BIT_EXCHANGES:
            raise ValueError(
                f"two_bit_exchange must be one of {TWO_BIT_EXCHANGES}, got {two_bit_exchange!r}"
            )
        self.memory = memory
        self.server_memory = server_memory
        self.two_bit_exchange = two_bit_exchange
        self.importance_dtype = importance_dtype
        self.group = group
        self.piece_numel = piece_numel
        self.last_wait_seconds = 0.0
        # set by the hook on its calibration steps: time the device's work, not its launches
        # (on CUDA every clock reading and wait synchronises the device), and send every layer
        # in one piece, so that the waits measure the link
        self.calibrating = False
        self._workspaces: dict[str, Tensor] = {}

    def _workspace(self, key: str, like: Tensor) -> Tensor:
        return self._buffer(key, tuple(like.shape), like.dtype, like.device)

    def _buffer(
        self, key: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
    ) -> Tensor:
        """A tensor kept across steps under ``key`` (zeros when first made)."""
        buffer = self._workspaces.get(key)
        if (
            buffer is None
            or tuple(buffer.shape) != shape
            or buffer.dtype != dtype
            or buffer.device != device
        ):
            buffer = torch.zeros(shape, dtype=dtype, device=device)
            self._workspaces[key] = buffer
        return buffer

    def gathers_codes(self, world: int) -> bool:
        """Whether 2-bit codes are allgathered (not two-phase) among ``world`` ranks."""
        return self.two_bit_exchange == "allgather" or (
            self.two_bit_exchange == "auto" and world <= 2
        )

    def average(self, layers: list[LayerGradient]) -> dict[str, LayerReport]:
        """Replace every ``layer.gradient`` with the average over ranks; report costs per layer.

        Every rank must call this with the same layers in the same order (DDP calls bucket hooks
        in bucket order on every rank), since the collectives are matched by order.
        """
        world = dist.get_world_size(self.group)
        rank = dist.get_rank(self.group)
        reports = {layer.plan.name: LayerReport() for layer in layers}
        for layer in layers:
            reports[layer.plan.name].dense_bytes = ring_allreduce_bytes(
                layer.gradient.numel() * layer.gradient.element_size(), world
            )
        sync = _no_sync
        if self.calibrating and layers and layers[0].gradient.is_cuda:
            device = layers[0].gradient.device
            sync = lambda: torch.cuda.synchronize(device)  # noqa: E731
        clock = _Clock(reports, sync)
        routes: dict[str, list[LayerGradient]] = {DENSE: [], KERNEL: [], TWO_BIT: [], GATHER: []}
        for layer in layers:
            route = layer.plan.route
            if route == TWO_BIT and self.gathers_codes(world):
                route = GATHER
            routes[route].append(layer)

        # Round 1: kernel norms (allreduce), 2-bit chunks (all_to_all), payloads (allgather,
        # one message after another as they are encoded).
        works: list[Any] = []
        kernel_round = self._kernel_norms(routes[KERNEL], clock, works, world)
        chunk_messages = self._scatter_codes(routes[TWO_BIT], clock, world, rank)
        messages = self._gather_payloads(routes[GATHER], clock, world)
        waited = _wait(works, sync)

        # Round 2: dense + selected kernels (allreduce), each message's chunks re-quantized
        # and allgathered once its codes arrived; gathered messages decoded as they arrive.
        works = []
        dense_round = self._dense_values(routes[DENSE], kernel_round, clock, works, world)
        for chunk_message in chunk_messages:
            waited += _wait([chunk_message.work], sync)
            self._reduce_chunks(chunk_message, clock, world, rank)
        for message in messages:
            waited += _wait([message.work], sync)
            self._decode_message(message, clock, world)
        for chunk_message in chunk_messages:
            waited += _wait([chunk_message.gathering], sync)
            self._decode_chunks(chunk_message, clock, world)
        waited += _wait(works, sync)
        self.last_wait_seconds = waited

        self._write_dense(dense_round, clock)
        return reports

    # -- kernel route -----------------------------------------------------------------------

    def _kernel_norms(
        self, layers: list[LayerGradient], clock: _Clock, works: list[Any], world: int
    ) -> dict[str, Any] | None:
        if not layers:
            return None
        compensated, norms = [], []
        for layer in layers:
            clock.start()
            codec = layer.plan.codec
            assert isinstance(codec, KernelTopK)
            p = self.memory.compensate_(layer.plan.name, layer.gradient)
            compensated.append(p)
            norms.append(codec.importance(p.view(layer.plan.shape)))
            clock.lap(layer.plan.name, "encode")
        summed = to_group(torch.cat(norms).to(self.importance_dtype), self.group)
        works.append(dist.all_reduce(summed, async_op=True, group=self.group))
        for layer, norm in zip(layers, norms):
            clock.reports[layer.plan.name].bytes_sent += ring_allreduce_bytes(
                norm.numel() * summed.element_size(), world
            )
        return {"layers": layers, "compensated": compensated, "norms": summed, "sizes": norms}

    # -- dense route (with the selected kernels) --------------------------------------------

    def flush(self, layer: LayerGradient, world: int, rank: int) -> None:
        """Send what a layer kept while it was compressed, now that it travels dense.

        The worker residual joins this rank's gradient; the second residuals of the two-phase
        exchange join it too (see :meth:`_fold_server_residuals`).
        """
        residual = self.memory.pop(layer.plan.name)
        if residual is not None:
            layer.gradient.add_(residual)
        self._fold_server_residuals(layer, world, rank, keep=())

    def _fold_server_residuals(
        self, layer: LayerGradient, world: int, rank: int, keep: Collection[str]
    ) -> None:
        """Move the layer's second residuals not in ``keep`` into this rank's gradient.

        A second residual is held by its chunk's owner in units of the mean: it joins the
        owner's gradient times ``W``, so that the average gains exactly the residual. This
        runs when a layer turns dense (nothing kept) and when its pieces change (another
        ``piece_numel``, or a checkpoint of the one-piece layout).
        """
        prefix = f"{layer.plan.name}@chunk"
        for key in [key for key in self.server_memory if key.startswith(prefix)]:
            if key in keep:
                continue
            server = self.server_memory.pop(key)
            owned = _owned_values(key[len(prefix) :], server, world, rank)
            if server is None or owned is None:
                continue  # a chunk of another world size: its share is lost with that layout
            start, stop = owned
            stop = min(stop, layer.gradient.numel())
            if stop > start:
                layer.gradient[start:stop].add_(server[: stop - start], alpha=world)

    def _dense_values(
        self,
        dense: list[LayerGradient],
        kernel_round: dict[str, Any] | None,
        clock: _Clock,
        works: list[Any],
        world: int,
    ) -> dict[str, Any] | None:
        rank = dist.get_rank(self.group)
        for layer in dense:
            self.flush(layer, world, rank)
        pieces: list[Tensor] = [layer.gradient for layer in dense]
        selections = []
        if kernel_round is not None:
            global_norms = (
                kernel_round["norms"].float().split([n.numel() for n in kernel_round["sizes"]])
            )
            for layer, p, importance in zip(
                kernel_round["layers"], kernel_round["compensated"], global_norms
            ):
                clock.start()
                codec = layer.plan.codec
                assert isinstance(codec, KernelTopK)
                indices = codec.select(importance, layer.plan.shape)
                kernels = p.view(codec.kernel_layout(layer.plan.shape))
                values = kernels.index_select(0, indices)
                kernels.index_fill_(0, indices, 0.0)  # the residual: what was not sent
                pieces.append(values.reshape(-1))
                selections.append((layer, indices, values.shape))
                clock.reports[layer.plan.name].bytes_sent += ring_allreduce_bytes(
                    values.numel() * values.element_size(), world
                )
                clock.lap(layer.plan.name, "encode")
        if not pieces:
            return None
        # Divide before summing, as torch's allreduce hook does, so that no compression equals
        # DDP bit for bit.
        fused = to_group(torch.cat(pieces).div_(world), self.group)
        works.append(dist.all_reduce(fused, async_op=True, group=self.group))
        for layer in dense:
            clock.reports[layer.plan.name].bytes_sent += ring_allreduce_bytes(
                layer.gradient.numel() * fused.element_size(), world
            )
        return {"dense": dense, "selections": selections, "fused": fused}

    def _write_dense(self, dense_round: dict[str, Any] | None, clock: _Clock) -> None:
        if dense_round is None:
            return
        fused: Tensor = dense_round["fused"]
        offset = 0
        for layer in dense_round["dense"]:
            numel = layer.gradient.numel()
            layer.gradient.copy_(fused[offset : offset + numel])
            offset += numel
        for layer, indices, shape in dense_round["selections"]:
            clock.start()
            count = shape[0] * shape[1]
            averaged = fused[offset : offset + count].view(shape)
            offset += count
            layer.gradient.zero_()
            layer.gradient.view(-1, shape[1]).index_copy_(0, indices, averaged)
            clock.lap(layer.plan.name, "decode")

    # -- two-bit route, two-phase, in pipelined messages -----------------------------------

    def _scatter_codes(
        self, layers: list[LayerGradient], clock: _Clock, world: int, rank: int
    ) -> list[_ChunkMessage]:
        """Quantize each piece into ``W`` chunks and send chunk ``j`` to rank ``j`` (round 1)."""
        messages: list[_ChunkMessage] = []
        pending: list[_ChunkPiece] = []
        filled = 0
        limit = None if self.calibrating else self.piece_numel  # None: one message
        for layer in layers:
            codec = layer.plan.codec
            assert isinstance(codec, TwoBitQuantizer)
            name = layer.plan.name
            parts = self._pieces(layer, chunks=world)
            keys = [_server_key(name, rank, world, part) for part in parts]
            self._fold_server_residuals(layer, world, rank, keep=keys)
            for part, key in zip(parts, keys):
                clock.start()
                p = self.memory.compensate_(name, layer.gradient, part)
                chunk = two_phase_chunk(p.numel(), world, codec.block_size or 16)
                # The codes live in a zeroed buffer of W chunks: the padding stays code 0.
                at = _start(part)
                codes = self._buffer(f"{name}/codes@{at}", (world * chunk,), torch.int8, p.device)
                workspace = _part(self._workspace(name, layer.gradient), part)
                _, scale = codec.quantize_(p, workspace, codes_out=codes)  # p: the residual
                words = pack_2bit(codes.view(torch.uint8).view(world, chunk))  # (W, chunk / 16)
                scale_bits = _chunk_scales(codec, scale, world, chunk).view(torch.int32)
                row = torch.cat([scale_bits, words], dim=1)
                pending.append(_ChunkPiece(layer, part, key, chunk, row))
                filled += p.numel()
                clock.reports[name].bytes_sent += (world - 1) * row.shape[1] * 4
                clock.lap(name, "encode")
                if limit is not None and filled >= limit:
                    messages.append(self._scatter_message(pending))
                    pending, filled = [], 0
        if pending:
            messages.append(self._scatter_message(pending))
        return messages

    def _scatter_message(self, pieces: list[_ChunkPiece]) -> _ChunkMessage:
        send = to_group(torch.cat([piece.row for piece in pieces], dim=1).contiguous(), self.group)
        received = empty_like(send)
        work = dist.all_to_all_single(received, send, async_op=True, group=self.group)
        return _ChunkMessage(pieces, received, work)

    def _reduce_chunks(self, message: _ChunkMessage, clock: _Clock, world: int, rank: int) -> None:
        """Average this rank's chunk of every piece, re-quantize it, allgather (round 2)."""
        received = message.received  # (W, sum of scales + words): row i from rank i
        sends: list[Tensor] = []
        offset = 0
        for piece in message.pieces:
            layer, chunk = piece.layer, piece.chunk
            clock.start()
            codec = layer.plan.codec
            assert isinstance(codec, TwoBitQuantizer)
            words = chunk // 16
            per_chunk = 1 if codec.block_size is None else chunk // codec.block_size
            block_scales = received[:, offset : offset + per_chunk].contiguous()
            block_scales = block_scales.view(torch.float32)  # (W, scales per chunk)
            # (W, chunk) int8: row i holds rank i's codes of the chunk this rank owns
            key = piece.key
            buffer = self._buffer(f"{key}/signs", (world, 16 * words), torch.int8, received.device)
            block = received[:, offset + per_chunk : offset + per_chunk + words]
            signs = codec.signs_from_words(block, chunk, out=buffer)
            offset += per_chunk + words
            mean = self._workspace(key, signs[0].to(torch.float32))
            term = self._workspace(f"{key}/term", mean)
            # the scales stay on the device (no host round trip): sign * s is exact, so the
            # sum is the same with or without blocks
            codec.dequantize(signs[0], block_scales[0], mean)
            for source in range(1, world):  # a loop over ranks; each step whole-tensor
                mean.add_(codec.dequantize(signs[source], block_scales[source], term))
            mean.div_(world)
            s = self.server_memory.compensate_(key, mean)  # second error feedback
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
        send = to_group(torch.cat(sends), self.group)
        message.gathered = [empty_like(send) for _ in range(world)]
        message.gathering = dist.all_gather(message.gathered, send, async_op=True, group=self.group)

    def _decode_chunks(self, message: _ChunkMessage, clock: _Clock, world: int) -> None:
        """Write every rank's re-quantized chunks of the message's pieces into the gradients."""
        gathered = torch.stack(message.gathered)  # (W, sum of scales + words)
        offset = 0
        for piece in message.pieces:
            layer, chunk = piece.layer, piece.chunk
            clock.start()
            codec = layer.plan.codec
            assert isinstance(codec, TwoBitQuantizer)
            words = chunk // 16
            per_chunk = 1 if codec.block_size is None else chunk // codec.block_size
            block_scales = gathered[:, offset : offset + per_chunk].contiguous()
            block_scales = block_scales.view(torch.float32)  # (W, scales per chunk)
            # (W, chunk) int8: row j holds chunk j as re-quantized by its owner, rank j
            at = _start(piece.part)
            shape = (world, 16 * words)
            key = f"{layer.plan.name}/decoded@{at}"
            buffer = self._buffer(key, shape, torch.int8, gathered.device)
            block = gathered[:, offset + per_chunk : offset + per_chunk + words]
            signs = codec.signs_from_words(block, chunk, out=buffer)
            offset += per_chunk + words
            gradient = _part(layer.gradient, piece.part)
            for owner in range(world):  # a loop over ranks; each step whole-tensor
                start, stop = owner * chunk, min(piece.numel, (owner + 1) * chunk)
                if stop > start:
                    target = gradient[start:stop]
                    codec.dequantize(signs[owner, : stop - start], block_scales[owner], target)
            clock.lap(layer.plan.name, "decode")

    # -- gather route (peer codecs, 2-bit allgather), in pipelined messages ------------------

    def _pieces(self, layer: LayerGradient, chunks: int = 1) -> list[slice | None]:
        """The parts of ``layer`` encoded one after another (``None``: the whole layer).

        Only a 2-bit layer with blocks is cut, into pieces of whole blocks: a block's codes,
        and in the two-phase exchange its owner's re-quantization, depend on that block alone,
        so the values are those of the whole layer. A peer codec's selection or scale spans its
        whole tensor. The pieces do not depend on calibration (the two-phase exchange keeps a
        second residual per piece); only the messages do. ``chunks``: the two-phase exchange
        cuts every piece into ``W`` chunks of whole blocks, so its pieces are a multiple of
        ``W`` blocks (only the last one is padded).
        """
        codec = layer.plan.codec
        numel = layer.gradient.numel()
        if (
            self.piece_numel is None
            or not isinstance(codec, TwoBitQuantizer)
            or codec.block_size is None
            or numel <= self.piece_numel
        ):
            return [None]
        unit = chunks * codec.block_size
        step = max(1, self.piece_numel // unit) * unit
        return [slice(start, min(numel, start + step)) for start in range(0, numel, step)]

    def _gather_payloads(
        self, layers: list[LayerGradient], clock: _Clock, world: int
    ) -> list[_Message]:
        """Encode ``layers`` piece by piece and allgather each message once it is full."""
        messages: list[_Message] = []
        pending: list[tuple[LayerGradient, slice | None, Encoded]] = []
        filled = 0
        limit = None if self.calibrating else self.piece_numel  # None: one message
        for layer in layers:
            for part in self._pieces(layer):
                clock.start()
                name, codec = layer.plan.name, layer.plan.codec
                p = self.memory.compensate_(name, layer.gradient, part)
                # p becomes the residual, what was not sent (a whole layer keeps its shape)
                shaped = p.view(layer.plan.shape) if part is None else p
                workspace = _part(self._workspace(name, layer.gradient), part)
                encoded = codec.encode_(shaped, workspace)
                pending.append((layer, part, encoded))
                filled += p.numel()
                clock.reports[name].bytes_sent += (world - 1) * encoded.nbytes()
                clock.lap(name, "encode")
                if limit is not None and filled >= limit:
                    messages.append(self._send_message(pending, world))
                    pending, filled = [], 0
        if pending:
            messages.append(self._send_message(pending, world))
        return messages

    def _send_message(
        self, pieces: list[tuple[LayerGradient, slice | None, Encoded]], world: int
    ) -> _Message:
        send, layout = _to_bytes([part for _, _, encoded in pieces for part in encoded.payload])
        send = to_group(send, self.group)
        gathered = [empty_like(send) for _ in range(world)]
        work = dist.all_gather(gathered, send, async_op=True, group=self.group)
        return _Message(pieces, layout, gathered, work)

    def _decode_message(self, message: _Message, clock: _Clock, world: int) -> None:
        """Average the pieces of an arrived message: decode every rank's payload, sum, / W."""
        per_rank = [_from_bytes(buffer, message.layout) for buffer in message.gathered]
        start = 0
        for layer, part, encoded in message.pieces:
            clock.start()
            count = len(encoded.payload)
            target = _part(layer.gradient, part)
            target.zero_()
            # the layer's encode workspace is free again: the codec may decode into it
            workspace = _part(self._workspace(layer.plan.name, layer.gradient), part)
            for tensors in per_rank:  # a loop over ranks; each decode is whole-tensor
                payload = tensors[start : start + count]
                layer.plan.codec.decode_add_(Encoded(payload, encoded.context), target, workspace)
            start += count
            target.div_(world)
            clock.lap(layer.plan.name, "decode")


@dataclass
class _Message:
    """One allgather in flight: the pieces it carries and where their payloads lie."""

    pieces: list[tuple[LayerGradient, slice | None, Encoded]]
    layout: _Layout
    gathered: list[Tensor]
    work: Any


def _wait(works: list[Any], sync: Callable[[], None]) -> float:
    """Wait for ``works``; return the seconds it took."""
    started = time.perf_counter()
    for work in works:
        work.wait()
    sync()  # an NCCL wait returns once the work is queued on the stream
    return time.perf_counter() - started


@dataclass
class _ChunkPiece:
    """One piece of a 2-bit layer in the two-phase exchange: its codes cut into ``W`` chunks."""

    layer: LayerGradient
    part: slice | None  # of the layer's values; None: all of them
    key: str  # of this rank's second residual (its chunk of the piece)
    chunk: int  # values per rank's chunk
    row: Tensor  # (W, scales + words): the packed chunk for each rank

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


def _part(tensor: Tensor, part: slice | None) -> Tensor:
    """The values of a piece (``None``: the whole tensor)."""
    return tensor if part is None else tensor[part]


def _start(part: slice | None) -> int:
    """Where a piece starts in its layer (``None``: the whole layer, at 0)."""
    return 0 if part is None else part.start


def _server_key(name: str, rank: int, world: int, part: slice | None) -> str:
    """Key of ``rank``'s second residual: its chunk of the layer, or of the piece ``part``."""
    key = f"{name}@chunk{rank}of{world}"
    return key if part is None else f"{key}@{part.start}-{part.stop}"


def _owned_values(
    suffix: str, server: Tensor | None, world: int, rank: int
) -> tuple[int, int] | None:
    """The layer's values ``[start, stop)`` a second residual belongs to, from its key's
    suffix (``"{r}of{W}"`` or ``"{r}of{W}@{piece start}-{piece stop}"``); ``None`` when it is
    another rank's or another world size's."""
    owner, _, piece = suffix.partition("@")
    if server is None or owner != f"{rank}of{world}":
        return None
    begin, stop = 0, None
    if piece:
        first, _, last = piece.partition("-")
        begin, stop = int(first), int(last)
    start = begin + rank * server.numel()
    end = start + server.numel()
    return start, end if stop is None else min(end, stop)
