"""Give every rank the whole model: each stage's weights and optimizer state from its owner.

During pipelined training a rank only updates its own stage; the copies it holds of the other
stages go stale. A consolidated checkpoint (one that loads under ``ddp`` or on one device), the
model handed back by a spawn/fork launcher, and evaluation on one rank need them all:

1. for each stage ``k`` and each dtype, the owner flattens the stage's parameters and buffers
   into one tensor and broadcasts it; every rank that does not run stage ``k`` copies it in
   (one broadcast per stage and dtype, not per tensor);
2. optimizer state (momentum, Adam moments, step counts) of stage ``k``'s parameters is
   broadcast from the owner as one object per stage (checkpoint time only, off the hot path)
   and installed in every rank's optimizer, so ``optimizer.state_dict()`` is complete.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

__all__: list[str] = []


def stage_tensors(module: nn.Module) -> list[torch.Tensor]:
    """Parameters then buffers of ``module``, each tensor once."""
    seen: set[int] = set()
    tensors = []
    for tensor in [*module.parameters(), *module.buffers()]:
        if id(tensor) not in seen:
            seen.add(id(tensor))
            tensors.append(tensor)
    return tensors


@torch.no_grad()
def broadcast_stage_state(
    stages: Sequence[Sequence[torch.Tensor]],
    owners: Sequence[int],
    own_stage: int,
    group: dist.ProcessGroup | None = None,
) -> None:
    """Copy every stage's parameters and buffers from global rank ``owners[k]`` to all ranks.

    Args:
        stages: per stage, its parameters and buffers (:func:`stage_tensors`), in the same
            order on every rank.
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
            dist.broadcast(flat, src=owner, group=group)
            if stage == own_stage:
                continue
            offset = 0
            for tensor in tensors:
                tensor.copy_(flat[offset : offset + tensor.numel()].view_as(tensor))
                offset += tensor.numel()


def broadcast_optimizer_state(
    optimizer: torch.optim.Optimizer,
    stages: Sequence[Sequence[torch.Tensor]],
    owners: Sequence[int],
    own_stage: int,
    group: dist.ProcessGroup | None = None,
) -> None:
    """Install in ``optimizer`` the state of every stage's parameters, from the stage owners."""
    rank = dist.get_rank()
    parameters = [p for param_group in optimizer.param_groups for p in param_group["params"]]
    index = {id(p): i for i, p in enumerate(parameters)}
    for stage, (stage_parameters, owner) in enumerate(zip(stages, owners)):
        positions = [index[id(p)] for p in stage_parameters if id(p) in index]
        payload: list[Any] = [None]
        if rank == owner:
            payload[0] = {
                i: optimizer.state[parameters[i]]
                for i in positions
                if parameters[i] in optimizer.state
            }
        dist.broadcast_object_list(payload, src=owner, group=group)
        if stage == own_stage:
            continue
        for position, state in payload[0].items():
            parameter = parameters[position]
            optimizer.state[parameter] = {
                key: value.to(parameter.device)
                if isinstance(value, torch.Tensor) and value.dim()
                else value
                for key, value in state.items()
            }
