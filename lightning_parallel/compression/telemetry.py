"""The Hylo hook's per-layer gauges: bytes, compression, codec time, residual, route.

:func:`exchange_gauges` turns the last exchange's :class:`~.exchange_step.LayerReport` of every
layer into ledger gauges (``CommStats`` logs them): per layer ``hylo/<name>/...`` and in total
``compression_ratio``, ``hylo/bytes``, ``hylo/encode_ms``, ``hylo/decode_ms`` and
``hylo/residual_norm`` (the norm over layers of both error-feedback residuals).
"""

from __future__ import annotations

import math

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
