"""Files written so that a crash never leaves a half-written one where a whole one was.

:func:`save_atomically` writes ``torch.save``'s bytes to a temporary file in the target's folder,
flushes them to disk and renames the file over the target (``os.replace``, atomic on one file
system): readers see the previous file or the whole new one. Checkpoints of the pipelines and
the model-averaging replica files use it.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

import torch

__all__ = ["PartialCheckpointError"]


class PartialCheckpointError(RuntimeError):
    """A checkpoint would miss part of the model (a pipeline stage, a replica held by a rank
    that is gone); nothing was written. The message names what is missing and the fix."""


def save_atomically(obj: Any, path: str | os.PathLike[str]) -> None:
    """``torch.save(obj, path)``, atomically (see the module docstring)."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    handle, temporary = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.")
    try:
        with os.fdopen(handle, "wb") as stream:
            torch.save(obj, stream)
            stream.flush()
            os.fsync(stream.fileno())
        os.replace(temporary, target)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
