"""A pipeline that never flushes, with the weights each pass uses predicted (SpecTrain), stashed
or stale (PipeDream), in plain torch.

Module by module:

- ``runtime``: :class:`NoFlushPipeline`, one stage's forwards, backwards and updates in the 1F1B
  order across steps, and the :class:`StageTelemetry` it measures.
- ``predictors``: which weights each pass uses (:class:`WeightPredictor` and its options); its
  docstring holds the options table and the algorithm.
- ``choose``: :func:`default_prediction` (the option a stage gets by default) and
  :func:`make_weight_predictor` (a stage's predictor for an option).
- ``directions``: what a prediction moves along: the smoothed gradient, SGD's momentum buffer
  or Adam's update direction.
- ``forecast``: the learning rates of the next updates, current or simulated from the scheduler.
- ``stability``: :func:`staleness_learning_rate_scale`, the step a stale stage can take.
- ``error``: :class:`PredictionErrorMeter`, how far the weights a forward used were off.
- ``weights``: the ``Weights`` alias, byte counts and param-group lookup these modules share.
- ``norms``: :class:`~.norms.GlobalNormEstimate`, each update's gradient norm over all stages
  estimated without waiting (gradient clipping by norm).
- ``mirror``: :class:`~.mirror.AsyncMirror`, the last stage's loss and logged values and every
  stage's telemetry carried to all ranks of a pipeline one step late, without blocking it.
- ``options``: SpecTrain's options checked and normalized, and a stage's learning-rate factor.

``SpecTrainStrategy`` (in ``lightning_parallel.strategies``) drives it from Lightning's training
loop; the pieces it shares with the flush pipeline (schedule tables, transport, timeline) live
in :mod:`lightning_parallel.pipeline`.
"""

from lightning_parallel.pipeline.noflush.choose import default_prediction, make_weight_predictor
from lightning_parallel.pipeline.noflush.directions import (
    AdamDirection,
    MomentumBuffer,
    SmoothedGradient,
)
from lightning_parallel.pipeline.noflush.error import PredictionErrorMeter
from lightning_parallel.pipeline.noflush.forecast import (
    LearningRateForecast,
    ScheduledLearningRate,
)
from lightning_parallel.pipeline.noflush.predictors import (
    PREDICTION_MODES,
    DoubleBufferedWeights,
    SpecTrainPrediction,
    WeightPredictor,
    WeightStashing,
)
from lightning_parallel.pipeline.noflush.runtime import NoFlushPipeline, StageTelemetry
from lightning_parallel.pipeline.noflush.stability import staleness_learning_rate_scale

__all__ = [
    "PREDICTION_MODES",
    "AdamDirection",
    "DoubleBufferedWeights",
    "LearningRateForecast",
    "MomentumBuffer",
    "NoFlushPipeline",
    "PredictionErrorMeter",
    "ScheduledLearningRate",
    "SmoothedGradient",
    "SpecTrainPrediction",
    "StageTelemetry",
    "WeightPredictor",
    "WeightStashing",
    "default_prediction",
    "make_weight_predictor",
    "staleness_learning_rate_scale",
]
