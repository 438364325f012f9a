"""The online prediction error equals the hand computation and samples large stages."""

from __future__ import annotations

import pytest
import torch
from helpers.predictors import drive_stage, make_parameter
from torch import nn

from lightning_parallel.pipeline.noflush import PredictionErrorMeter, make_weight_predictor


def test_prediction_error_meter_equals_hand_computation_and_shows_the_gain() -> None:
    # stage 0 of 3, plain SGD lr 0.1, constant gradient (1, 1): W_u = (3, 4) - 0.1·u·(1, 1).
    # Micro-batch b's gradient is applied with b updates done; its forward saw W_{max(b-2, 0)}.
    def live(u: int) -> torch.Tensor:
        return torch.tensor([3.0, 4.0]) - 0.1 * u

    drift = [float((live(max(b - 2, 0)) - live(b)).norm() / live(b).norm()) for b in range(10)]
    expected_stale = sum(drift) / 10
    for mode in ("none", "v2"):
        w = make_parameter([3.0, 4.0])
        optimizer = torch.optim.SGD([w], lr=0.1)
        predictor = make_weight_predictor(mode, [w], optimizer, stage=0, stages=3, gamma=0.0)
        drive_stage(predictor, optimizer, 10, lambda b: torch.tensor([1.0, 1.0]))
        assert predictor.meter is not None
        means = predictor.meter.pop_means()
        assert means is not None
        prediction_error, stale_error = means
        assert stale_error == pytest.approx(expected_stale, rel=1e-5)
        if mode == "none":
            assert prediction_error == pytest.approx(stale_error)
        else:
            # gamma=0 and a constant gradient: once one gradient is known the prediction is exact
            # (micro-batches 0, 1 and 2 were forwarded before the first update)
            assert prediction_error == pytest.approx(sum(drift[:3]) / 10, rel=1e-5)
        assert predictor.meter.pop_means() is None


def test_meter_samples_coordinates_when_the_stage_is_large() -> None:
    w = nn.Parameter(torch.randn(1000))
    meter = PredictionErrorMeter([w], sample_size=100)
    assert meter.sample(None).numel() == 100
    exact = PredictionErrorMeter([w], sample_size=5000)
    assert exact.sample(None).numel() == 1000
