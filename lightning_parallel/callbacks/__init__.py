"""Lightning callbacks: communication telemetry and technique callbacks."""

from lightning_parallel.callbacks.comm_stats import CommStats, CommTotals
from lightning_parallel.callbacks.hylo import HyloCompression
from lightning_parallel.callbacks.straggler import Straggler

__all__ = ["CommStats", "CommTotals", "HyloCompression", "Straggler"]
