"""One-shot averaging: train the replicas independently and average them once, at the end."""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

from torch import Tensor

from lightning_parallel.averaging.averager import Averager

__all__: list[str] = []


class OneShotAverager(Averager):
    """Never average during training; the final model is the mean of the replicas.

    Algorithm (``M`` workers):

    1. every worker trains its own replica on its own data, with no communication;
    2. at the end of training the replicas are averaged once: ``x = (1/M)·Σ_i x_i``.

    It communicates the least (one model per run) and works when the replicas stay in one
    basin (same start, convex or near-convex loss). Zinkevich, Weimer, Smola, Li,
    "Parallelized Stochastic Gradient Descent", NeurIPS 2010.
    """

    averages_during_training: ClassVar[bool] = False

    def update(self, local: Sequence[Tensor], mean: Sequence[Tensor]) -> list[Tensor]:
        return list(mean)
