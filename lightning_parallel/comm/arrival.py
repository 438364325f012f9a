"""Which ranks have reached a point of the program, asked through the rendezvous store.

After a run raised, a collective is safe only if every rank is there to take part: a peer may
be dead, or still blocked inside the step that failed (waiting for a tensor that will never
come). A collective would wait for the group's timeout (30 minutes by default) and fail
anyway. :func:`ranks_missing` asks first, through the store, which still answers when the
process group's connections are broken:

1. every rank sets the key ``{point}/{rank}``;
2. it waits up to ``timeout`` for every rank's key;
3. it returns the ranks whose key did not appear (empty: every rank is there).

Each rank decides from what it saw: one that arrives after another gave up still sees every
key. A caller that goes on into a collective therefore still needs the group's timeout; what
this buys is that the ranks that are waiting for a lost or stuck peer stop after ``timeout``,
not after the group's.
"""

from __future__ import annotations

import time
from datetime import timedelta

import torch.distributed as dist

__all__ = ["ranks_missing"]

_POLL_SECONDS = 0.05


def ranks_missing(
    store: dist.Store, point: str, rank: int, world_size: int, timeout: timedelta
) -> list[int]:
    """The ranks that did not reach ``point`` within ``timeout`` (this rank arrives first).

    ``point`` names one arrival: a point reached several times needs a new name each time.
    A store that does not answer (its host is gone) counts every other rank as missing.
    """
    try:
        store.set(f"{point}/{rank}", "1")
    except (RuntimeError, dist.DistStoreError):
        return [r for r in range(world_size) if r != rank]
    deadline = time.monotonic() + timeout.total_seconds()
    missing = [r for r in range(world_size) if r != rank]
    while missing:
        try:
            missing = [r for r in missing if not store.check([f"{point}/{r}"])]
        except (RuntimeError, dist.DistStoreError):
            return missing
        if not missing or time.monotonic() >= deadline:
            break
        time.sleep(_POLL_SECONDS)
    return missing
