"""How far a stale stage may step: the share of the stable learning rate that heavy ball keeps
when its gradient is ``τ`` updates old, with or without SpecTrain's prediction."""

from __future__ import annotations

import torch
from torch import Tensor
from torch.optim import Optimizer

__all__: list[str] = []


def _delayed_radius(rates: Tensor, staleness: int, momentum: float, predicted: bool) -> Tensor:
    """Spectral radius, per ``a = η·h``, of heavy ball on ``f = h·x²/2`` with delayed gradients.

    State ``(x_t, ..., x_{t-τ-1}, η·buf_{t-1})``; the gradient applied at t is taken at
    ``x̂ = x_{t-τ} + c·τ·(x_{t-τ} - x_{t-τ-1})`` (c = 1: SpecTrain's prediction along the last
    step, c = 0: the stale weights).
    """
    tau, c = staleness, 1.0 if predicted else 0.0
    size = tau + 3
    maps = torch.zeros(len(rates), size, size, dtype=torch.float64)
    a = rates.to(torch.float64)
    # η·buf_t = μ·η·buf_{t-1} + a·x̂ ; x_{t+1} = x_t - η·buf_t
    maps[:, 0, 0] = 1.0
    maps[:, 0, tau] -= a * (1.0 + c * tau)
    maps[:, 0, tau + 1] += a * c * tau
    maps[:, 0, size - 1] -= momentum
    maps[:, size - 1, tau] += a * (1.0 + c * tau)
    maps[:, size - 1, tau + 1] -= a * c * tau
    maps[:, size - 1, size - 1] = momentum
    for j in range(1, tau + 2):
        maps[:, j, j - 1] = 1.0
    return torch.linalg.eigvals(maps).abs().amax(dim=-1)


def staleness_learning_rate_scale(
    staleness: int, momentum: float = 0.0, predicted: bool = False
) -> float:
    """Shrink a stale stage's learning rate to the share of the stable step its delay leaves.

    1. Heavy ball (``buf ← μ·buf + g``, ``x ← x - η·buf``) on a quadratic of curvature ``h`` is
       stable while ``η·h < 2(1+μ)``: the learning rate was tuned for that margin (sharpness
       rises until it is used up, "edge of stability").
    2. With the gradient ``τ`` updates stale the bound falls: for plain SGD to
       ``2·sin(π/(2(2τ+1)))`` (1 for τ = 1), and momentum makes it far worse, ``1-μ`` for
       τ = 1, 38 times below the synchronous bound at μ = 0.9: asynchrony acts as extra
       momentum (Mitliagkas et al. 2016, "Asynchrony begets momentum"). SpecTrain's prediction
       along the last step (``predicted``) widens it, 2.7 times at μ = 0.9, but stays 14 times
       short.
    3. Scale the stage's learning rate by the ratio of the two bounds, ``ρ = a*(τ, μ) / 2(1+μ)``
       with ``a*`` the largest ``η·h`` for which the delayed recursion's spectral radius stays
       below 1 (found numerically), so the stale stage keeps the synchronous stability margin
       (PipeMare, Yang et al. 2021, likewise shrinks each stage's step with its delay). 1 when
       τ = 0; 1/2 for τ = 1 without momentum; 0.026 (stale) and 0.071 (predicted) for τ = 1 at
       μ = 0.9.

    Args:
        staleness: updates between a micro-batch's forward and its own update at this stage.
        momentum: heavy-ball momentum μ (SGD's ``momentum``, Adam's ``β1``; the ratio does not
            depend on dampening).
        predicted: whether the pass runs on weights predicted along the momentum direction.
    """
    if staleness < 0:
        raise ValueError(f"staleness must be >= 0, got {staleness}")
    if not 0.0 <= momentum < 1.0:
        raise ValueError(f"momentum must be in [0, 1), got {momentum}")
    if staleness == 0:
        return 1.0
    synchronous = 2.0 * (1.0 + momentum)
    grid = torch.linspace(0.0, synchronous, 2049)[1:]
    unstable = (_delayed_radius(grid, staleness, momentum, predicted) >= 1.0).nonzero()
    if len(unstable) == 0:
        return 1.0
    first = int(unstable[0])
    low, high = (float(grid[first - 1]) if first else 0.0), float(grid[first])
    for _ in range(40):
        middle = (low + high) / 2.0
        radius = _delayed_radius(torch.tensor([middle]), staleness, momentum, predicted)
        low, high = (middle, high) if float(radius[0]) < 1.0 else (low, middle)
    return low / synchronous


def heavy_ball_momentum(optimizer: Optimizer | None) -> float:
    """The momentum μ of the optimizer's first param group (SGD's ``momentum``, Adam's β1)."""
    if optimizer is None or not optimizer.param_groups:
        return 0.0
    group = optimizer.param_groups[0]
    if "betas" in group:
        return float(group["betas"][0])
    return float(group.get("momentum", 0.0) or 0.0)
