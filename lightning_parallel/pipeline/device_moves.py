"""Moving a model between devices while some of its tensors are on ``meta``.

A pipeline rank holds only its own stage: the other stages' tensors are on the ``meta``
device (:mod:`~lightning_parallel.pipeline.ownership`), and a model built under
``torch.device("meta")`` is materialized stage by stage. ``model.to(device)`` refuses meta
tensors, so :func:`move_real` moves every parameter and buffer that is not on ``meta`` (in
place in its module's slots, a parameter staying a parameter) and leaves the others where they
are. torchmetrics metrics keep their states outside the parameters and buffers: each one with
no meta tensor is moved with its own ``to`` (a metric left behind on the CPU fails its first
update with CUDA inputs); one built on ``meta`` cannot move, and stays.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torchmetrics import Metric

from lightning_parallel.pipeline.stages import is_deferred

__all__: list[str] = []


def move_real(model: nn.Module, device: torch.device) -> nn.Module:
    """``model.to(device)`` for every tensor that is not on the meta device, torchmetrics'
    states included (Lightning's ``model.to`` moves them; a metric left on the CPU fails its
    first update with CUDA inputs)."""
    with torch.no_grad():
        for module in model.modules():
            for slots in (module._parameters, module._buffers):
                for name, tensor in list(slots.items()):
                    if tensor is None or tensor.is_meta or tensor.device == device:
                        continue
                    moved = tensor.to(device)
                    if isinstance(tensor, nn.Parameter):
                        moved = nn.Parameter(moved, requires_grad=tensor.requires_grad)
                    slots[name] = moved  # type: ignore[assignment]
        for module in model.modules():
            # its states are neither parameters nor buffers (a metric built on meta, in
            # configure_model, cannot move: it stays, as its meta tensors do)
            if isinstance(module, Metric) and not _has_meta_tensors(module):
                module.to(device)
    return model


def _has_meta_tensors(metric: Metric) -> bool:
    """Whether a torchmetrics metric holds a meta tensor: a parameter, buffer or state."""
    states = [getattr(metric, name, None) for name in metric._defaults]
    tensors = [t for s in states for t in (s if isinstance(s, list) else [s])]
    return is_deferred(metric) or any(isinstance(t, Tensor) and t.is_meta for t in tensors)
