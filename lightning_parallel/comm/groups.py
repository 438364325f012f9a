"""Process groups that keep the run's timeout: no subgroup waits longer than the user asked.

``torch.distributed.new_group`` gives a subgroup torch's default timeout (30 minutes for gloo),
not the one the default group was created with, so a dead peer would block a pipeline's or an
averaging round's collectives far longer than the ``timeout`` a user gave the strategy. Every
group of this package is made by :func:`new_group`, which applies :func:`group_timeout`: the
value the strategy set with :func:`set_group_timeout` when it created the default group (one
strategy per process), or torch's default where none was set (plain-torch use of the cores).

It also steps around a torch defect seen on a GPU (torch 2.11, and still in 2.13's source): when
the default group is bound to a device (Lightning passes ``device_id`` on CUDA) and its backend
is gloo (two ranks sharing one GPU), ``new_group`` makes every rank outside the new group call
``perform_nocolor_split`` on the gloo backend, which gloo advertises (``supports_splitting``)
but does not have: ``AttributeError`` at the first pipeline subgroup. :func:`new_group` unbinds
the default group for the call in that case only (see :func:`_unsplittable_binding`), so the
subgroup is created the ordinary way, by a rendezvous of its members.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import torch.distributed as dist
from torch.distributed.constants import default_pg_timeout

__all__: list[str] = []

_TIMEOUT: timedelta | None = None


def set_group_timeout(timeout: timedelta | None) -> None:
    """Make ``timeout`` the timeout of every group :func:`new_group` creates in this process."""
    global _TIMEOUT
    if timeout is not None and (not isinstance(timeout, timedelta) or timeout.total_seconds() <= 0):
        raise ValueError(f"a group timeout must be a positive timedelta, got {timeout!r}")
    _TIMEOUT = timeout


def group_timeout() -> timedelta:
    """The timeout new groups get: the run's, else torch's default."""
    return _TIMEOUT if _TIMEOUT is not None else default_pg_timeout


def new_group(
    ranks: Sequence[int] | None = None,
    backend: str | None = None,
    timeout: timedelta | None = None,
    members_only: bool = False,
) -> Any:
    """``torch.distributed.new_group`` with the run's timeout (collective: every rank calls it).

    Args:
        ranks: the group's ranks (``None``: all).
        backend: ``"gloo"`` for a CPU side group next to an NCCL default group; ``None``: the
            default group's backend.
        timeout: overrides :func:`group_timeout` for this group.
        members_only: only the members of ``ranks`` call it (torch's
            ``use_local_synchronization``): for a group of survivors, when other ranks are gone.
    """
    with _unsplittable_binding():
        return dist.new_group(
            ranks=None if ranks is None else sorted(ranks),
            backend=backend,
            timeout=timeout if timeout is not None else group_timeout(),
            use_local_synchronization=members_only,
        )


@contextmanager
def _unsplittable_binding() -> Iterator[None]:
    """Unbind the default group's device for the block when torch would split it and cannot.

    torch splits a new group from the default group's backend for the bound device when that
    backend says ``supports_splitting``; ranks outside the new group then call the backend's
    ``perform_nocolor_split``, which gloo lacks. Only in that case is ``bound_device_id`` set
    to ``None`` for the block (and restored after): nothing is split, the group is made by a
    rendezvous instead. NCCL, which has the method, is left alone.
    """
    if not dist.is_initialized():
        yield
        return
    default = dist.distributed_c10d._get_default_group()
    bound = getattr(default, "bound_device_id", None)
    backend = None
    if bound is not None:
        try:
            backend = default._get_backend(bound)
        except RuntimeError:  # no backend for that device: torch does not split either
            backend = None
    if backend is None or not getattr(backend, "supports_splitting", False):
        yield
        return
    if hasattr(getattr(backend, "wrapped_pg", backend), "perform_nocolor_split"):
        yield
        return
    default.bound_device_id = None
    try:
        yield
    finally:
        default.bound_device_id = bound
