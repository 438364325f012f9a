"""Destroy a process group left initialized when the interpreter exits.

Lightning's strategies do not destroy the default process group after ``fit``; torch then
tears it down during the process's final destruction, after Python has stopped, and torch's
own documentation asks for ``destroy_process_group()`` before exit (NCCL warns when it is
missing). Twice in this project's suite a Lightning ``ddp`` / ``ddp_spawn`` run that had
finished ``fit`` then ended with ``terminate called without an active exception`` (SIGABRT)
in rank 0's or rank 1's process; it did not recur in 42 runs alone. A joinable C++ thread of
the group or of the store destroyed that late is the usual cause of that message, so at exit
this hook destroys the group while the interpreter still runs. Processes that end with
``os._exit`` (the fork launcher's children) skip it, as they skip the late destruction too.
"""

from __future__ import annotations

import atexit
import logging

import torch.distributed as dist

__all__: list[str] = []

log = logging.getLogger(__name__)
_REGISTERED = False


def _destroy_left_group() -> None:
    try:
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
    except Exception as error:  # at exit, a failure to tidy up must not mask the run's outcome
        log.debug("destroying the process group at exit failed: %s", error)


def destroy_group_at_exit() -> None:
    """Register the exit hook once per process."""
    global _REGISTERED
    if not _REGISTERED:
        atexit.register(_destroy_left_group)
        _REGISTERED = True
