"""What a round touches besides parameters: buffers (BatchNorm statistics), optimizer state."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import torch
from torch import Tensor, nn
from torch.optim import Optimizer

__all__: list[str] = []

BufferPolicy = Literal["average", "local"]
OptimizerStatePolicy = Literal["keep", "average", "reset"]

#: ``average``: floating-point buffers (BatchNorm running mean and variance) are averaged with
#: the parameters every round; ``local``: each replica keeps its own (rank 0's are saved).
BUFFER_POLICIES: tuple[str, ...] = ("average", "local")
#: ``keep``: each worker keeps its own optimizer state (momentum, Adam moments) across rounds;
#: ``average``: floating-point state tensors are averaged every round; ``reset``: the state is
#: cleared every round, as if the optimizer were new.
OPTIMIZER_STATE_POLICIES: tuple[str, ...] = ("keep", "average", "reset")


def check_choice(name: str, value: str, choices: Sequence[str]) -> str:
    """Return ``value`` if it is one of ``choices``, else raise naming the valid ones."""
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(map(repr, choices))}; got {value!r}")
    return value


def trainable_parameters(module: nn.Module) -> list[Tensor]:
    """The parameters a round averages: those that train (frozen ones never diverge)."""
    return [parameter for parameter in module.parameters() if parameter.requires_grad]


def floating_buffers(module: nn.Module) -> list[Tensor]:
    """Buffers that can be averaged (integer counters such as ``num_batches_tracked`` agree)."""
    return [buffer for buffer in module.buffers() if torch.is_floating_point(buffer)]


def round_buffers(module: nn.Module, policy: str) -> list[Tensor]:
    """The buffers a round averages under ``policy``."""
    return floating_buffers(module) if policy == "average" else []


def optimizer_state_tensors(
    optimizers: Sequence[Optimizer], parameters: Sequence[Tensor] | None = None
) -> list[Tensor]:
    """Floating-point, non-scalar state tensors of ``optimizers`` in a fixed order.

    Scalars (such as Adam's ``step``) are counters equal on every rank and stay as they are.
    ``parameters`` restricts the result to the state of those parameters (a fragment's).
    """
    only = None if parameters is None else {id(parameter) for parameter in parameters}
    tensors = []
    for optimizer in optimizers:
        for group in optimizer.param_groups:
            for parameter in group["params"]:
                if only is not None and id(parameter) not in only:
                    continue
                state = optimizer.state.get(parameter, {})
                for key in sorted(state):
                    value = state[key]
                    if (
                        isinstance(value, Tensor)
                        and torch.is_floating_point(value)
                        and value.dim() > 0
                    ):
                        tensors.append(value)
    return tensors


def reset_optimizer_state(
    optimizers: Sequence[Optimizer], parameters: Sequence[Tensor] | None = None
) -> None:
    """Forget every optimizer's per-parameter state (momentum, moments, step counters), or
    only that of ``parameters`` (a fragment's)."""
    for optimizer in optimizers:
        if parameters is None:
            optimizer.state.clear()
            continue
        for parameter in parameters:
            optimizer.state.pop(parameter, None)
