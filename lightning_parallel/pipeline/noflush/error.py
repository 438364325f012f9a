"""The online prediction error: per micro-batch, how far the weights its forward used were from
the weights its gradient is applied to, next to the stale error no correction would have had."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from lightning_parallel.pipeline.noflush.weights import Weights

__all__: list[str] = []


class PredictionErrorMeter:
    """Measure, per micro-batch, how far the weights its forward used were from the weights
    its gradient is applied to.

    1. At the forward of micro-batch b record a fixed random sample of coordinates of the
       weights the forward used (``Ŵ``) and of the live weights then (``W_t``).
    2. When b's gradient is applied (live weights ``W``) add
       ``‖Ŵ-W‖/‖W‖`` (prediction error) and ``‖W_t-W‖/‖W‖`` (the stale error that no correction
       would have had) on the sample; exact when the stage has at most ``sample_size`` elements.

    Args:
        parameters: the stage's trainable parameters.
        sample_size: coordinates kept per record.
        seed: seed of the coordinate sample.
    """

    def __init__(
        self, parameters: Sequence[Tensor], sample_size: int = 4096, seed: int = 0
    ) -> None:
        self.parameters = list(parameters)
        total = sum(p.numel() for p in self.parameters)
        generator = torch.Generator().manual_seed(seed)
        self.indices: list[Tensor | None] = []
        for p in self.parameters:
            if total <= sample_size:
                self.indices.append(None)
            else:
                keep = max(1, math.ceil(p.numel() * sample_size / total))
                chosen = torch.randperm(p.numel(), generator=generator)[:keep]
                self.indices.append(chosen.sort().values.to(p.device))
        self._open: dict[int, tuple[Tensor, Tensor]] = {}
        self.prediction_error_sum = 0.0
        self.stale_error_sum = 0.0
        self.count = 0

    def sample(self, tensors: Sequence[Tensor] | None) -> Tensor:
        """Concatenated sampled coordinates of ``tensors`` (the live parameters when None)."""
        source = self.parameters if tensors is None else tensors
        parts = []
        for t, idx in zip(source, self.indices):
            flat = t.detach().reshape(-1)
            # index_select: several times faster than flat[idx] on CPU
            part = flat.clone() if idx is None else flat.index_select(0, idx)
            parts.append(part.to(torch.float32))
        return torch.cat(parts) if parts else torch.zeros(0)

    def record(self, micro_batch: int, used: Weights) -> None:
        """Remember the weights the forward of ``micro_batch`` used."""
        live = self.sample(None)
        self._open[micro_batch] = (live if used is None else self.sample(used), live)

    def resolve(self, micro_batch: int) -> None:
        """Compare the recorded weights with the live weights now (b's gradient is applied)."""
        used, at_forward = self._open.pop(micro_batch)
        live = self.sample(None)
        norm = float(live.norm()) or 1.0
        self.prediction_error_sum += float((used - live).norm()) / norm
        self.stale_error_sum += float((at_forward - live).norm()) / norm
        self.count += 1

    def pop_means(self) -> tuple[float, float] | None:
        """Mean (prediction error, stale error) since the last call; None if nothing resolved."""
        if self.count == 0:
            return None
        means = (self.prediction_error_sum / self.count, self.stale_error_sum / self.count)
        self.prediction_error_sum = self.stale_error_sum = 0.0
        self.count = 0
        return means
