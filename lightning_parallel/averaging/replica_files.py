"""Each rank's replica in a file of its own, next to a checkpoint that holds only the mean.

Between rounds the replicas differ, and an exact resume needs each one (with its optimizer state
and the round in flight). Gathering them into the checkpoint makes it grow with the world size
(a 64-rank run would write 65 models). Instead:

1. every rank writes its own state to ``<checkpoint>.replicas/<save id>/rank<r>.pt``, atomically
   (a temporary file in the same folder, then ``os.replace``);
2. all ranks meet (a barrier), and only then does rank 0 write the checkpoint itself, which
   holds the averaged model, the state every rank shares and the save id: a crash before that
   leaves the previous checkpoint and its files as they were;
3. rank 0 then deletes the files of earlier saves to the same path.

The save id names the optimizer step, so two saves of the same step (a checkpoint and its
``last`` copy) write the same files. Paths with a URL scheme (``s3://``) are not handled here:
the caller keeps the replicas in the checkpoint for them.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import torch

from lightning_parallel.files import save_atomically

__all__: list[str] = []

SUFFIX = ".replicas"


def supports(checkpoint_path: str | os.PathLike[str]) -> bool:
    """Whether replica files can live next to ``checkpoint_path`` (a local path)."""
    return "://" not in str(checkpoint_path)


def replica_path(checkpoint_path: str | os.PathLike[str], save_id: str, rank: int) -> Path:
    """Where rank ``rank`` keeps its replica for the save ``save_id`` of ``checkpoint_path``."""
    return Path(f"{checkpoint_path}{SUFFIX}") / save_id / f"rank{rank}.pt"


def save_replica(state: Any, path: Path) -> None:
    """``torch.save(state, path)``, atomically: readers see the old file or the whole new one."""
    save_atomically(state, path)


def load_replica(path: Path) -> Any:
    """The state :func:`save_replica` wrote (on the CPU)."""
    return torch.load(path, map_location="cpu", weights_only=False)


def remove_other_saves(checkpoint_path: str | os.PathLike[str], keep: str | None) -> None:
    """Delete the replica files of ``checkpoint_path``'s saves other than ``keep`` (all: None)."""
    folder = Path(f"{checkpoint_path}{SUFFIX}")
    if not folder.is_dir():
        return
    for save in folder.iterdir():
        if save.name != keep:
            shutil.rmtree(save, ignore_errors=True)
    if keep is None:
        shutil.rmtree(folder, ignore_errors=True)
