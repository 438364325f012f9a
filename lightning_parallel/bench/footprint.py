"""Count the bytes of the training state a rank holds: parameters, gradients, optimizer state.

:func:`training_footprint` walks the tensors a rank actually holds at the end of training and
adds up their *storage* sizes, each storage once:

1. the parameters (``param_bytes``);
2. their ``.grad`` (``grad_bytes``);
3. every tensor in every optimizer's ``state`` (``optimizer_bytes``): momentum buffers, Adam's
   moments and step counters, nested in lists or dicts too.

A storage met again (a view, a tied weight, a gradient that is a view into a bucket already
counted) counts once, in the first category that met it. Tensors on the ``meta`` device hold no
memory and are skipped (a pipeline rank's stages that live elsewhere); any other device counts,
so a CUDA rank's figures are its GPU tensors. A tensor subclass that wraps others (``DTensor``'s
local shard) is counted through the tensors it wraps. Plain torch, no Lightning.

Example::

    footprint = training_footprint(model.parameters(), [optimizer])
    assert footprint.param_bytes == sum(p.numel() * p.element_size() for p in model.parameters())
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import Any

import torch

__all__: list[str] = []


@dataclass(frozen=True)
class TrainingFootprint:
    """Bytes of a rank's parameters, gradients and optimizer state (each storage once)."""

    param_bytes: int
    grad_bytes: int
    optimizer_bytes: int

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


class _StorageCounter:
    """Adds each storage's size the first time one of its tensors is met."""

    def __init__(self) -> None:
        self._seen: set[tuple[str, int]] = set()

    def count(self, value: Any) -> int:
        """Bytes of the not yet counted storages of every tensor in ``value`` (nested)."""
        if isinstance(value, torch.Tensor):
            return self._tensor(value)
        if isinstance(value, dict):
            return sum(self.count(item) for item in value.values())
        if isinstance(value, (list, tuple)):
            return sum(self.count(item) for item in value)
        return 0

    def _tensor(self, tensor: torch.Tensor) -> int:
        if tensor.device.type == "meta":
            return 0
        if type(tensor) is not torch.Tensor and type(tensor) is not torch.nn.Parameter:
            flatten = getattr(tensor, "__tensor_flatten__", None)
            if flatten is not None:  # a wrapper subclass: its memory is in the inner tensors
                names, _ = flatten()
                return sum(self._tensor(getattr(tensor, name)) for name in names)
        if tensor.layout != torch.strided:  # sparse: indices and values hold the memory
            if tensor.is_sparse:
                return self._tensor(tensor._indices()) + self._tensor(tensor._values())
            return tensor.numel() * tensor.element_size()
        storage = tensor.untyped_storage()
        size = storage.nbytes()
        key = (str(tensor.device), storage.data_ptr())
        if size == 0 or key in self._seen:
            return 0
        self._seen.add(key)
        return int(size)


def training_footprint(
    parameters: Iterable[torch.Tensor], optimizers: Iterable[torch.optim.Optimizer] = ()
) -> TrainingFootprint:
    """Bytes of ``parameters``, their gradients and ``optimizers``' state (see the module doc)."""
    counter = _StorageCounter()
    parameters = list(parameters)
    param_bytes = sum(counter.count(p.detach()) for p in parameters)
    grad_bytes = sum(counter.count(p.grad) for p in parameters if p.grad is not None)
    optimizer_bytes = sum(
        counter.count(state) for optimizer in optimizers for state in optimizer.state.values()
    )
    return TrainingFootprint(param_bytes, grad_bytes, optimizer_bytes)
