"""Lightning callbacks: communication telemetry and technique callbacks."""

from lightning_parallel.callbacks.comm_stats import CommStats, CommTotals

__all__ = ["CommStats", "CommTotals"]
