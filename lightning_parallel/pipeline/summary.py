"""The end-of-step exchange of a pipeline: loss, logged values and timings, one allreduce.

Only the last stage computes the loss and whatever the user logs next to it, but a training
framework wants both on every rank (every rank returns a loss; checkpoint and early-stopping
callbacks look the monitored value up on every rank). Stage timings and gradient-allreduce
timings are per rank, but the bubble and the hidden share of communication are properties of
the whole pipeline. One float64 ``all_reduce(SUM)`` over the pipeline's bookkeeping group (a
gloo group over the pipeline's ranks: these are host values, see
:mod:`lightning_parallel.comm.devices`) carries it all::

    [loss, schema fingerprint, value count,
     busy_0..busy_{p-1}, step_0..step_{p-1}, sync_0..sync_{p-1}, exposed_0..exposed_{p-1},
     value_0 .. value_{K-1}]

Each rank writes its own slots and zeros elsewhere, so the sum is a gather. The names and
options of the logged values (the *schema*) change rarely: the last stage sends the
fingerprint (CRC-32) of its schema, and only when it differs from the one every rank holds is
the schema broadcast as an object. Because the reduction needs every stage to arrive, it also
marks the moment the group's pipeline has drained: a gradient allreduce that finishes before it
was hidden behind backward work.

:class:`LogRecorder` collects the values a loss function logs per micro-batch and combines them
into one value per name: a weighted mean (weights ``n_j/N``, or the ``batch_size`` given) for
``reduce_fx="mean"``, else the sum, max or min. Metric objects stay on the last stage;
:func:`point_metrics_at` makes them sync over the stage's data-parallel replicas.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lightning_parallel.comm.devices import to_group

__all__: list[str] = []

_SIMPLE = (bool, int, float, str, type(None))
_REDUCTIONS = {"mean": "mean", "avg": "mean", "sum": "sum", "max": "max", "min": "min"}


def _reduction_name(reduce_fx: Any) -> str:
    if isinstance(reduce_fx, str):
        return _REDUCTIONS.get(reduce_fx.lower(), "mean")
    name = getattr(reduce_fx, "__name__", "mean")
    return _REDUCTIONS.get(str(name).lower(), "mean")


def is_stateful_metric(value: Any) -> bool:
    """A torchmetrics-like object (accumulates state, computes on demand)."""
    return (
        hasattr(value, "update")
        and hasattr(value, "compute")
        and not isinstance(value, torch.Tensor)
    )


def metric_step_value(metric: Any) -> float:
    """The value a stateful metric reported for the last batch it saw (0.0 if none)."""
    cache = getattr(metric, "_forward_cache", None)
    if isinstance(cache, torch.Tensor) and cache.numel() == 1:
        return float(cache)
    return 0.0


def point_metrics_at(module: nn.Module, group: dist.ProcessGroup | None) -> None:
    """Make every torchmetrics-like metric of ``module`` without a process group sync over
    ``group``: a stage's data-parallel replicas, not the world (only the last stages update
    them: a world-wide sync would wait for the others forever)."""
    for child in module.modules():
        if (
            hasattr(child, "process_group")
            and hasattr(child, "compute")
            and child.process_group is None
        ):
            child.process_group = group


@dataclass
class LoggedValue:
    """One combined logged value: name, float value, picklable options, and (last stage only)
    the stateful metric object it came from."""

    name: str
    value: float
    options: dict[str, Any]
    metric: Any = None

    @property
    def schema(self) -> tuple[str, bool, tuple[tuple[str, Any], ...]]:
        return (self.name, self.metric is not None, tuple(sorted(self.options.items())))


@dataclass
class _Entry:
    options: dict[str, Any]
    values: list[float] = field(default_factory=list)
    weights: list[float] = field(default_factory=list)
    metric: Any = None


class LogRecorder:
    """Collect ``log(name, value, **options)`` calls over the micro-batches of one step."""

    def __init__(self) -> None:
        self.entries: dict[str, _Entry] = {}
        self.weight = 1.0

    def start_micro_batch(self, weight: float) -> None:
        """Values logged from now on belong to a micro-batch of relative size ``weight``."""
        self.weight = weight

    def log(self, name: str, value: Any, **options: Any) -> None:
        """Record one call (the signature of ``LightningModule.log``)."""
        simple = {k: v for k, v in options.items() if isinstance(v, _SIMPLE)}
        if "reduce_fx" in options:
            simple["reduce_fx"] = _reduction_name(options["reduce_fx"])
        weight = float(options["batch_size"]) if options.get("batch_size") else self.weight
        entry = self.entries.setdefault(name, _Entry(simple))
        if is_stateful_metric(value):
            entry.metric = value
            entry.values.append(metric_step_value(value))
        elif isinstance(value, torch.Tensor):
            entry.values.append(float(value.detach().float().mean()) if value.numel() else 0.0)
        else:
            entry.values.append(float(value))
        entry.weights.append(weight)
        if "batch_size" in simple and simple["batch_size"] is not None:
            simple["batch_size"] = int(sum(entry.weights))
            entry.options["batch_size"] = simple["batch_size"]

    def combined(self) -> list[LoggedValue]:
        """One value per name, in first-logged order."""
        result = []
        for name, entry in self.entries.items():
            how = entry.options.get("reduce_fx", "mean")
            if entry.metric is not None or how == "mean":
                total = sum(entry.weights)
                value = (
                    sum(v * w for v, w in zip(entry.values, entry.weights)) / total
                    if total
                    else 0.0
                )
                if entry.metric is not None:
                    value = entry.values[-1]  # a stateful metric computes its own aggregate
            elif how == "sum":
                value = sum(entry.values)
            elif how == "max":
                value = max(entry.values)
            else:
                value = min(entry.values)
            result.append(LoggedValue(name, value, dict(entry.options), entry.metric))
        return result


_TIMINGS = 5  # busy, step, sync, exposed, wait: one slot per stage each
SUMMARY_CAPACITY = 32  # logged values the vector carries


def summary_width(stages: int, capacity: int = SUMMARY_CAPACITY) -> int:
    """Float64 slots of the step's vector: ``3 + 5p + capacity``."""
    return 3 + _TIMINGS * stages + capacity


@dataclass
class SummaryResult:
    """What every rank of the pipeline knows after :meth:`StepSummary.exchange`."""

    loss: float
    busy_seconds: list[float]
    step_seconds: list[float]
    sync_seconds: list[float]
    exposed_seconds: list[float]
    logged: list[LoggedValue]
    wait_seconds: list[float] = field(default_factory=list)

    @property
    def bubble_fraction(self) -> float:
        """``1 − Σ busy / (p · slowest step)``: idle share of the pipeline's stage-time."""
        step = max(self.step_seconds) if self.step_seconds else 0.0
        if step <= 0:
            return 0.0
        return max(0.0, 1.0 - sum(self.busy_seconds) / (len(self.busy_seconds) * step))

    @property
    def wait_fraction(self) -> float:
        """``Σ wait / (p · slowest step)``: share of stage-time spent blocked on a neighbour.

        The dependency part of the bubble; ``bubble_fraction − wait_fraction`` is the rest of
        the non-compute time (launching sends and receives, moving micro-batches, Python).
        """
        step = max(self.step_seconds) if self.step_seconds else 0.0
        if step <= 0 or not self.wait_seconds:
            return 0.0
        return min(1.0, sum(self.wait_seconds) / (len(self.wait_seconds) * step))


class StepSummary:
    """The end-of-step allreduce of one pipeline group (see the module docstring).

    Args:
        stages: ``p``.
        stage: this rank's stage.
        group: a group over the pipeline's ranks, gloo preferably (any group works: the vector
            goes to the group's device).
        capacity: logged values carried in the tensor; more travel with the schema object.
    """

    def __init__(
        self,
        stages: int,
        stage: int,
        group: dist.ProcessGroup | None,
        source_rank: int,
        capacity: int = SUMMARY_CAPACITY,
    ) -> None:
        self.stages, self.stage, self.group = stages, stage, group
        self.source_rank = source_rank
        self.capacity = capacity
        self._schema: list[tuple[str, bool, dict[str, Any]]] = []
        self._fingerprint = 0

    @property
    def is_last(self) -> bool:
        return self.stage == self.stages - 1

    def exchange(
        self,
        loss: float = 0.0,
        busy_seconds: float = 0.0,
        step_seconds: float = 0.0,
        sync_seconds: float = 0.0,
        exposed_seconds: float = 0.0,
        logged: Sequence[LoggedValue] = (),
        wait_seconds: float = 0.0,
    ) -> SummaryResult:
        """Combine this rank's figures with the group's (every rank of the group calls it)."""
        p, k = self.stages, self.stage
        width = summary_width(p, self.capacity)
        vector = torch.zeros(width, dtype=torch.float64)
        schema = [(v.name, v.metric is not None, v.options) for v in logged]
        overflow = len(logged) > self.capacity
        if self.is_last:
            fingerprint = zlib.crc32(repr((schema, overflow)).encode()) + 1
            vector[0], vector[1], vector[2] = loss, float(fingerprint), float(len(logged))
            if not overflow:
                for i, item in enumerate(logged):
                    vector[3 + _TIMINGS * p + i] = item.value
        timings = (busy_seconds, step_seconds, sync_seconds, exposed_seconds, wait_seconds)
        for offset, seconds in enumerate(timings):
            vector[3 + offset * p + k] = seconds
        if p > 1:
            placed = to_group(vector, self.group)
            dist.all_reduce(placed, group=self.group)
            vector = placed.cpu()
        summed = vector.tolist()
        fingerprint_seen = int(summed[1])
        count = int(summed[2])
        start = 3 + _TIMINGS * p
        values = summed[start : start + min(count, self.capacity)]
        if fingerprint_seen != self._fingerprint or count > self.capacity:
            payload: list[Any] = [(schema, [v.value for v in logged]) if self.is_last else None]
            if p > 1:
                dist.broadcast_object_list(payload, src=self.source_rank, group=self.group)
            self._schema, all_values = payload[0]
            self._fingerprint = fingerprint_seen
            if count > self.capacity:
                values = all_values
        metrics = [v.metric for v in logged] if self.is_last else [None] * count
        result_logged = [
            LoggedValue(name, value, dict(options), metric)
            for (name, _is_metric, options), value, metric in zip(self._schema, values, metrics)
        ]

        def slots(offset: int) -> list[float]:
            return summed[3 + offset * p : 3 + (offset + 1) * p]

        return SummaryResult(
            float(summed[0]), slots(0), slots(1), slots(2), slots(3), result_logged, slots(4)
        )
