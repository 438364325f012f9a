"""Periodic averaging (local SGD): every round, each replica is replaced by the mean."""

from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor

from lightning_parallel.averaging.averager import Averager

__all__: list[str] = []


class PeriodicAverager(Averager):
    """Restart every worker from the mean of the replicas (local SGD, post-local SGD).

    Algorithm (``M`` workers, ``H`` local steps per round):

    1. each worker ``i`` takes ``H`` optimizer steps on its own data: ``x_i ← x_i − η·g_i``;
    2. the replicas are averaged: ``x̄ = (1/M)·Σ_i x_i``;
    3. every worker restarts from ``x_i ← x̄``.

    With ``H = 1`` and plain SGD this is exactly synchronous data parallelism (the mean of the
    updated replicas is the update with the mean gradient). Post-local SGD (Lin, Stich, Patel,
    Jaggi, "Don't Use Large Mini-Batches, Use Local SGD", ICLR 2020) runs synchronous data
    parallelism for the first ``W`` steps and this algorithm afterwards; the warm-up is the
    schedule's business (:class:`~lightning_parallel.averaging.AveragingSchedule`).
    Stich, "Local SGD Converges Fast and Communicates Little", ICLR 2019.
    """

    def update(self, local: Sequence[Tensor], mean: Sequence[Tensor]) -> list[Tensor]:
        return list(mean)
