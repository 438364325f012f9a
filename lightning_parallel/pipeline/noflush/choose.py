"""Which weight predictor a SpecTrain stage gets: the default option, and the factory.

:func:`default_prediction` picks the weight-correction option from the optimizer and the
pipeline depth (see the table in :mod:`~.predictors`); :func:`make_weight_predictor` builds the
predictor of one stage for an option: its direction (the optimizer's momentum or moments, or a
smoothed gradient), its learning-rate forecast and its staleness.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

import torch
from torch import nn
from torch.optim import Optimizer

from lightning_parallel.pipeline.noflush.directions import (
    AdamDirection,
    Direction,
    MomentumBuffer,
    SmoothedGradient,
)
from lightning_parallel.pipeline.noflush.error import PredictionErrorMeter
from lightning_parallel.pipeline.noflush.forecast import LearningRateForecast
from lightning_parallel.pipeline.noflush.predictors import (
    PREDICTION_MODES,
    DoubleBufferedWeights,
    SpecTrainPrediction,
    WeightPredictor,
    WeightStashing,
)
from lightning_parallel.pipeline.noflush.stability import (
    heavy_ball_momentum,
    staleness_learning_rate_scale,
)
from lightning_parallel.pipeline.noflush.weights import param_group_index

__all__: list[str] = []


def default_prediction(optimizer: Optimizer | None, stages: int) -> str:
    """What ``prediction="auto"`` uses: ``"v2"`` under Adam/AdamW and on 2-stage pipelines,
    ``"none"`` for other optimizers on deeper ones.

    Chosen by measurement (``docs/spectrain.md``, *Which prediction, measured*), 3 seeds or
    more each: with 4 stages under AdamW v2 ended ahead of stale weights and of weight stashing
    on every seed; with 2 stages under SGD with momentum v2 ended ahead of stale weights on every
    seed; with 4 stages under SGD with momentum no option was ahead beyond the run-to-run noise
    (stage 0 then steps at 2% of the learning rate or less), and ``"none"`` holds no predicted
    weights.
    """
    if isinstance(optimizer, torch.optim.Adam) or stages <= 2:
        return "v2"
    return "none"


def make_weight_predictor(
    mode: str,
    parameters: Sequence[nn.Parameter],
    optimizer: Optimizer | None,
    *,
    stage: int,
    stages: int,
    direction: Literal["auto", "smoothed_gradient", "momentum_buffer", "adam"] = "auto",
    gamma: float | None = None,
    learning_rates: LearningRateForecast | None = None,
    error_sample: int | None = 4096,
    learning_rate_scale: float | str = 1.0,
) -> WeightPredictor:
    """Build the predictor of one stage for ``mode`` in ``"v2" | "v1" | "stash" | "2bw" | "none"``.

    Args:
        mode: the weight-correction option.
        parameters: the stage's parameters (frozen ones are ignored).
        optimizer: the optimizer updating them (needed by v1/v2).
        stage: this stage's index k.
        stages: the number of stages N.
        direction: "adam" for Adam's update direction, "smoothed_gradient" for the paper's
            ``v`` (one extra copy), "momentum_buffer" for SGD's own buffer (the same direction
            when ``gamma`` is the momentum, no copy); "auto" picks "adam" for Adam/AdamW,
            "momentum_buffer" for SGD with momentum (and ``gamma`` unset or equal to it), else
            "smoothed_gradient".
        gamma: smoothing factor; default the optimizer's momentum, else 0.9.
        learning_rates: forecast of the next learning rates; default the current ones.
        error_sample: coordinates sampled by the prediction-error meter; None disables it.
        learning_rate_scale: factor on the stage's learning rate, or ``"staleness"`` for the
            share of the stable step the stage's delay leaves under the optimizer's momentum
            and this correction (:func:`~.stability.staleness_learning_rate_scale`; 1 on the
            last stage).
    """
    if mode not in PREDICTION_MODES:
        raise ValueError(f"prediction must be one of {PREDICTION_MODES}, got {mode!r}")
    trainable = [p for p in parameters if p.requires_grad]
    meter = PredictionErrorMeter(trainable, error_sample) if error_sample else None
    if learning_rate_scale == "staleness":
        delay = (1 if stage < stages - 1 else 0) if mode == "2bw" else stages - stage - 1
        learning_rate_scale = staleness_learning_rate_scale(
            delay, heavy_ball_momentum(optimizer), predicted=mode in ("v1", "v2")
        )
    elif isinstance(learning_rate_scale, str):
        raise ValueError(
            f"learning_rate_scale must be 'staleness' or a factor in (0, 1], got "
            f"{learning_rate_scale!r}"
        )
    common: dict[str, Any] = {
        "stage": stage,
        "stages": stages,
        "meter": meter,
        "optimizer": optimizer,
        "learning_rate_scale": learning_rate_scale,
    }
    if mode == "none":
        return WeightPredictor(trainable, **common)
    if mode == "stash":
        return WeightStashing(trainable, **common)
    if mode == "2bw":
        return DoubleBufferedWeights(trainable, **common)
    if optimizer is None:
        raise ValueError(f"prediction={mode!r} needs the optimizer to read learning rates from")
    groups = param_group_index(trainable, optimizer)
    half = stage // 2 if mode == "v1" else 0
    # a stage that never predicts (the last one under v2) keeps no smoothed gradient
    predicted = trainable if half + stages - stage - 1 > 0 else []
    first = optimizer.param_groups[0]
    momentum = float(first.get("momentum", 0.0) or 0.0)
    if direction == "auto":
        if isinstance(optimizer, torch.optim.Adam):
            direction = "adam"
        elif (
            isinstance(optimizer, torch.optim.SGD)
            and momentum > 0
            and gamma in (None, momentum)
            and len({g.get("momentum") for g in optimizer.param_groups}) == 1
        ):
            direction = "momentum_buffer"
        else:
            direction = "smoothed_gradient"
    chosen: Direction
    if direction == "adam":
        chosen = AdamDirection(predicted, optimizer)
    elif direction == "momentum_buffer":
        chosen = MomentumBuffer(predicted, optimizer)
    elif direction == "smoothed_gradient":
        dampening = float(first.get("dampening", 0.0) or 0.0)
        scale = (1.0 - dampening) / (1.0 - momentum) if momentum > 0 else 1.0
        smoothing = gamma if gamma is not None else (momentum if momentum > 0 else 0.9)
        chosen = SmoothedGradient(predicted, smoothing, scale)
    else:
        raise ValueError(
            "direction must be 'auto', 'smoothed_gradient', 'momentum_buffer' or 'adam', "
            f"got {direction!r}"
        )
    return SpecTrainPrediction(
        trainable,
        direction=chosen,
        learning_rates=learning_rates or LearningRateForecast(optimizer),
        version=mode,  # type: ignore[arg-type]
        groups=groups,
        **common,
    )
