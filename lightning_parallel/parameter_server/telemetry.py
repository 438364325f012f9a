"""What a server shard measured: staleness histogram, applied and dropped gradients, waits.

Gauges (:meth:`ServerStatistics.gauges`) go into the process's
:class:`~lightning_parallel.comm.ledger.CommLedger` and are logged as ``comm/<name>`` by the
``CommStats`` callback.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

__all__: list[str] = []

#: Histogram bins logged as gauges: staleness 0 .. HISTOGRAM_BINS-1, the last bin holds the rest.
HISTOGRAM_BINS = 16


@dataclass
class ServerStatistics:
    """Counters of one shard since the start of training (they go into checkpoints).

    Attributes:
        histogram: staleness → number of gradients that arrived with it (applied or dropped).
        applied: gradients applied.
        dropped: gradients dropped as too stale.
        updates: optimizer steps taken (one per group of gradients).
        group_sizes: gradients per update → number of updates of that size.
        held_seconds: worker → seconds its gradients waited at the server for a group (SSP,
            softsync, epoch drain) before the worker got its reply.
        trace: (worker, staleness) of every gradient, in order, while ``keep_trace`` is on.
        groups: gradients per update, in order, while ``keep_trace`` is on.
    """

    histogram: Counter[int] = field(default_factory=Counter)
    applied: int = 0
    dropped: int = 0
    updates: int = 0
    group_sizes: Counter[int] = field(default_factory=Counter)
    held_seconds: dict[int, float] = field(default_factory=dict)
    keep_trace: bool = False
    trace: list[tuple[int, int]] = field(default_factory=list)
    groups: list[int] = field(default_factory=list)

    def record(self, worker: int, staleness: int) -> None:
        """One gradient of ``staleness`` from ``worker`` reached an update."""
        self.histogram[staleness] += 1
        if self.keep_trace:
            self.trace.append((worker, staleness))

    def record_group(self, size: int) -> None:
        """One update combined ``size`` gradients (applied or dropped)."""
        self.group_sizes[size] += 1
        if self.keep_trace:
            self.groups.append(size)

    @property
    def staleness_mean(self) -> float:
        count = sum(self.histogram.values())
        return sum(s * n for s, n in self.histogram.items()) / count if count else 0.0

    @property
    def staleness_max(self) -> int:
        return max(self.histogram, default=0)

    def gauges(self, prefix: str = "") -> dict[str, float]:
        """Flat name → value figures for the ledger (histogram bins included)."""
        figures = {
            f"{prefix}staleness_mean": self.staleness_mean,
            f"{prefix}staleness_max": float(self.staleness_max),
            f"{prefix}ps_applied": float(self.applied),
            f"{prefix}ps_dropped": float(self.dropped),
            f"{prefix}ps_updates": float(self.updates),
        }
        last = HISTOGRAM_BINS - 1
        bins = [0] * HISTOGRAM_BINS
        for staleness, count in self.histogram.items():
            bins[min(staleness, last)] += count
        for index, count in enumerate(bins):
            if count:
                label = f"{index}" if index < last else f"{last}plus"
                figures[f"{prefix}staleness_hist_{label}"] = float(count)
        for worker, seconds in sorted(self.held_seconds.items()):
            figures[f"{prefix}ps_held_s_rank{worker}"] = seconds
        return figures

    def to_tensor(self) -> Tensor:
        """Counters as one int64 tensor (for checkpoints and gathering without pickling)."""
        top = max(self.histogram, default=-1) + 1
        values = [self.applied, self.dropped, self.updates, top]
        values += [self.histogram.get(s, 0) for s in range(top)]
        return torch.tensor(values, dtype=torch.int64)

    def load_tensor(self, values: Tensor) -> None:
        """Inverse of :meth:`to_tensor` (held seconds and group sizes are not restored)."""
        numbers = values.tolist()
        self.applied, self.dropped, self.updates, top = numbers[:4]
        self.histogram = Counter(
            {s: count for s, count in enumerate(numbers[4 : 4 + top]) if count}
        )

    def state_dict(self) -> dict[str, Any]:
        return {
            "histogram": dict(self.histogram),
            "applied": self.applied,
            "dropped": self.dropped,
            "updates": self.updates,
            "group_sizes": dict(self.group_sizes),
            "held_seconds": dict(self.held_seconds),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.histogram = Counter({int(k): int(v) for k, v in state["histogram"].items()})
        self.applied = int(state["applied"])
        self.dropped = int(state["dropped"])
        self.updates = int(state["updates"])
        self.group_sizes = Counter({int(k): int(v) for k, v in state["group_sizes"].items()})
        self.held_seconds = {int(k): float(v) for k, v in state["held_seconds"].items()}
