"""The weights a pass runs on and what holding them costs (shared by the predictors, their
directions and the error meter)."""

from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor, nn
from torch.optim import Optimizer

__all__: list[str] = []

Weights = list[Tensor] | None  # None: the live weights


def tensor_bytes(tensors: Sequence[Tensor]) -> int:
    """Bytes the elements of ``tensors`` take."""
    return sum(t.numel() * t.element_size() for t in tensors)


def param_group_index(parameters: Sequence[nn.Parameter], optimizer: Optimizer | None) -> list[int]:
    """Index of the optimizer param group of each parameter (-1: not optimized, never moves)."""
    if optimizer is None:
        return [0] * len(parameters)
    where = {id(p): g for g, group in enumerate(optimizer.param_groups) for p in group["params"]}
    return [where.get(id(p), -1) for p in parameters]
