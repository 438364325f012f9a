"""Plain-torch helpers the strategies need around a module: broadcast it, move optimizer state,
reduce a tensor, attach a DDP comm hook.

Lightning has versions of these, all private (``_sync_module_states``, ``_optimizers_to_device``,
``_sync_ddp_if_available``, ``_register_ddp_comm_hook``); ours keep this package off them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, MutableMapping
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_parallel.comm.devices import all_reduce_, broadcast_

__all__: list[str] = []


def broadcast_module_states(module: torch.nn.Module, src: int = 0, group: Any = None) -> None:
    """Copy rank ``src``'s parameters and buffers into every rank's ``module`` (in place).

    What ``DistributedDataParallel`` does when it wraps a module: every replica starts from the
    same weights. Does nothing outside a process group.
    """
    if not (dist.is_available() and dist.is_initialized()):
        return
    ignore = set(getattr(module, "_ddp_params_and_buffers_to_ignore", ()))
    with torch.no_grad():
        for name, tensor in [*module.named_parameters(), *module.named_buffers()]:
            if name not in ignore:
                broadcast_(tensor.data, src, group)


def optimizers_to_device(optimizers: Iterable[torch.optim.Optimizer], device: torch.device) -> None:
    """Move every optimizer's state tensors to ``device``, leaving ``step`` counters in place.

    Optimizers keep their ``step`` where they created it (a CPU scalar for Adam's capturable
    mode off), so it is not moved.
    """
    for optimizer in optimizers:
        for parameter, state in optimizer.state.items():
            if not isinstance(state, MutableMapping):
                optimizer.state[parameter] = _to_device(state, device)
                continue
            for key, value in state.items():
                if key != "step":
                    state[key] = _to_device(value, device)


def _to_device(value: Any, device: torch.device) -> Any:
    if isinstance(value, Tensor):
        return value.to(device)
    if isinstance(value, (list, tuple)):
        return type(value)(_to_device(item, device) for item in value)
    if isinstance(value, dict):
        return {key: _to_device(item, device) for key, item in value.items()}
    return value


def reduce_tensor(tensor: Tensor, group: Any = None, reduce_op: Any = "mean") -> Tensor:
    """All-reduce ``tensor`` in place over ``group`` and return it; ``"mean"``/``"avg"`` averages.

    gloo has no ``AVG``: the mean is a sum divided by the group's size. Outside a process group
    the tensor is returned as it is.
    """
    if not (dist.is_available() and dist.is_initialized()):
        return tensor
    group = dist.group.WORLD if group is None else group
    average = isinstance(reduce_op, str) and reduce_op.lower() in ("mean", "avg")
    if average:
        op = dist.ReduceOp.SUM
    elif isinstance(reduce_op, str):
        op = getattr(dist.ReduceOp, reduce_op.upper())
    else:
        op = dist.ReduceOp.SUM if reduce_op is None else reduce_op
    all_reduce_(tensor, group, op)
    if not average:
        return tensor
    size = dist.get_world_size(group)
    if not torch.is_floating_point(tensor):
        return tensor.copy_(tensor / size)
    return tensor.div_(size)


def register_comm_hook(
    model: torch.nn.parallel.DistributedDataParallel,
    state: Any,
    hook: Callable[..., Any],
    wrapper: Callable[[Callable[..., Any]], Callable[..., Any]] | None = None,
) -> None:
    """Register ``hook`` (wrapped by ``wrapper`` when given, e.g. an fp16 wrapper) on ``model``."""
    model.register_comm_hook(state=state, hook=wrapper(hook) if wrapper is not None else hook)
