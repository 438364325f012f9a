"""A stage's received activations as tensors it may modify in place.

A stage after the first receives its input as a leaf that requires grad (its ``.grad`` is what
goes back to the previous stage). Autograd refuses an in-place operation on such a leaf, and
models do one at a stage's start wherever a cut lands before torchvision's
``ReLU(inplace=True)`` and the like. :func:`stage_inputs` hands the stage the identity of each
leaf through :class:`StageEntry`: the same storage (no copy), but not a leaf, so the in-place
operation is allowed and the gradient reaches the leaf's ``.grad`` unchanged.

Without autograd (the first forward of a micro-batch that is recomputed in backward) each
leaf is copied instead: the recomputation runs from the received input, which an in-place
operation must not have changed. The copy lives only during that forward.
"""

from __future__ import annotations

from typing import Any

import torch

__all__: list[str] = []


class StageEntry(torch.autograd.Function):
    """The identity from a received leaf to the tensor a stage computes on (shared storage)."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.detach()

    @staticmethod
    def backward(ctx: Any, gradient: torch.Tensor) -> torch.Tensor:
        return gradient


def _enter(tensor: Any) -> Any:
    if not isinstance(tensor, torch.Tensor) or not tensor.requires_grad or not tensor.is_leaf:
        return tensor
    if torch.is_grad_enabled():
        return StageEntry.apply(tensor)
    return tensor.detach().clone()


def stage_inputs(value: Any) -> Any:
    """``value`` (a tensor or a tuple of them, as received) with every leaf that requires grad
    replaced as the module doc says."""
    if isinstance(value, tuple):
        return tuple(_enter(item) for item in value)
    return _enter(value)
