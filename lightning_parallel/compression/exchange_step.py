"""What the routes of :class:`~lightning_parallel.compression.HyloExchange` share in one step.

A step is one ``average`` call on one bucket. Its layers are split by route, and every route is
an :class:`ExchangeRoute` (:mod:`~lightning_parallel.compression.exchange_dense`,
:mod:`~lightning_parallel.compression.exchange_two_phase`,
:mod:`~lightning_parallel.compression.exchange_gather`) that runs the step's three rounds:

1. ``send``: encode and start the first collectives; the step waits for those that round 2
   needs (the kernel norms) once every route has sent;
2. ``relay``: start the second collectives (the dense allreduce, the owners' re-quantized
   chunks) and decode what has arrived, message after message;
3. ``receive``: wait for the rest and write the averages into the gradients (the routes in
   reverse order, so that the dense allreduce, started first in round 2, is waited for last).

The routes share an :class:`ExchangeStep`: the group, the residuals, the :class:`Workspaces`
kept across steps, the :class:`Clock` of encode and decode seconds per layer and of the
seconds waited, and how a layer is cut into pieces. :class:`Batches` groups the pieces into
messages of about ``piece_numel`` values, each sent as soon as it is full, and a
:class:`MessageRoute` takes each message up in round 2 as soon as it has arrived (pipelining:
message ``k`` is decoded while ``k + 1`` travels).
"""

from __future__ import annotations

import functools
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

import torch
from torch import Tensor

from lightning_parallel.compression.error_feedback import ErrorFeedback
from lightning_parallel.compression.policy import LayerPlan
from lightning_parallel.compression.two_bit import TwoBitQuantizer

__all__: list[str] = []


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


def no_sync() -> None:
    """Nothing to wait for (CPU work is done when its call returns)."""
    return None


def device_sync(tensor: Tensor) -> Callable[[], None]:
    """What waits for the queued work of ``tensor``'s device before a clock reading: CUDA runs
    kernels after their launch returns; on the CPU there is nothing to wait for."""
    if tensor.is_cuda:
        return functools.partial(torch.cuda.synchronize, tensor.device)
    return no_sync


class Clock:
    """Accumulate seconds per (layer, phase), and the seconds waited; ``sync`` waits for the
    device's queued work before each reading (CUDA runs kernels after their launch returns)."""

    def __init__(self, reports: dict[str, LayerReport], sync: Callable[[], None] = no_sync) -> None:
        self.reports = reports
        self.sync = sync
        self.waited = 0.0
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

    def wait(self, works: list[Any]) -> None:
        """Wait for ``works``; add the seconds it took to :attr:`waited`."""
        started = time.perf_counter()
        for work in works:
            work.wait()
        self.sync()  # an NCCL wait returns once the work is queued on the stream
        self.waited += time.perf_counter() - started


class Workspaces:
    """Tensors kept across steps by key: a fresh multi-megabyte tensor per step costs more in
    page faults than the arithmetic on it."""

    def __init__(self) -> None:
        self._tensors: dict[str, Tensor] = {}

    def like(self, key: str, like: Tensor) -> Tensor:
        """The tensor under ``key`` with the shape, dtype and device of ``like``."""
        return self.buffer(key, tuple(like.shape), like.dtype, like.device)

    def buffer(
        self, key: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
    ) -> Tensor:
        """A tensor kept across steps under ``key`` (zeros when first made)."""
        buffer = self._tensors.get(key)
        if (
            buffer is None
            or tuple(buffer.shape) != shape
            or buffer.dtype != dtype
            or buffer.device != device
        ):
            buffer = torch.zeros(shape, dtype=dtype, device=device)
            self._tensors[key] = buffer
        return buffer


def part_of(tensor: Tensor, part: slice | None) -> Tensor:
    """The values of a piece (``None``: the whole tensor)."""
    return tensor if part is None else tensor[part]


def start_of(part: slice | None) -> int:
    """Where a piece starts in its layer (``None``: the whole layer, at 0)."""
    return 0 if part is None else part.start


@dataclass
class ExchangeStep:
    """One ``average`` call, as its routes see it."""

    memory: ErrorFeedback  # the workers' residuals
    server_memory: ErrorFeedback  # the two-phase exchange's second residuals
    workspaces: Workspaces
    clock: Clock
    group: Any
    world: int
    rank: int
    piece_numel: int | None
    calibrating: bool

    @property
    def message_numel(self) -> int | None:
        """Values per message (``None``: one message; so on calibration steps)."""
        return None if self.calibrating else self.piece_numel

    def pieces(self, layer: LayerGradient, chunks: int = 1) -> list[slice | None]:
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


class ExchangeRoute(ABC):
    """One route's layers through a step's three rounds (see the module's docstring)."""

    def __init__(self, step: ExchangeStep, layers: list[LayerGradient]) -> None:
        self.step = step
        self.layers = layers

    @abstractmethod
    def send(self) -> list[Any]:
        """Round 1: encode and start the first collectives; return those round 2 needs."""

    @abstractmethod
    def relay(self) -> None:
        """Round 2: start the second collectives; decode the messages that arrived."""

    @abstractmethod
    def receive(self) -> None:
        """Round 3: wait for what is still on the wire and write the averages."""


class Sent(Protocol):
    """A message whose round-1 collective is ``work``."""

    work: Any


PieceT = TypeVar("PieceT")
MessageT = TypeVar("MessageT", bound=Sent)


class MessageRoute(ExchangeRoute, Generic[MessageT]):
    """A route whose pieces travel in messages (:class:`Batches`), each taken up in round 2 as
    soon as it has arrived, while the next ones are still on the wire."""

    messages: list[MessageT]  # set by send (round 1)

    def relay(self) -> None:
        """Round 2: wait for each message in turn and take it up."""
        for message in self.messages:
            self.step.clock.wait([message.work])
            self.arrived(message)

    @abstractmethod
    def arrived(self, message: MessageT) -> None:
        """Take up a message whose round-1 collective is done."""


class Batches(Generic[PieceT, MessageT]):
    """Pieces grouped into messages: ``send`` starts one once it holds ``limit`` values or more
    (``None``: every piece in one message, sent by :meth:`close`)."""

    def __init__(self, limit: int | None, send: Callable[[list[PieceT]], MessageT]) -> None:
        self.limit = limit
        self.send = send
        self.messages: list[MessageT] = []
        self._pending: list[PieceT] = []
        self._filled = 0

    def add(self, piece: PieceT, numel: int) -> None:
        """Queue an encoded piece of ``numel`` values; send the message if it is full."""
        self._pending.append(piece)
        self._filled += numel
        if self.limit is not None and self._filled >= self.limit:
            self._flush()

    def close(self) -> list[MessageT]:
        """Send what is still queued; return every message, in order."""
        if self._pending:
            self._flush()
        return self.messages

    def _flush(self) -> None:
        self.messages.append(self.send(self._pending))
        self._pending, self._filled = [], 0
