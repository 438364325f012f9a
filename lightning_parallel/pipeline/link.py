"""How fast a pipeline's stage-to-stage links move bytes, measured once before partitioning.

A cut between stages carries, per micro-batch, the activations forward and their gradients
back. Where the link between two stages is slow against the stages' compute (two hosts over
1 Gbit/s, a cut early in a CNN where feature maps are large), the cut's transfer decides the
step as much as the compute does, and a partition that balances compute alone can pick the cut
with the largest activations. :func:`measure_link_seconds_per_byte` times the links the
pipeline will use, all at once as training uses them:

1. every rank that holds stage ``k < p−1`` of a group posts a send of ``size`` bytes to the
   rank of stage ``k+1``, and every rank of stage ``k > 0`` posts the matching receive, after
   one barrier so that all start together; this repeats ``repeats`` times;
2. each receiver's seconds per byte is its wall time over the bytes it received;
3. every rank learns the slowest link's seconds per byte (one ``all_gather_object``), which
   the partition adds to each stage's time per micro-batch for the bytes it sends
   (:func:`~lightning_parallel.pipeline.partition.partition`, ``link_seconds_per_byte``).
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch
import torch.distributed as dist

from lightning_parallel.comm.devices import empty_for, to_group

__all__: list[str] = []

PROBE_BYTES = 4 * 2**20


def measure_link_seconds_per_byte(
    pipelines: Sequence[Sequence[int]],
    rank: int,
    device: torch.device,
    size: int = PROBE_BYTES,
    repeats: int = 2,
) -> float:
    """Seconds per byte of the slowest stage-to-stage link (collective: every rank calls it).

    Args:
        pipelines: each group's ranks in stage order.
        rank: this process's global rank.
        device: where the probe tensors live (the device the stages' transfers use).
        size: bytes per probe message.
        repeats: messages per link.
    """
    previous = next_rank = None
    for ranks in pipelines:
        if rank in ranks:
            stage = list(ranks).index(rank)
            previous = ranks[stage - 1] if stage > 0 else None
            next_rank = ranks[stage + 1] if stage + 1 < len(ranks) else None
    # on the default group's device (comm.devices): the stages' device over NCCL, the host
    # over gloo, as the stages' own transfers
    outgoing = to_group(
        torch.ones(size // 4, dtype=torch.float32, device=device), point_to_point=True
    )
    incoming = empty_for(None, outgoing.shape, outgoing.dtype)
    dist.barrier()
    start = time.perf_counter()
    for _ in range(repeats):
        works = [
            *([dist.isend(outgoing, next_rank)] if next_rank is not None else []),
            *([dist.irecv(incoming, previous)] if previous is not None else []),
        ]
        for work in works:
            if work is not None:
                work.wait()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    mine = (time.perf_counter() - start) / (repeats * size) if previous is not None else 0.0
    everyone: list[float | None] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    return max(float(value or 0.0) for value in everyone)
