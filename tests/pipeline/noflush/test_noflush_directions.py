"""Prediction directions: the scaled smoothed gradient, SGD's momentum buffer (the same at no
memory cost) and Adam's update direction equal the hand computation."""

from __future__ import annotations

import pytest
import torch
from helpers.predictors import apply_update, make_parameter

from lightning_parallel.pipeline.noflush import (
    AdamDirection,
    MomentumBuffer,
    SmoothedGradient,
    SpecTrainPrediction,
    make_weight_predictor,
)


def test_momentum_sgd_step_scale_makes_prediction_exact_under_constant_gradient() -> None:
    """torch SGD(momentum=μ) steps η·buf with buf = v/(1-μ): the scale 1/(1-μ) is needed."""
    w = make_parameter([0.0, 0.0])
    optimizer = torch.optim.SGD([w], lr=0.01, momentum=0.9)
    predictor = make_weight_predictor(
        "v2", [w], optimizer, stage=0, stages=4, direction="smoothed_gradient"
    )
    assert isinstance(predictor, SpecTrainPrediction)
    assert isinstance(predictor.direction, SmoothedGradient)
    assert predictor.direction.gamma == 0.9
    assert predictor.direction.step_scale == pytest.approx(10.0)
    g = torch.tensor([1.0, -2.0])
    for _ in range(200):  # long enough for buf and v to converge
        apply_update(predictor, optimizer, g)
    velocity = predictor.direction.velocity[0].clone()
    forward = predictor.forward_weights(0)
    assert forward is not None
    torch.testing.assert_close(forward[0], w.detach() - 3 * 0.01 * 10.0 * velocity)
    for _ in range(3):
        apply_update(predictor, optimizer, g)
    torch.testing.assert_close(forward[0], w.detach(), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("dampening", [0.0, 0.3])
def test_sgd_momentum_buffer_is_the_scaled_smoothed_gradient_at_no_memory_cost(
    dampening: float,
) -> None:
    predictions = {}
    for direction in ("auto", "smoothed_gradient"):
        w = make_parameter([1.0, -1.0, 0.5])
        optimizer = torch.optim.SGD([w], lr=0.1, momentum=0.8, dampening=dampening)
        predictor = make_weight_predictor(
            "v2",
            [w],
            optimizer,
            stage=0,
            stages=3,
            direction=direction,  # type: ignore[arg-type]
        )
        for g in ([1.0, 2.0, 3.0], [-1.0, 0.5, 0.0], [2.0, 2.0, -2.0]):
            apply_update(predictor, optimizer, torch.tensor(g))
        assert isinstance(predictor, SpecTrainPrediction)
        predictions[direction] = (predictor.forward_weights(0), predictor.peak_bytes())
    assert isinstance(
        make_weight_predictor(
            "v2", [make_parameter([1.0])], optimizer, stage=0, stages=2
        ).direction,  # type: ignore[union-attr]
        MomentumBuffer,
    )
    auto, smoothed = predictions["auto"], predictions["smoothed_gradient"]
    assert auto[0] is not None and smoothed[0] is not None
    if dampening == 0.0:  # same recursion from the first update on
        torch.testing.assert_close(auto[0][0], smoothed[0][0])
    else:  # torch's first update ignores dampening: the buffers differ by that first term
        assert not torch.allclose(auto[0][0], smoothed[0][0])
    assert auto[1] == 3 * 4 and smoothed[1] == 2 * 3 * 4  # one prediction (+ v), in bytes


def test_adam_aware_prediction_equals_hand_computation() -> None:
    w = make_parameter([1.0, -1.0])
    lr, wd, eps, (b1, b2) = 0.05, 0.1, 1e-8, (0.9, 0.999)
    optimizer = torch.optim.AdamW([w], lr=lr, weight_decay=wd, eps=eps, betas=(b1, b2))
    predictor = make_weight_predictor("v2", [w], optimizer, stage=0, stages=3)
    assert isinstance(predictor, SpecTrainPrediction)
    assert isinstance(predictor.direction, AdamDirection)
    grads = [torch.tensor([1.0, 0.5]), torch.tensor([-2.0, 1.0])]
    m = torch.zeros(2)
    v = torch.zeros(2)
    for g in grads:
        apply_update(predictor, optimizer, g)
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
    m_hat, v_hat = m / (1 - b1**2), v / (1 - b2**2)
    live = w.detach().clone()
    expected = live - 2 * lr * (m_hat / (v_hat.sqrt() + eps) + wd * live)
    forward = predictor.forward_weights(0)
    assert forward is not None
    torch.testing.assert_close(forward[0], expected, rtol=1e-6, atol=1e-7)


def test_adam_aware_prediction_beats_smoothed_gradient_under_adam() -> None:
    errors = {}
    for direction in ("adam", "smoothed_gradient"):
        w = make_parameter([0.0, 0.0])
        optimizer = torch.optim.Adam([w], lr=0.01)
        predictor = make_weight_predictor(
            "v2",
            [w],
            optimizer,
            stage=0,
            stages=4,
            direction=direction,  # type: ignore[arg-type]
        )
        g = torch.tensor([3.0, -0.2])
        for _ in range(50):
            apply_update(predictor, optimizer, g)
        forward = predictor.forward_weights(0)
        assert forward is not None
        for _ in range(3):
            apply_update(predictor, optimizer, g)
        errors[direction] = float((forward[0] - w.detach()).norm())
    assert errors["adam"] < 1e-3 < errors["smoothed_gradient"]
