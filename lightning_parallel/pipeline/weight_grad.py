"""Deferred weight gradients: one matrix product per step for a linear layer, not one per
micro-batch.

With ``m`` micro-batches, a pipeline stage computes each linear layer's weight gradient
``∂W_j = G_jᵀ·X_j`` ``m`` times and adds it into ``.grad``: ``m`` writes of a weight-sized
tensor and ``m`` weight-sized additions. For large layers at small micro-batch sizes (VGG's
classifier: 33 MB of weights, 4 samples per micro-batch) that memory traffic, not arithmetic,
is the backward's cost. Splitting backward into its input-gradient and weight-gradient parts
(the "B"/"W" split of zero-bubble pipelines, Qi et al., 2024) removes it:

1. backward of micro-batch ``j`` computes only ``∂X_j = G_j·W`` (what the previous stage is
   waiting for) and keeps the pair ``(X_j, G_j)`` (small: activations, not weights);
2. after the stage's last micro-batch, :func:`flush_weight_gradients` computes
   ``∂W = [G_1; …; G_m]ᵀ·[X_1; …; X_m]`` and ``∂b = Σ rows of [G_1; …; G_m]`` in one product,
   and adds them to ``.grad``, while the previous stage runs its own last backward.

The result is the same sum (in a different order of floating-point additions: it is the order
single-process training on the whole mini-batch uses). Only forwards run under
:func:`deferring_weight_gradients` take this path; elsewhere a :class:`DeferredGradLinear` is an
ordinary ``nn.Linear``. The pairs are held until the flush: ``m`` inputs of each linear layer.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from lightning_parallel.pipeline.ownership import adopt_tensors

__all__: list[str] = []

_state = threading.local()


def is_deferring() -> bool:
    """True inside :func:`deferring_weight_gradients`."""
    return bool(getattr(_state, "deferring", False))


@contextmanager
def deferring_weight_gradients(enabled: bool = True) -> Iterator[None]:
    """Forwards in the block leave their linear layers' weight gradients for the flush."""
    previous = is_deferring()
    _state.deferring = enabled
    try:
        yield
    finally:
        _state.deferring = previous


class _LinearInputGradient(torch.autograd.Function):
    """``y = x·Wᵀ + b`` whose backward returns ``∂x`` and keeps ``(x, ∂y)`` for later."""

    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, layer: Any
    ) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.layer = layer
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> Any:
        x, weight = ctx.saved_tensors
        grad_input = None
        if ctx.needs_input_grad[0]:  # in x's dtype, whatever autocast did in the forward
            grad_input = grad_output.matmul(weight.to(grad_output.dtype)).to(x.dtype)
        if ctx.needs_input_grad[1] or ctx.needs_input_grad[2]:
            ctx.layer.pending.append((x.detach(), grad_output.detach()))
        return grad_input, None, None, None


class DeferredGradLinear(nn.Linear):
    """``nn.Linear`` whose weight gradient can wait for :meth:`flush` (shares the original's
    parameters; build it with :meth:`from_linear`)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True) -> None:
        super().__init__(in_features, out_features, bias, device="meta")
        self.pending: list[tuple[torch.Tensor, torch.Tensor]] = []

    @classmethod
    def from_linear(cls, source: nn.Linear) -> DeferredGradLinear:
        layer = cls(source.in_features, source.out_features, source.bias is not None)
        layer.weight = source.weight
        layer.bias = source.bias
        layer.train(source.training)
        return layer

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if is_deferring() and torch.is_grad_enabled() and self.weight.requires_grad:
            return _LinearInputGradient.apply(input, self.weight, self.bias, self)
        return F.linear(input, self.weight, self.bias)

    @torch.no_grad()
    def flush(self) -> None:
        """Add the weight (and bias) gradient of every kept micro-batch to ``.grad``."""
        if not self.pending:
            return
        inputs = torch.cat([x.reshape(-1, x.shape[-1]) for x, _ in self.pending])
        grads = torch.cat([g.reshape(-1, g.shape[-1]) for _, g in self.pending])
        self.pending.clear()
        inputs = inputs.to(grads.dtype)
        kept = self.weight.grad
        if kept is not None and kept.dtype == grads.dtype:
            # accumulating (a second step's micro-batches, gradient accumulation): the product
            # added in place, without a temporary the size of the weight
            kept.addmm_(grads.t(), inputs)
        else:
            _accumulate(self.weight, grads.t().mm(inputs))
        if self.bias is not None:
            _accumulate(self.bias, grads.sum(0))


def _accumulate(parameter: torch.Tensor, gradient: torch.Tensor) -> None:
    gradient = gradient.to(parameter.dtype)
    if parameter.grad is None:
        parameter.grad = gradient
    else:
        parameter.grad.add_(gradient)


def convert_deferred_weight_gradients(module: nn.Module) -> dict[str, nn.Linear]:
    """Replace every ``nn.Linear`` inside ``module`` by a :class:`DeferredGradLinear`, in place
    (same parameters, same ``state_dict`` keys). Returns the replaced layers by name."""
    replaced: dict[str, nn.Linear] = {}
    for name, child in list(module.named_modules()):
        if type(child) is not nn.Linear or name == "":
            continue
        parent_name, _, attribute = name.rpartition(".")
        setattr(module.get_submodule(parent_name), attribute, DeferredGradLinear.from_linear(child))
        replaced[name] = child
    return replaced


def restore_linear(module: nn.Module, replaced: dict[str, nn.Linear]) -> None:
    """Put back the layers :func:`convert_deferred_weight_gradients` replaced, with the tensors
    the replacements hold now (a pipeline may have moved or replaced them meanwhile)."""
    for name, original in replaced.items():
        parent_name, _, attribute = name.rpartition(".")
        parent = module.get_submodule(parent_name)
        current = getattr(parent, attribute)
        adopt_tensors(original, current)
        original.train(current.training)
        setattr(parent, attribute, original)


def deferred_linears(module: nn.Module) -> list[DeferredGradLinear]:
    """The :class:`DeferredGradLinear` layers inside ``module``."""
    return [child for child in module.modules() if isinstance(child, DeferredGradLinear)]


def flush_weight_gradients(layers: list[DeferredGradLinear]) -> None:
    """Compute every kept weight gradient of ``layers`` (the end of a stage's backward)."""
    for layer in layers:
        layer.flush()


def discard_weight_gradients(layers: list[DeferredGradLinear]) -> None:
    """Drop kept pairs without computing them (a step abandoned half-way)."""
    for layer in layers:
        layer.pending.clear()
