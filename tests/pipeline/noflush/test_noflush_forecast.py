"""Schedule-aware prediction sums the learning rates the scheduler will really give."""

from __future__ import annotations

import pytest
import torch
from helpers.predictors import apply_update, make_parameter

from lightning_parallel.pipeline.noflush import (
    LearningRateForecast,
    ScheduledLearningRate,
    make_weight_predictor,
)


def test_schedule_aware_sums_the_schedulers_future_learning_rates() -> None:
    w = make_parameter([1.0, 1.0])
    optimizer = torch.optim.SGD([w], lr=1.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda e: 0.5**e)
    forecast = ScheduledLearningRate(optimizer, scheduler, updates_per_scheduler_step=2)
    predictor = make_weight_predictor(
        "v2", [w], optimizer, stage=0, stages=4, gamma=0.0, learning_rates=forecast
    )
    g = torch.tensor([1.0, 2.0])
    apply_update(predictor, optimizer, g)  # one update done in the current scheduler period
    # next 3 updates: periods (1+0)//2=0, (1+1)//2=1, (1+2)//2=1 -> lrs 1, 0.5, 0.5
    assert forecast.sums(3) == [pytest.approx(2.0)]
    forward = predictor.forward_weights(0)
    assert forward is not None
    torch.testing.assert_close(forward[0], w.detach() - 2.0 * g)  # gamma=0: v = last gradient
    assert optimizer.param_groups[0]["lr"] == 1.0 and scheduler.last_epoch == 0  # untouched
    constant = LearningRateForecast(optimizer)
    assert constant.sums(3) == [pytest.approx(3.0)]


def test_schedule_forecast_matches_the_rates_that_really_occur() -> None:
    w = make_parameter([1.0])
    optimizer = torch.optim.SGD([w], lr=0.3)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=0.3, total_steps=40)
    forecast = ScheduledLearningRate(optimizer, scheduler, updates_per_scheduler_step=3)
    predictions: list[tuple[int, float]] = []
    applied: list[float] = []
    for update in range(60):
        predictions.append((update, forecast.sums(5)[0]))
        applied.append(optimizer.param_groups[0]["lr"])
        w.grad = torch.ones(1)
        optimizer.step()
        forecast.note_update()
        if (update + 1) % 3 == 0:
            scheduler.step()
    for update, predicted in predictions:
        if update + 5 <= len(applied):
            assert predicted == pytest.approx(sum(applied[update : update + 5]), rel=1e-6)
