"""The messages between workers and server shards: fixed int64 headers, then one tensor.

Only tensors cross the wire. Every message is a header of :data:`HEADER_SIZE` int64 values,
followed by one flat tensor when the header says so:

=============  ========================================================  =====================
direction      header fields                                             then
=============  ========================================================  =====================
worker→shard   kind, worker, read version, flags, want, epoch batches,   the gradient slice if
               batches held
                                                                         ``HAS_GRADIENT``
shard→worker   kind, version, granted, flags, staleness, failed rank,    the weights slice
               failure kind, workers lost so far
                                                                         (always)
=============  ========================================================  =====================

Tags keep the four streams apart on the parameter-server process group, so a rank that is
both a worker (main thread) and a shard host (server threads) never mixes them up.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum, IntFlag

import torch
from torch import Tensor

__all__: list[str] = []

HEADER_SIZE = 8

#: Point-to-point tags on the parameter-server group.
REQUEST_HEADER_TAG = 7301
REQUEST_GRADIENT_TAG = 7302
REPLY_HEADER_TAG = 7303
REPLY_WEIGHTS_TAG = 7304


class RequestKind(IntEnum):
    """What a worker asks of a shard."""

    BEGIN = 1  # an epoch starts: send weights, register my batches with the epoch budget
    STEP = 2  # here is my gradient (or none: a pull); send fresh weights
    CLAIM = 3  # grant me more batches of the epoch budget
    LEAVE = 4  # I stop training (fit ended); no reply


class RequestFlag(IntFlag):
    """Options of a :attr:`RequestKind.STEP` request."""

    NONE = 0
    HAS_GRADIENT = 1  # a gradient tensor follows the header
    DRAIN = 2  # my last step of the epoch: reply once every worker has drained
    RESTART = 4  # (with BEGIN) I restart this epoch before training: refund my batches
    KEEPS_GRANTS = 8  # lend none of my granted batches (I may start several between requests)


class ReplyKind(IntEnum):
    """What a shard answers."""

    WEIGHTS = 1
    ABORT = 2  # a worker failed; the run stops (the weights that follow are not to be used)


class ReplyFlag(IntFlag):
    """Facts a reply carries besides the weights."""

    NONE = 0
    EPOCH_OVER = 1  # the epoch budget is spent: no more batches will be granted
    RUN_OVER = 2  # the run's batch budget (max_steps) is spent: stop after this epoch
    DROPPED = 4  # the worker's gradient was too stale and was dropped


class FailureKind(IntEnum):
    """Why a worker was declared failed (travels in an ``ABORT`` header)."""

    UNKNOWN = 0
    CONNECTION_LOST = 1  # its process died: the connection closed
    SILENT = 2  # no heartbeat for longer than the timeout
    PROTOCOL = 3  # it sent a request the server could not accept
    LOST = 4  # (to the lost worker itself) it came back after the others went on without it


FAILURE_TEXT = {
    FailureKind.UNKNOWN: "failed",
    FailureKind.CONNECTION_LOST: "its connection closed (the process died)",
    FailureKind.SILENT: "its heartbeat stopped (no heartbeat for longer than the timeout)",
    FailureKind.PROTOCOL: "it sent a request the server could not accept",
    FailureKind.LOST: "it was declared lost and the others went on without it",
}


@dataclass
class Request:
    """A worker's message to one shard."""

    kind: RequestKind
    worker: int
    read_version: int = 0
    flags: RequestFlag = RequestFlag.NONE
    want: int = 0
    epoch_batches: int = 0
    gradient: Tensor | None = None
    held: int = 0  # granted batches this worker has not used yet

    def header(self) -> Tensor:
        """The int64 header that goes on the wire."""
        values = [
            int(self.kind),
            self.worker,
            self.read_version,
            int(self.flags),
            self.want,
            self.epoch_batches,
            self.held,
        ]
        return torch.tensor(values + [0] * (HEADER_SIZE - len(values)), dtype=torch.int64)

    @classmethod
    def from_header(cls, header: Tensor, gradient: Tensor | None = None) -> Request:
        """Decode a received header (the gradient, if any, is received separately)."""
        kind, worker, read_version, flags, want, epoch_batches, held = header[:7].tolist()
        return cls(
            RequestKind(kind),
            worker,
            read_version,
            RequestFlag(flags),
            want,
            epoch_batches,
            gradient,
            held,
        )


@dataclass
class Reply:
    """A shard's message to one worker."""

    worker: int
    kind: ReplyKind
    version: int
    weights: Tensor
    granted: int = 0
    flags: ReplyFlag = ReplyFlag.NONE
    staleness: int = -1  # staleness of the worker's gradient answered here (-1: none)
    failed_rank: int = -1
    failure: FailureKind = FailureKind.UNKNOWN
    lost: int = 0  # workers the server went on without, so far
    reason: str = ""  # the detailed reason (in-process only; the kind goes on the wire)

    def header(self) -> Tensor:
        """The int64 header that goes on the wire."""
        values = [
            int(self.kind),
            self.version,
            self.granted,
            int(self.flags),
            self.staleness,
            self.failed_rank,
            int(self.failure),
            self.lost,
        ]
        return torch.tensor(values + [0] * (HEADER_SIZE - len(values)), dtype=torch.int64)

    @classmethod
    def from_header(cls, worker: int, header: Tensor, weights: Tensor) -> Reply:
        """Decode a received header with the weights received after it."""
        kind, version, granted, flags, staleness, failed_rank, failure, lost = header.tolist()
        return cls(
            worker,
            ReplyKind(kind),
            version,
            weights,
            granted,
            ReplyFlag(flags),
            staleness,
            failed_rank,
            FailureKind(failure),
            lost,
        )


WIRE_DTYPE_NAMES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


def parse_wire_dtype(value: str | torch.dtype | None) -> torch.dtype | None:
    """The dtype gradients and weights travel in (``None``: the parameters' own)."""
    if value is None or isinstance(value, torch.dtype):
        return value
    if value in ("none", "None"):
        return None
    if value not in WIRE_DTYPE_NAMES:
        raise ValueError(
            f"wire_dtype must be one of {sorted(WIRE_DTYPE_NAMES)} or None, got {value!r}"
        )
    return WIRE_DTYPE_NAMES[value]
