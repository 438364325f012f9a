"""Count the bytes every ``torch.distributed`` collective sends from this rank.

:func:`track_collectives` wraps the public collectives of ``torch.distributed`` (the functions
that torch's DDP comm hooks, Lightning and our strategies call through the module) so that each
call adds to a :class:`~lightning_parallel.comm.ledger.CommLedger` the payload bytes this rank
puts on the wire, from the algorithm's cost model:

=====================  ==========================================  =========================
collective             bytes sent by one rank (payload N bytes)    algorithm assumed
=====================  ==========================================  =========================
all_reduce             2·(W−1)/W · N                                ring (reduce-scatter+gather)
all_gather             (W−1) · N  (N = this rank's input)           ring
reduce_scatter_tensor  (W−1)/W · N  (N = the full input)            ring
all_to_all_single      (W−1)/W · N                                  pairwise
broadcast              (W−1) · N on the source, 0 elsewhere         one to all
send / isend           N  (also inside batch_isend_irecv)           point to point
=====================  ==========================================  =========================

DDP's own reducer (C++, no comm hook) bypasses Python: its cost is added by the
:class:`~lightning_parallel.callbacks.CommStats` callback from the gradient sizes instead.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d

from lightning_parallel.comm.ledger import CommLedger, process_ledger

__all__: list[str] = []

_lock = threading.Lock()
_originals: dict[str, Callable[..., Any]] = {}
_depth = 0
_inside = threading.local()


def _nbytes(tensors: Any) -> int:
    if isinstance(tensors, torch.Tensor):
        return tensors.numel() * tensors.element_size()
    if isinstance(tensors, (list, tuple)):
        return sum(_nbytes(t) for t in tensors)
    return 0


def _group_size(kwargs: dict[str, Any], args: tuple[Any, ...], position: int) -> int:
    group = kwargs.get("group", args[position] if len(args) > position else None)
    try:
        return int(dist.get_world_size(group))
    except (RuntimeError, ValueError):
        return 1


def ring_allreduce_bytes(nbytes: float, world_size: int) -> float:
    """Bytes one rank sends in a ring allreduce of ``nbytes`` over ``world_size`` ranks."""
    return 2.0 * (world_size - 1) / world_size * nbytes if world_size > 1 else 0.0


def _cost(name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> float:
    """Bytes this rank sends for one call of collective ``name``."""
    if name == "all_reduce":
        world = _group_size(kwargs, args, 2)
        return ring_allreduce_bytes(_nbytes(args[0] if args else kwargs.get("tensor")), world)
    if name == "all_gather":
        world = _group_size(kwargs, args, 2)
        return (world - 1) * _nbytes(args[1] if len(args) > 1 else kwargs.get("tensor"))
    if name == "all_gather_into_tensor":
        world = _group_size(kwargs, args, 2)
        return (world - 1) * _nbytes(args[1] if len(args) > 1 else kwargs.get("input_tensor"))
    if name == "reduce_scatter_tensor":
        world = _group_size(kwargs, args, 3)
        full = _nbytes(args[1] if len(args) > 1 else kwargs.get("input"))
        return (world - 1) / world * full if world > 1 else 0.0
    if name == "all_to_all_single":
        world = _group_size(kwargs, args, 4)
        full = _nbytes(args[1] if len(args) > 1 else kwargs.get("input"))
        return (world - 1) / world * full if world > 1 else 0.0
    if name == "broadcast":
        world = _group_size(kwargs, args, 2)
        src = kwargs.get("src", args[1] if len(args) > 1 else 0)
        tensor = args[0] if args else kwargs.get("tensor")
        return (world - 1) * _nbytes(tensor) if dist.get_rank() == src else 0.0
    if name in ("send", "isend"):
        return float(_nbytes(args[0] if args else kwargs.get("tensor")))
    return 0.0


_TRACKED = (
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "reduce_scatter_tensor",
    "all_to_all_single",
    "broadcast",
    "send",
    "isend",
)


def _wrap(name: str, original: Callable[..., Any], ledger: CommLedger) -> Callable[..., Any]:
    @functools.wraps(original)
    def counted(*args: Any, **kwargs: Any) -> Any:
        if getattr(_inside, "call", False):  # e.g. send() calls isend(): count the outer call
            return original(*args, **kwargs)
        start = time.perf_counter()
        _inside.call = True
        try:
            result = original(*args, **kwargs)
        finally:
            _inside.call = False
        blocking = not kwargs.get("async_op", False) and name != "isend"
        seconds = time.perf_counter() - start if blocking else 0.0
        try:
            sent = _cost(name, args, kwargs)
        except Exception:  # accounting must never break training
            sent = 0.0
        ledger.add("collectives", sent, seconds)
        return result

    return counted


@contextmanager
def track_collectives(ledger: CommLedger | None = None) -> Iterator[CommLedger]:
    """Count the bytes of every ``torch.distributed`` collective called inside the block.

    Nested and concurrent uses share one installation; the originals come back when the last
    one exits.
    """
    global _depth
    target = ledger if ledger is not None else process_ledger()
    with _lock:
        if _depth == 0:
            for name in _TRACKED:
                original = getattr(dist, name)
                _originals[name] = original
                setattr(dist, name, _wrap(name, original, target))
            # P2POp and batch_isend_irecv tell sends from receives by ``op is isend`` against
            # the module's own global: it must be the same wrapper as ``dist.isend``, which also
            # counts the sends inside batch_isend_irecv (it calls ``op.op``) exactly once
            distributed_c10d.isend = dist.isend
        _depth += 1
    try:
        yield target
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0:
                for name, original in _originals.items():
                    setattr(dist, name, original)
                distributed_c10d.isend = _originals["isend"]
                _originals.clear()
