"""Which device a tensor handed to a process group lives on: one rule for every transfer.

Every collective and point-to-point call of this package hands its tensors through
:func:`to_group` (or receives into :func:`empty_for`), which apply the rule:

1. **an NCCL group** takes CUDA tensors (this process's current device), for collectives and
   point-to-point transfers alike: NCCL refuses CPU tensors. Activations, gradients and model
   buffers already live there and go device to device, with no copy.
2. **a gloo group** takes CPU tensors for point-to-point transfers (gloo sends the memory at the
   tensor's address as host memory, so a CUDA tensor is staged through the host); its
   collectives take a tensor where it is, CPU or CUDA (gloo stages a CUDA tensor itself).
3. **bookkeeping** (losses, counters, norms, logged values and their schema, checkpoint bytes:
   small values the host reads) goes over a gloo *side group* (:func:`side_group`), never over
   an NCCL group: no device copy, no stream synchronisation for values the host needs anyway,
   and the tag of a point-to-point message is honoured (NCCL ignores tags and matches messages
   by order).

A group's device follows from its backend (a group created without a backend has the default
group's). :func:`declare_group_device` overrides it: a CPU-only test declares the default group
and the groups that inherit its backend ``cuda``, so that the rule is checked without a GPU.
Where the declared device does not exist, :func:`to_group` leaves the tensor where it is and
remembers the device the rule placed it on (:func:`placed_device`); a tensor handed to such a
group without :func:`to_group` still reads as a CPU tensor, which is the mistake to catch.

:func:`broadcast_` and :func:`all_reduce_` do the round trip for an in-place collective.

Example::

    summary = torch.tensor(values, dtype=torch.float64)  # built on the host
    placed = to_group(summary, group)  # on the group's device (a copy only if needed)
    dist.all_reduce(placed, group=group)
    values = placed.tolist()  # one device-to-host copy
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_parallel.comm.groups import new_group

__all__: list[str] = []

_DEFAULT_KEY = "<default group>"
_declared: dict[str, torch.device] = {}
# tensors placed on a declared device that does not exist here: id -> (tensor, device)
_placed: dict[int, tuple[weakref.ref[Tensor], torch.device]] = {}


def _key(group: Any) -> str:
    if group is None or (dist.is_initialized() and group is dist.GroupMember.WORLD):
        return _DEFAULT_KEY
    return str(group.group_name)


def declare_group_device(group: Any, device: torch.device | str | None) -> None:
    """Treat ``group`` (``None``: the default group) as meant for ``device``, whatever its
    backend; ``device=None`` removes the declaration. For tests of the rule on a CPU-only host.
    """
    key = _key(group)
    if device is None:
        _declared.pop(key, None)
    else:
        _declared[key] = torch.device(device)


def clear_declarations() -> None:
    """Forget every :func:`declare_group_device` and every simulated placement."""
    _declared.clear()
    _placed.clear()


def _cuda_device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cuda")


def group_device(group: Any = None) -> torch.device:
    """The device of ``group``'s tensors: CUDA for an NCCL group, the CPU for gloo (rule 1, 2)."""
    if _declared:
        declared = _declared.get(_key(group))
        if declared is not None:
            return declared
    backend = str(dist.get_backend(group)).lower()
    if "nccl" in backend and "gloo" not in backend:
        return _cuda_device()
    return torch.device("cpu")


def device_for(tensor: Tensor, group: Any = None, *, point_to_point: bool = False) -> torch.device:
    """Where ``tensor`` must be to be handed to ``group``: the group's device, except that a
    gloo collective takes the tensor where it is (rule 2)."""
    target = group_device(group)
    if target.type == "cpu" and not point_to_point:
        return placed_device(tensor)
    return target


def _exists(device: torch.device) -> bool:
    return device.type == "cpu" or (device.type == "cuda" and torch.cuda.is_available())


def _record(tensor: Tensor, device: torch.device) -> Tensor:
    key = id(tensor)

    def forget(_reference: weakref.ref[Tensor], key: int = key) -> None:
        _placed.pop(key, None)

    _placed[key] = (weakref.ref(tensor, forget), device)
    return tensor


def to_group(tensor: Tensor, group: Any = None, *, point_to_point: bool = False) -> Tensor:
    """``tensor`` on the device ``group`` takes it on: the same tensor when it is there already
    (same device type), else a copy (read results from the returned tensor, or
    :func:`copy_back` them). ``point_to_point``: for ``send``/``recv`` and their ``i`` forms."""
    target = device_for(tensor, group, point_to_point=point_to_point)
    current = placed_device(tensor)
    if current.type == target.type:
        return tensor
    if not _exists(target):  # a declared device this host lacks: the rule is only recorded
        return _record(tensor, target)
    if not _exists(current):  # back from a device that only stood in: a copy, as a move is
        return tensor.clone()
    # a blocking copy: gloo reads host memory as soon as the call is made
    return tensor.to(target)


def empty_for(group: Any, shape: Sequence[int], dtype: torch.dtype) -> Tensor:
    """An uninitialised receive buffer of ``shape`` on ``group``'s device: CUDA for NCCL, the
    host for gloo (rule 1, 2)."""
    target = group_device(group)
    if target.type == "cpu" or _exists(target):
        return torch.empty(tuple(shape), dtype=dtype, device=target)
    return _record(torch.empty(tuple(shape), dtype=dtype), target)


def empty_like(tensor: Tensor) -> Tensor:
    """An uninitialised tensor like ``tensor``, on the device the rule placed it on (an output
    buffer of a collective whose input went through :func:`to_group`)."""
    result = torch.empty_like(tensor)
    device = placed_device(tensor)
    return result if device == tensor.device else _record(result, device)


def copy_back(original: Tensor, placed: Tensor) -> Tensor:
    """Write an in-place collective's result from ``placed`` (from :func:`to_group`) into
    ``original`` when they differ; returns ``original``."""
    if placed is not original:
        original.copy_(placed)
    return original


def broadcast_(tensor: Tensor, src: int, group: Any = None) -> Tensor:
    """``dist.broadcast`` of ``tensor`` in place, handed over on ``group``'s device (through
    :func:`to_group` and :func:`copy_back`); returns ``tensor``."""
    placed = to_group(tensor, group)
    dist.broadcast(placed, src=src, group=group)
    return copy_back(tensor, placed)


def all_reduce_(tensor: Tensor, group: Any = None, op: Any = dist.ReduceOp.SUM) -> Tensor:
    """``dist.all_reduce`` of ``tensor`` in place, handed over on ``group``'s device (through
    :func:`to_group` and :func:`copy_back`); returns ``tensor``."""
    placed = to_group(tensor, group)
    dist.all_reduce(placed, op=op, group=group)
    return copy_back(tensor, placed)


def placed_device(tensor: Tensor) -> torch.device:
    """The device the rule placed ``tensor`` on: its own, or the declared device it stands in
    for where that device does not exist (see the module docstring)."""
    entry = _placed.get(id(tensor))
    if entry is not None and entry[0]() is tensor:
        return entry[1]
    return tensor.device


def side_group(ranks: Sequence[int] | None = None) -> Any:
    """A gloo group over ``ranks`` (``None``: all) for CPU bookkeeping (rule 3), with the run's
    timeout. Collective: every rank of the default group calls it, in the same order."""
    return new_group(ranks, backend="gloo")
