"""What a no-flush stage does to its weights before each forward, timed for a plan.

A stage whose weights are stale predicts them before every forward
(:mod:`~lightning_parallel.pipeline.noflush.predictors`); that work is per tensor and on
fresh pages more than arithmetic, so a plan times it on each layer's parameters
(``LayerCost.pass_seconds`` of :func:`~lightning_parallel.pipeline.profile.profile_layers`
with ``weight_passes=True``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from lightning_parallel.pipeline.noflush.error import PredictionErrorMeter
from lightning_parallel.pipeline.profile import fastest_seconds

__all__: list[str] = []


def weight_pass_seconds(parameters: Sequence[torch.Tensor], repeats: int) -> float:
    """Fastest of ``repeats`` runs of what a no-flush stage does to its weights before each
    forward when they are stale: the predicted weights ``W − c·D``, one new tensor per
    parameter; the prediction-error meter's samples of them and of the live weights; the
    predicted weights loaded into the parameters and the live ones put back. Per tensor work
    and fresh pages, not arithmetic: on timm's ViT-Tiny the first half of the parameters
    (76 tensors, 11 MB) take 3.8 ms, where the whole model's SGD step takes 3.9 ms."""
    tensors = list(parameters)
    if not tensors:
        return 0.0
    meter = PredictionErrorMeter(tensors)

    def run() -> None:
        with torch.no_grad():
            predicted = [torch.add(t, t, alpha=-1e-3) for t in tensors]
        meter.record(0, predicted)
        live = [t.data for t in tensors]
        for tensor, weights in zip(tensors, predicted):
            tensor.data = weights
        for tensor, weights in zip(tensors, live):
            tensor.data = weights

    run()
    return fastest_seconds(run, repeats)
