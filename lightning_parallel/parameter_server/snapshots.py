"""The shard server's weight snapshots, reused once nothing reads them.

A reply carries a read-only snapshot of the shard's weights at one version: sends may still
be reading it while the next update changes the weights, and DC-ASGD keeps exactly the weights
each worker read. A fresh vector per version costs its page faults every time (48 ms for
51.5 MB on a CPU core of this project's machine, against 7 ms for a copy into memory already
touched), on the path of the worker beside the server. :class:`SnapshotPool` hands out a
buffer that no reply, send or worker record still holds instead.

Only the server hands snapshots out, under its lock, so a buffer the pool alone holds stays
unread until the server gives it out again; every holder (a reply, a send's keep-alive until
the send completed, DC-ASGD's weights read) holds the tensor object itself, which its Python
reference count shows.
"""

from __future__ import annotations

import sys

import torch
from torch import Tensor

__all__: list[str] = []

#: Python references to a pooled buffer nobody reads: the pool's list, the loop variable and
#: ``sys.getrefcount``'s own argument
_POOLED_REFERENCES = 3


class SnapshotPool:
    """Snapshot buffers shaped like ``weights``, at most ``limit`` of them kept."""

    def __init__(self, weights: Tensor, limit: int) -> None:
        self.weights = weights
        self.limit = limit
        self._buffers: list[Tensor] = []

    def take(self) -> Tensor:
        """A snapshot of the weights now, in a buffer nothing else holds (made if none is)."""
        for snapshot in self._buffers:
            if sys.getrefcount(snapshot) <= _POOLED_REFERENCES:
                return snapshot.copy_(self.weights)
        snapshot = torch.empty_like(self.weights)
        if len(self._buffers) < self.limit:
            self._buffers.append(snapshot)
        return snapshot.copy_(self.weights)
