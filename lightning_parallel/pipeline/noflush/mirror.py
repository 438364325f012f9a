"""What every rank of a no-flush pipeline learns of a step, without stopping the pipeline.

Only the last stage computes the loss and what the user logs beside it, and each stage measures
its own staleness, prediction error and bubble (:class:`~.runtime.StageTelemetry`); every rank
wants all of them (the progress bar, checkpoint monitors, the ledger's gauges). A blocking
exchange per step would make the stages wait for one another, which a pipeline that never
flushes exists to avoid, so :class:`AsyncMirror` starts an *asynchronous* allreduce in the
pipeline group at each step and completes it at the next one: a rank other than the last stage
sees the training values one step late. :func:`publish_telemetry` puts what arrived in the
ledger's gauges.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_parallel.comm.devices import to_group
from lightning_parallel.comm.ledger import process_ledger
from lightning_parallel.pipeline.noflush.runtime import StageTelemetry
from lightning_parallel.pipeline.summary import LoggedValue

__all__: list[str] = []

#: the figures each stage mirrors, in this order
TELEMETRY = ("staleness", "prediction_error", "stale_error", "bubble")
MIRROR_CAPACITY = 64  # logged values the vector carries


def mirror_width(stages: int, capacity: int = MIRROR_CAPACITY) -> int:
    """Float64 slots of the step's vector: ``3 + 4p + capacity``."""
    return 3 + len(TELEMETRY) * stages + capacity


@dataclass
class Mirrored:
    """What every rank of a pipeline learns from one step's exchange."""

    loss: float
    logged: list[LoggedValue]
    telemetry: list[list[float]]  # per stage, the values of TELEMETRY (nan: unknown)


def telemetry_figures(telemetry: StageTelemetry) -> list[float]:
    """A stage's values of :data:`TELEMETRY` (nan: not measured since the last step)."""
    return [
        math.nan if v is None else float(v)
        for v in (
            telemetry.staleness_mean,
            telemetry.prediction_error,
            telemetry.stale_error,
            telemetry.bubble_fraction,
        )
    ]


class AsyncMirror:
    """Carry the last stage's loss and logged values, and every stage's telemetry, to all
    ranks of a pipeline with an asynchronous allreduce completed one step later.

    Vector: ``[loss, schema fingerprint, value count, telemetry (4 per stage), values...]``;
    each rank writes its own slots (zeros elsewhere), so the sum is a gather. The names and
    options of the logged values travel once, by broadcast, when their fingerprint changes.
    These are host values: ``group`` is a gloo group (:mod:`lightning_parallel.comm.devices`).
    """

    def __init__(
        self, stages: int, stage: int, group: dist.ProcessGroup | None, source_rank: int
    ) -> None:
        self.stages, self.stage, self.group, self.source_rank = stages, stage, group, source_rank
        self.capacity = MIRROR_CAPACITY
        self._schema: list[tuple[str, dict[str, Any]]] = []
        self._fingerprint = 0
        self._pending: tuple[Any, Tensor, list[LoggedValue]] | None = None

    @property
    def last(self) -> bool:
        return self.stage == self.stages - 1

    def launch(
        self, loss: float, logged: Sequence[LoggedValue], telemetry: Sequence[float]
    ) -> None:
        """Start the exchange of this step (every rank of the pipeline, once per step)."""
        p = self.stages
        vector = torch.zeros(mirror_width(p, self.capacity), dtype=torch.float64)
        if self.last:
            schema = [(v.name, v.options) for v in logged]
            vector[0] = loss
            vector[1] = float(zlib.crc32(repr(schema).encode()) + 1)
            vector[2] = float(len(logged))
            for i, entry in enumerate(logged[: self.capacity]):
                vector[3 + len(TELEMETRY) * p + i] = entry.value
        for i, figure in enumerate(telemetry):
            vector[3 + i * p + self.stage] = figure
        placed = to_group(vector, self.group)
        work = dist.all_reduce(placed, group=self.group, async_op=True)
        self._pending = (work, placed, list(logged))

    def complete(self) -> Mirrored | None:
        """Finish the pending exchange (None if there is none)."""
        if self._pending is None:
            return None
        work, placed, logged = self._pending
        self._pending = None
        work.wait()
        vector = placed.tolist()
        p, count = self.stages, int(vector[2])
        values = vector[3 + len(TELEMETRY) * p : 3 + len(TELEMETRY) * p + count]
        fingerprint = int(vector[1])
        if fingerprint != self._fingerprint or count > self.capacity:
            payload: list[Any] = [
                ([(v.name, v.options) for v in logged], [v.value for v in logged])
                if self.last
                else None
            ]
            dist.broadcast_object_list(payload, src=self.source_rank, group=self.group)
            self._schema, all_values = payload[0]
            self._fingerprint = fingerprint
            if count > self.capacity:
                values = all_values
        metrics = [v.metric for v in logged] if self.last else [None] * count
        mirrored = [
            LoggedValue(name, value, dict(options), metric)
            for (name, options), value, metric in zip(self._schema, values, metrics)
        ]
        telemetry = [
            [float(vector[3 + i * p + k]) for i in range(len(TELEMETRY))] for k in range(p)
        ]
        return Mirrored(float(vector[0]), mirrored, telemetry)


def publish_telemetry(mirrored: Mirrored, stages: int) -> None:
    """Put each stage's staleness, prediction error, stale error and bubble in the ledger's
    gauges (``<name>_stage<k>``), and their means over the stages (the last stage's prediction
    error left out of its mean)."""
    ledger = process_ledger()
    means: dict[str, list[float]] = {name: [] for name in TELEMETRY}
    for stage, values in enumerate(mirrored.telemetry):
        for name, value in zip(TELEMETRY, values):
            if math.isfinite(value):
                ledger.set_gauge(f"{name}_stage{stage}", value)
                if name != "prediction_error" or stage < stages - 1:
                    means[name].append(value)
    for name, key in (
        ("staleness", "staleness_mean"),
        ("prediction_error", "prediction_error"),
        ("stale_error", "stale_error"),
        ("bubble", "bubble_fraction"),
    ):
        if means[name]:
            ledger.set_gauge(key, sum(means[name]) / len(means[name]))
