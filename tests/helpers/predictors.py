"""Drive one stage's weight predictor by hand: one update, or the no-flush order of a stage."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from lightning_parallel.pipeline.noflush import WeightPredictor


def apply_update(
    predictor: WeightPredictor, optimizer: torch.optim.Optimizer, grad: torch.Tensor
) -> None:
    """One optimizer update of the single parameter with gradient ``grad``."""
    (param,) = predictor.parameters
    param.grad = grad.clone()
    predictor.before_update()
    optimizer.step()
    predictor.after_update()
    param.grad = None


def drive_stage(
    predictor: WeightPredictor,
    optimizer: torch.optim.Optimizer,
    batches: int,
    grad: Callable[[int], torch.Tensor],
) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """Run the 1F1B no-flush order of one stage: F(t), then B(t-(N-k-1)) and its update.

    Returns, per micro-batch, the weights its forward and its backward saw.
    """
    (param,) = predictor.parameters
    lag = predictor.stages - predictor.stage - 1
    seen: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    forward_seen: dict[int, torch.Tensor] = {}
    pending = 0
    for t in range(batches + lag):
        if t < batches:
            used = predictor.forward_weights(t)
            forward_seen[t] = (param.detach() if used is None else used[0]).clone()
        b = t - lag
        if b >= 0:
            used = predictor.backward_weights(b)
            seen[b] = (forward_seen.pop(b), (param.detach() if used is None else used[0]).clone())
            predictor.release(b)
            param.grad = grad(b) if param.grad is None else param.grad + grad(b)
            pending += 1
            if pending == predictor.update_period:
                param.grad /= pending
                predictor.before_update()
                optimizer.step()
                predictor.after_update()
                param.grad = None
                pending = 0
    return seen


def make_parameter(values: list[float]) -> nn.Parameter:
    """A trainable parameter holding ``values``."""
    return nn.Parameter(torch.tensor(values))
