"""The second residuals of the two-phase 2-bit exchange, and how they return to the gradients.

In the two-phase exchange (:mod:`~lightning_parallel.compression.exchange_two_phase`) rank
``r`` owns chunk ``r`` of every piece of a 2-bit layer and keeps, in the server memory, what its
re-quantization of that chunk did not send, under :func:`server_key`: ``"{name}@chunk{r}of{W}"``
for a layer in one piece, ``"...@{piece start}-{piece stop}"`` for a piece. The residual is in
units of the mean, so when it leaves its layout (the layer turns dense, its pieces change, or a
checkpoint of another layout is loaded) it joins its owner's gradient times ``W``: the average
then gains exactly the residual. A residual of another world size cannot be placed and is
dropped.
"""

from __future__ import annotations

import math
from collections.abc import Collection

from torch import Tensor

from lightning_parallel.compression.error_feedback import ErrorFeedback
from lightning_parallel.compression.exchange_step import LayerGradient

__all__: list[str] = []


def server_key(name: str, rank: int, world: int, part: slice | None) -> str:
    """Key of ``rank``'s second residual: its chunk of the layer, or of the piece ``part``."""
    key = f"{_chunks_of(name)}{rank}of{world}"
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


def _chunks_of(name: str) -> str:
    """The prefix of every second residual's key of the layer ``name``."""
    return f"{name}@chunk"


def server_residual_norm(server_memory: ErrorFeedback, name: str) -> float:
    """The norm of this rank's second residuals of the layer ``name`` (all its chunks)."""
    keys = [key for key in server_memory if key.startswith(_chunks_of(name))]
    return math.sqrt(sum(server_memory.norm(key) ** 2 for key in keys))


def fold_server_residuals(
    server_memory: ErrorFeedback,
    layer: LayerGradient,
    world: int,
    rank: int,
    keep: Collection[str],
) -> None:
    """Move the layer's second residuals not in ``keep`` into this rank's gradient.

    A second residual is held by its chunk's owner in units of the mean: it joins the
    owner's gradient times ``W``, so that the average gains exactly the residual. This
    runs when a layer turns dense (nothing kept) and when its pieces change (another
    ``piece_numel``, or a checkpoint of the one-piece layout).
    """
    prefix = _chunks_of(layer.plan.name)
    for key in [key for key in server_memory if key.startswith(prefix)]:
        if key in keep:
            continue
        server = server_memory.pop(key)
        owned = _owned_values(key[len(prefix) :], server, world, rank)
        if server is None or owned is None:
            continue  # a chunk of another world size: its share is lost with that layout
        start, stop = owned
        stop = min(stop, layer.gradient.numel())
        if stop > start:
            layer.gradient[start:stop].add_(server[: stop - start], alpha=world)


def flush_residuals(
    memory: ErrorFeedback,
    server_memory: ErrorFeedback,
    layer: LayerGradient,
    world: int,
    rank: int,
) -> None:
    """Add to this rank's gradient what the layer kept while it was compressed: its worker
    residual, then its second residuals (see :func:`fold_server_residuals`)."""
    residual = memory.pop(layer.plan.name)
    if residual is not None:
        layer.gradient.add_(residual)
    fold_server_residuals(server_memory, layer, world, rank, keep=())
