"""Process groups that keep the run's timeout: no subgroup waits longer than the user asked.

``torch.distributed.new_group`` gives a subgroup torch's default timeout (30 minutes for gloo),
not the one the default group was created with, so a dead peer would block a pipeline's or an
averaging round's collectives far longer than the ``timeout`` a user gave the strategy. Every
group of this package is made by :func:`new_group`, which applies :func:`group_timeout`: the
value the strategy set with :func:`set_group_timeout` when it created the default group (one
strategy per process), or torch's default where none was set (plain-torch use of the cores).
"""

from __future__ import annotations

from collections.abc import Sequence
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
    return dist.new_group(
        ranks=None if ranks is None else sorted(ranks),
        backend=backend,
        timeout=timeout if timeout is not None else group_timeout(),
        use_local_synchronization=members_only,
    )
