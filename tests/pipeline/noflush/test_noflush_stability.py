"""The step a stale stage can take is the stability ratio of delayed heavy ball: sin(π/(2(2τ+1)))
without momentum, (1-μ)/(2(1+μ)) at τ = 1, wider with prediction."""

from __future__ import annotations

import pytest
import torch

from lightning_parallel.pipeline.noflush import staleness_learning_rate_scale


def test_staleness_scale_is_the_delayed_sgd_stability_ratio() -> None:
    """ρ(τ) = sin(π/(2(2τ+1))): the largest stable η·h of x' = x - η·h·x_{t-τ}, over 2."""
    for tau in range(1, 5):
        rho = staleness_learning_rate_scale(tau)

        # largest stable a of x_{t+1} = x_t - a·x_{t-τ}: spectral radius of its state map
        def radius(a: float, tau: int = tau) -> float:
            transition = torch.zeros(tau + 1, tau + 1, dtype=torch.float64)
            transition[0, 0], transition[0, tau] = 1.0, -a
            transition[1:, :-1] = torch.eye(tau, dtype=torch.float64)
            return float(torch.linalg.eigvals(transition).abs().max())

        stable = [a for a in torch.linspace(0.01, 2.0, 400).tolist() if radius(a) < 1.0]
        assert rho == pytest.approx(max(stable) / 2.0, abs=0.004)
    assert staleness_learning_rate_scale(0, 0.9, True) == 1.0
    assert staleness_learning_rate_scale(1) == pytest.approx(0.5)


def test_staleness_scale_under_momentum_is_the_heavy_ball_stability_ratio() -> None:
    """Heavy ball with a one-update-stale gradient, z² - (1+μ)z + μ + η·h, is stable while
    η·h < 1-μ; synchronous while η·h < 2(1+μ): ρ = (1-μ)/(2(1+μ)). Prediction widens it."""
    for momentum in (0.5, 0.9):
        stale = staleness_learning_rate_scale(1, momentum)
        assert stale == pytest.approx((1 - momentum) / (2 * (1 + momentum)), rel=1e-5)
        assert stale <= staleness_learning_rate_scale(1, momentum, predicted=True) < 1.0
    # at μ = 0.9 prediction widens the stable step 2.7 times: 0.27 / 3.8
    assert staleness_learning_rate_scale(1, 0.9, predicted=True) == pytest.approx(0.0711, abs=2e-4)
    deeper = [staleness_learning_rate_scale(tau, 0.9, predicted=True) for tau in (1, 2, 3)]
    assert deeper == sorted(deeper, reverse=True)  # the longer the delay, the smaller the step
