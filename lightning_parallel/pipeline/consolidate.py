"""One whole-model checkpoint from stages held on different ranks, one stage at a time.

Each pipeline rank holds only its own stage (:mod:`~lightning_parallel.pipeline.ownership`),
yet a checkpoint must be one consolidated file that loads under ``ddp`` or on one device.
:func:`gather_to_root` builds it without any rank holding the whole model:

1. for each stage ``k`` in turn, its owner serializes its *pieces* (named weights, optimizer
   state, other per-stage state: any nested structure of tensors and small values) with
   ``torch.save`` and sends the bytes to the root (a size, then one ``uint8`` tensor);
2. the root writes them to a file in a spill folder, drops them, and loads the file back
   memory-mapped (``torch.load(mmap=True)``): the stage's tensors are then pages of a file,
   not process memory, and the next stage may come;
3. the root merges every stage's pieces into its checkpoint and writes it with
   :func:`lightning_parallel.files.save_atomically` (a temporary file beside the target,
   renamed: the previous checkpoint stays whole until the new one is complete; Lightning's own
   writer would first build the whole file in memory).

So the root holds its own stage plus one stage in transit; every other rank its own stage plus
its serialized copy. :func:`broadcast_stage_state` is the older, all-ranks consolidation that
engines which keep the whole model on every rank (the DeepSpeed peer) still use.
"""

from __future__ import annotations

import io
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from lightning_parallel.comm.devices import broadcast_, empty_for, to_group
from lightning_parallel.compat.types import StrPath

__all__: list[str] = []


def _send_pieces(pieces: Any, root: int, group: dist.ProcessGroup | None) -> None:
    buffer = io.BytesIO()
    torch.save(pieces, buffer)
    payload = torch.frombuffer(bytearray(buffer.getbuffer()), dtype=torch.uint8)
    del buffer
    size = torch.tensor([payload.numel()], dtype=torch.int64)
    dist.send(to_group(size, group, point_to_point=True), dst=root, group=group)
    dist.send(to_group(payload, group, point_to_point=True), dst=root, group=group)


def _receive_pieces(owner: int, spill: Path, group: dist.ProcessGroup | None) -> Any:
    size = empty_for(group, (1,), torch.int64)
    dist.recv(size, src=owner, group=group)
    payload = empty_for(group, (int(size.item()),), torch.uint8)
    dist.recv(payload, src=owner, group=group)
    payload = payload.cpu()
    path = spill / f"from_rank{owner}.pt"
    with path.open("wb") as stream:
        stream.write(payload.numpy().data)
    del payload
    return torch.load(path, mmap=True, map_location="cpu", weights_only=False)


def gather_to_root(
    pieces: Any,
    owners: Sequence[int],
    root: int,
    spill: Path | None,
    group: dist.ProcessGroup | None = None,
) -> list[Any] | None:
    """Every stage's ``pieces`` on ``root``, one stage in transit at a time (collective over
    the owners and the root; other ranks return at once).

    Args:
        pieces: this rank's pieces if it owns a stage in ``owners`` (else ignored).
        owners: the global rank that owns each stage, in stage order.
        root: the rank that receives.
        spill: on the root, the folder received stages are memory-mapped from (must outlive
            the use of the result).
        group: a group with every owner and the root; a gloo side group preferably
            (:func:`lightning_parallel.comm.devices.side_group`: CPU bytes travel, no copy).

    Returns:
        On the root, the pieces of every stage (received ones memory-mapped); elsewhere
        ``None``.
    """
    rank = dist.get_rank() if dist.is_initialized() else root
    result: list[Any] = []
    for owner in owners:
        if owner == root:
            if rank == root:
                result.append(pieces)
            continue
        if rank == owner:
            _send_pieces(pieces, root, group)
        elif rank == root:
            assert spill is not None, "the root needs a spill folder"
            spill.mkdir(parents=True, exist_ok=True)
            stage_spill = spill / f"stage{len(result)}"
            stage_spill.mkdir(exist_ok=True)
            result.append(_receive_pieces(owner, stage_spill, group))
    return result if rank == root else None


def local_folder(filepath: StrPath) -> str | None:
    """The folder of a local checkpoint path, created if missing, for the spill folder (beside
    the checkpoint: the same file system); ``None`` for a URL (the system's temporary folder)."""
    if "://" in str(filepath):
        return None
    folder = Path(filepath).parent
    folder.mkdir(parents=True, exist_ok=True)
    return str(folder)


def remove_spill(spill: Path | None) -> None:
    """Delete a spill folder (after the checkpoint that maps it was written)."""
    if spill is not None:
        shutil.rmtree(spill, ignore_errors=True)


@torch.no_grad()
def broadcast_stage_state(
    stages: Sequence[Sequence[torch.Tensor]],
    owners: Sequence[int],
    own_stage: int,
    group: dist.ProcessGroup | None = None,
) -> None:
    """Copy every stage's parameters and buffers from global rank ``owners[k]`` to all ranks
    (for engines that keep the whole model on every rank).

    Args:
        stages: per stage, its parameters and buffers (:func:`~.ownership.stage_tensors`), in
            the same order on every rank.
        owners: global rank that holds the authoritative copy of each stage.
        own_stage: the stage this rank runs (its copy is kept as it is).
        group: group over which to broadcast (every rank of it takes part).
    """
    rank = dist.get_rank()
    for stage, (stage_state, owner) in enumerate(zip(stages, owners)):
        by_dtype: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
        for tensor in stage_state:
            by_dtype.setdefault((tensor.dtype, tensor.device), []).append(tensor)
        for (dtype, device), tensors in by_dtype.items():
            total = sum(t.numel() for t in tensors)
            if rank == owner:
                flat = torch.cat([t.detach().reshape(-1) for t in tensors])
            else:
                flat = torch.empty(total, dtype=dtype, device=device)
            broadcast_(flat, owner, group)
            if stage == own_stage:
                continue
            offset = 0
            for tensor in tensors:
                tensor.copy_(flat[offset : offset + tensor.numel()].view_as(tensor))
                offset += tensor.numel()
