"""Settings that every rank must share, checked with one collective.

A setting that differs across ranks (a ``piece_numel`` passed on one rank only, a checkpoint
of another step) sends the ranks down different routes: their collectives stop matching,
which ends in a hang until the timeout or in a wrong sum. :func:`check_same_settings` finds
that at once instead:

1. every setting is digested to 63 bits, ``d = BLAKE2b(repr(canonical(value)))``, the same
   on every rank for the same value (numbers, strings, ``None`` and tuples of them; a number
   counts by its value, so ``1``, ``1.0`` and ``numpy.int64(1)`` agree, while ``True`` stays
   a flag);
2. the vector ``[d_1, ..., d_n, -d_1, ..., -d_n]`` is all-reduced with ``MAX`` over the group,
   which gives each setting's largest digest and, negated, its smallest;
3. a setting differs on some rank exactly when the two differ (up to a digest collision,
   about 2^-63).

Every rank learns the same names and raises the same error, so none is left waiting for
another. The call is a collective: every rank of the group makes it, with the same setting
names in the same order.

Example::

    check_same_settings({"block_size": 512, "piece_numel": None}, group, owner="Hylo")
"""

from __future__ import annotations

import hashlib
import numbers
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

from lightning_parallel.comm.devices import all_reduce_

_SHOWN = 80  # characters of a value that an error message quotes


def digest(value: object) -> int:
    """A 63-bit digest of ``value``'s canonical ``repr``: equal on every process for equal
    plain values."""
    raw = hashlib.blake2b(repr(canonical(value)).encode(), digest_size=8).digest()
    return int.from_bytes(raw, "big") >> 1  # non-negative, so that -d fits in int64


def canonical(value: object) -> object:
    """``value`` with every number as a ``float`` (flags stay ``bool``), in tuples and lists
    too: equal numbers of different types (``512``, ``512.0``, a NumPy scalar) then agree."""
    if isinstance(value, bool) or not isinstance(value, (numbers.Real, tuple, list)):
        return value
    if isinstance(value, numbers.Real):
        return float(value)
    return tuple(canonical(item) for item in value)


def differing_settings(settings: Mapping[str, object], group: Any = None) -> list[str]:
    """The names of ``settings`` whose value is not the same on every rank of ``group``
    (collective; one all-reduce of ``2 n`` int64 values)."""
    digests = torch.tensor([digest(value) for value in settings.values()], dtype=torch.int64)
    bounds = all_reduce_(torch.cat([digests, -digests]), group, op=dist.ReduceOp.MAX)
    highest, lowest = bounds[: len(digests)], -bounds[len(digests) :]
    return [name for name, differs in zip(settings, (highest != lowest).tolist()) if differs]


def check_same_settings(settings: Mapping[str, object], group: Any = None, *, owner: str) -> None:
    """Raise ``ValueError`` on every rank of ``group`` when some of ``settings`` differ across
    its ranks, naming them and this rank's values (collective)."""
    differing = differing_settings(settings, group)
    if not differing:
        return
    rank = dist.get_rank(group)
    values = ", ".join(f"{name}={_shown(settings[name])}" for name in differing)
    raise ValueError(
        f"{owner}: {', '.join(differing)} differ across ranks (rank {rank} has {values}); "
        "the ranks would exchange different messages and hang: pass the same arguments on "
        "every rank (and resume every rank from the same checkpoint)"
    )


def plain_attributes(obj: object) -> tuple[Any, ...]:
    """``obj``'s type name and its public attributes that are plain values (numbers, strings,
    ``None``): the settings of a codec or a cost model, without its state."""
    plain = (bool, numbers.Real, str, type(None))
    items = sorted(
        (name, value)
        for name, value in vars(obj).items()
        if not name.startswith("_") and isinstance(value, plain)
    )
    return (type(obj).__name__, tuple(items))


def _shown(value: object) -> str:
    text = repr(value)
    return text if len(text) <= _SHOWN else text[: _SHOWN - 3] + "..."
