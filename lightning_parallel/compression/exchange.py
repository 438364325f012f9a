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

``low_rank`` (fully-connected, :class:`~lightning_parallel.compression.low_rank.LowRank`)
    1. every rank computes ``P = M Q`` from ``M = g + e`` and the layer's warm-start ``Q``;
       the ``P`` are allreduced (round 1);
    2. every rank orthonormalizes the summed ``P`` and allreduces ``Q = M^T P / W``
       (round 2); the gradient is ``P Q^T``, the residual ``M - P Q^T``
       (:mod:`~lightning_parallel.compression.exchange_low_rank`).

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

The routes live in modules of their own, each an
:class:`~lightning_parallel.compression.exchange_step.ExchangeRoute` run in three rounds
(:mod:`~lightning_parallel.compression.exchange_step`): ``dense`` and ``kernel`` in
:mod:`~lightning_parallel.compression.exchange_dense`, ``two_bit`` in
:mod:`~lightning_parallel.compression.exchange_two_phase` (its second residuals in
:mod:`~lightning_parallel.compression.exchange_residuals`), ``gather`` in
:mod:`~lightning_parallel.compression.exchange_gather`. :class:`HyloExchange` splits a bucket's
layers among them, runs their rounds and keeps what lives across steps.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from lightning_parallel.comm.accounting import ring_allreduce_bytes
from lightning_parallel.compression.error_feedback import ErrorFeedback
from lightning_parallel.compression.exchange_dense import DenseRoute
from lightning_parallel.compression.exchange_gather import GatherRoute
from lightning_parallel.compression.exchange_low_rank import LowRankRoute
from lightning_parallel.compression.exchange_residuals import flush_residuals
from lightning_parallel.compression.exchange_step import (
    Clock,
    ExchangeRoute,
    ExchangeStep,
    LayerGradient,
    LayerReport,
    Workspaces,
    device_sync,
    no_sync,
)
from lightning_parallel.compression.exchange_two_phase import TwoPhaseRoute
from lightning_parallel.compression.exchange_two_phase import two_phase_chunk as two_phase_chunk
from lightning_parallel.compression.policy import DENSE, GATHER, KERNEL, LOW_RANK, ROUTES, TWO_BIT

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


@dataclass
class PendingExchange:
    """A bucket between :meth:`HyloExchange.start` and :meth:`HyloExchange.finish`."""

    step: ExchangeStep
    routes: tuple[ExchangeRoute, ...]
    reports: dict[str, LayerReport]


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
        self._workspaces = Workspaces()

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
        return self.finish(self.start(layers))

    def start(self, layers: list[LayerGradient]) -> PendingExchange:
        """Rounds 1 and 2 of :meth:`average`: every collective of the step is issued when this
        returns; :meth:`finish` waits for the last ones and writes the averages.

        Between the two, the next bucket may :meth:`start` (its collectives are issued after
        this one's on every rank, so they stay matched): its encoding then overlaps with this
        bucket's last transfer, and the gradients are those of :meth:`average`, bit for bit.
        """
        world = dist.get_world_size(self.group)
        rank = dist.get_rank(self.group)
        reports = {layer.plan.name: LayerReport() for layer in layers}
        for layer in layers:
            reports[layer.plan.name].dense_bytes = ring_allreduce_bytes(
                layer.gradient.numel() * layer.gradient.element_size(), world
            )
        sync = device_sync(layers[0].gradient) if self.calibrating and layers else no_sync
        step = ExchangeStep(
            self.memory,
            self.server_memory,
            self._workspaces,
            Clock(reports, sync),
            self.group,
            world,
            rank,
            self.piece_numel,
            self.calibrating,
        )
        by_route: dict[str, list[LayerGradient]] = {route: [] for route in ROUTES}
        for layer in layers:
            kind = layer.plan.route
            if kind == TWO_BIT and self.gathers_codes(world):
                kind = GATHER
            by_route[kind].append(layer)
        routes: tuple[ExchangeRoute, ...] = (
            DenseRoute(step, by_route[DENSE], by_route[KERNEL], self.importance_dtype),
            TwoPhaseRoute(step, by_route[TWO_BIT]),
            GatherRoute(step, by_route[GATHER]),
            LowRankRoute(step, by_route[LOW_RANK]),
        )

        # Round 1: kernel norms (allreduce), 2-bit chunks (all_to_all), payloads (allgather,
        # one message after another as they are encoded), low-rank P (allreduce).
        step.clock.wait([work for route in routes for work in route.send()])
        # Round 2: dense + selected kernels (allreduce), each message's chunks re-quantized
        # and allgathered once its codes arrived; gathered messages decoded as they arrive;
        # low-rank Q (allreduce).
        for route in routes:
            route.relay()
        return PendingExchange(step, routes, reports)

    def finish(self, pending: PendingExchange) -> dict[str, LayerReport]:
        """Round 3 of :meth:`average`: low-rank ``P Q^T``, the re-quantized chunks decoded as
        they arrive, then the dense allreduce; the reports of the step."""
        for route in reversed(pending.routes):
            route.receive()
        self.last_wait_seconds = pending.step.clock.waited
        return pending.reports

    def flush(self, layer: LayerGradient, world: int, rank: int) -> None:
        """Send what a layer kept while it was compressed, now that it travels dense.

        The worker residual joins this rank's gradient; the second residuals of the two-phase
        exchange join it too (see
        :func:`~lightning_parallel.compression.exchange_residuals.fold_server_residuals`).
        """
        flush_residuals(self.memory, self.server_memory, layer, world, rank)
