"""The Hylo hook's per-layer gauges: bytes, compression, codec time, residual, route.

:func:`exchange_gauges` turns the last exchange's :class:`~.exchange_step.LayerReport` of every
layer into ledger gauges (``CommStats`` logs them): per layer ``hylo/<name>/...`` and in total
``compression_ratio``, ``hylo/bytes``, ``hylo/encode_ms``, ``hylo/decode_ms`` and
``hylo/residual_norm`` (the norm over layers of both error-feedback residuals).

:class:`StepAverages` gives the means per step of what the background thread costs once the
calibration is over: ``hylo/thread_cpu_ms``, the thread's processor time (a host whose cores all
run the backward pass pays it on top of the backward pass, however well the exchange overlaps),
and ``hylo/tail_ms``, the time from DDP handing over a step's last bucket until it is
averaged (the exchange left exposed after the backward pass).
"""

from __future__ import annotations

import math

from lightning_parallel.compression.background import BackgroundThread
from lightning_parallel.compression.error_feedback import ErrorFeedback
from lightning_parallel.compression.exchange_residuals import server_residual_norm
from lightning_parallel.compression.exchange_step import LayerReport
from lightning_parallel.compression.policy import ROUTES, LayerPlan

__all__: list[str] = []


def exchange_gauges(
    reports: dict[str, LayerReport],
    plans: dict[str, LayerPlan],
    memory: ErrorFeedback,
    server_memory: ErrorFeedback,
    per_layer: bool = True,
) -> dict[str, float]:
    """Gauges of the layers' last exchange; a layer's ``route`` gauge is the index of its route
    in :data:`~lightning_parallel.compression.policy.ROUTES`."""
    gauges: dict[str, float] = {}
    total_sent = sum(report.bytes_sent for report in reports.values())
    total_dense = sum(report.dense_bytes for report in reports.values())
    residual_squares = 0.0
    for name, report in sorted(reports.items()):
        residual = math.hypot(memory.norm(name), server_residual_norm(server_memory, name))
        residual_squares += residual**2
        if per_layer:
            gauges[f"hylo/{name}/bytes"] = report.bytes_sent
            gauges[f"hylo/{name}/compression_ratio"] = report.compression_ratio
            gauges[f"hylo/{name}/encode_ms"] = report.encode_s * 1e3
            gauges[f"hylo/{name}/decode_ms"] = report.decode_s * 1e3
            gauges[f"hylo/{name}/residual_norm"] = residual
            gauges[f"hylo/{name}/route"] = float(ROUTES.index(plans[name].route))
    gauges["compression_ratio"] = total_dense / total_sent if total_sent > 0 else 1.0
    gauges["hylo/bytes"] = total_sent
    gauges["hylo/encode_ms"] = sum(r.encode_s for r in reports.values()) * 1e3
    gauges["hylo/decode_ms"] = sum(r.decode_s for r in reports.values()) * 1e3
    gauges["hylo/residual_norm"] = math.sqrt(residual_squares)
    return gauges


class StepAverages:
    """Means per step of the background thread's processor time and of the step's tail."""

    def __init__(self) -> None:
        self.thread: BackgroundThread | None = None
        self.cpu_start = 0.0  # the thread's processor time when counting began
        self.step_start = 0  # the step counting began at
        self.tail_total = 0.0
        self.tails = 0

    def step_begins(self, thread: BackgroundThread, step: int) -> None:
        """A counted step's first bucket goes to ``thread`` (counting starts at the first one,
        and again if the thread changed: a fork makes a new one)."""
        if self.thread is not thread:
            self.thread, self.cpu_start, self.step_start = thread, thread.cpu_seconds, step
            self.tail_total, self.tails = 0.0, 0

    def add_tail(self, seconds: float) -> None:
        """A step's last bucket was averaged ``seconds`` after it was handed over."""
        if self.thread is not None:
            self.tail_total += seconds
            self.tails += 1

    def gauges(self, step: int) -> dict[str, float]:
        """The means over the steps before ``step`` since counting began (none before one)."""
        if self.thread is None or step <= self.step_start or not self.tails:
            return {}
        return {
            "hylo/thread_cpu_ms": (self.thread.cpu_seconds - self.cpu_start)
            / (step - self.step_start)
            * 1e3,
            "hylo/tail_ms": self.tail_total / self.tails * 1e3,
        }
