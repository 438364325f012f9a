"""SpecTrain's options, checked and normalized before any process starts.

``SpecTrainStrategy`` takes its options as text (a config file's, the benchmark's), so they are
checked where it is built: a typo fails there rather than at the first training batch on every
rank. :func:`check_options` returns the two that have spellings of their own normalized
(``None``/``"none"``), :func:`stage_learning_rate_scale` the factor one stage applies.
"""

from __future__ import annotations

from lightning_parallel.pipeline.noflush.predictors import PREDICTION_MODES

__all__: list[str] = []

DIRECTIONS = ("auto", "smoothed_gradient", "momentum_buffer", "adam")


def check_options(
    prediction: str | None,
    learning_rates: str,
    direction: str,
    gamma: float | None,
    learning_rate_scale: str | float | None,
    error_sample: int,
) -> tuple[str, str | float]:
    """Check SpecTrain's options (see ``SpecTrainStrategy``).

    Returns:
        ``prediction`` (``None``, as config parsers read ``none``, becomes ``"none"``) and
        ``learning_rate_scale`` (``None`` and ``"none"`` become 1.0).

    Raises:
        ValueError: an option out of its range, naming it.
    """
    if prediction is None:  # "none" parsed as None by config parsers (the benchmark's)
        prediction = "none"
    if prediction != "auto" and prediction not in PREDICTION_MODES:
        raise ValueError(
            f"prediction must be 'auto' or one of {PREDICTION_MODES}, got {prediction!r}"
        )
    if learning_rates not in ("schedule", "constant"):
        raise ValueError(f"learning_rates must be 'schedule' or 'constant', got {learning_rates!r}")
    if direction not in DIRECTIONS:
        raise ValueError(
            "direction must be 'auto', 'smoothed_gradient', 'momentum_buffer' or 'adam', "
            f"got {direction!r}"
        )
    if gamma is not None and not 0.0 <= gamma < 1.0:
        raise ValueError(f"gamma must be in [0, 1), got {gamma}")
    if learning_rate_scale is None or learning_rate_scale == "none":
        learning_rate_scale = 1.0
    if learning_rate_scale != "staleness" and (
        isinstance(learning_rate_scale, str) or not 0.0 < float(learning_rate_scale) <= 1.0
    ):
        raise ValueError(
            "learning_rate_scale must be 'staleness', 'none' or a factor in (0, 1], got "
            f"{learning_rate_scale!r}"
        )
    if error_sample < 0:
        raise ValueError(f"error_sample must be >= 0 (0 turns it off), got {error_sample}")
    return prediction, learning_rate_scale


def stage_learning_rate_scale(scale: str | float, stage: int, stages: int) -> float | str:
    """The factor on stage ``stage``'s learning rate: ``"staleness"`` (the predictor derives it
    from the stage's delay, 1 on the last stage) or ``scale`` on every stale stage."""
    if scale == "staleness" or stage == stages - 1:
        return "staleness"  # 1 on the last stage
    return float(scale)
