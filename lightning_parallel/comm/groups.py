"""Process groups that keep the run's timeout: no subgroup waits longer than the user asked.

``torch.distributed.new_group`` gives a subgroup torch's default timeout (30 minutes for gloo),
not the one the default group was created with, so a dead peer would block a pipeline's or an
averaging round's collectives far longer than the ``timeout`` a user gave the strategy. Every
group of this package is made by :func:`new_group`, which applies :func:`group_timeout`: the
value the strategy set with :func:`set_group_timeout` when it created the default group (one
strategy per process), or torch's default where none was set (plain-torch use of the cores).

It also steps around torch's split of new groups. When the default group is bound to a device
(Lightning passes ``device_id`` on CUDA), torch creates a new group by splitting the default
group's backend for that device, and every rank outside the new group calls the backend's
``perform_nocolor_split``. That goes wrong in three cases, and :func:`new_group` unbinds the
default group for the call in each (see :func:`_split_that_cannot_work`), so the group is
made the ordinary way, by a rendezvous of its members:

- the backend is gloo (two ranks sharing one GPU): gloo advertises ``supports_splitting``
  but has no ``perform_nocolor_split``, so the first pipeline subgroup raised
  ``AttributeError`` (seen on a GPU under torch 2.11; 2.13's gloo lacks it too);
- the new group asks for another backend (a gloo side group next to an NCCL default group):
  its members build gloo without splitting while the others would split NCCL's communicator,
  a collective the members never join;
- only the members call (``members_only``): the others cannot take part in a split.
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
    with _unbound_if(_split_that_cannot_work(backend, members_only)):
        return dist.new_group(
            ranks=None if ranks is None else sorted(ranks),
            backend=backend,
            timeout=timeout if timeout is not None else group_timeout(),
            use_local_synchronization=members_only,
        )


def _split_that_cannot_work(backend: str | None, members_only: bool) -> bool:
    """Whether torch would split the new group from the default group's bound backend in a
    way that fails or hangs (the three cases of the module docstring)."""
    if not dist.is_initialized():
        return False
    default = dist.distributed_c10d._get_default_group()
    bound = getattr(default, "bound_device_id", None)
    if bound is None:
        return False
    try:
        source = default._get_backend(bound)
    except RuntimeError:  # no backend for that device: torch does not split either
        return False
    if not getattr(source, "supports_splitting", False):
        return False
    if not hasattr(getattr(source, "wrapped_pg", source), "perform_nocolor_split"):
        return True
    return members_only or (backend is not None and backend != dist.get_backend())


@contextmanager
def _unbound_if(unbind: bool) -> Iterator[None]:
    """Set the default group's ``bound_device_id`` to ``None`` for the block (restored after,
    also when the block raises) where ``unbind``; otherwise leave it alone."""
    if not unbind:
        yield
        return
    default = dist.distributed_c10d._get_default_group()
    bound = default.bound_device_id
    default.bound_device_id = None
    try:
        yield
    finally:
        default.bound_device_id = bound
