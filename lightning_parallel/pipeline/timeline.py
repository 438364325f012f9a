"""Measured pipeline events (forward, backward, waits, gradient allreduce) and their plot.

Every stage runtime records, per step, events ``(rank, stage, kind, micro_batch, start, end)``
with wall-clock times (``time.time()``; comparable across processes of one host, and across
hosts as far as their clocks agree). Kinds: ``"F"``, ``"B"`` (compute), ``"R"`` (recomputed
forward), ``"W"`` (deferred weight gradients), ``"wait"`` (blocked receiving from a neighbour),
``"allreduce"`` (a stage's gradient bucket in flight, from launch to completion).
:func:`plot_timeline` draws one row per rank: the drawing of
:mod:`~lightning_parallel.pipeline.schedule`, made from measured times. :func:`gather_timeline`
gathers every rank's events on rank 0, and :func:`save_timeline` writes the plot or the events
as JSON.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch.distributed as dist

__all__: list[str] = []

_COLORS = {
    "F": "#4c78a8",
    "B": "#f58518",
    "R": "#b279a2",
    "W": "#e45756",
    "wait": "#dddddd",
    "allreduce": "#54a24b",
}


@dataclass(frozen=True)
class TimelineEvent:
    """One interval of a stage's step."""

    rank: int
    stage: int
    kind: str
    micro_batch: int
    start: float
    end: float

    @property
    def seconds(self) -> float:
        return self.end - self.start


class Clock:
    """``time.perf_counter`` precision, anchored to ``time.time`` for cross-process plots."""

    def __init__(self) -> None:
        self.offset = time.time() - time.perf_counter()

    def wall(self, perf_counter: float) -> float:
        return perf_counter + self.offset


def plot_timeline(
    events: Sequence[TimelineEvent], path: str | Path, title: str = "pipeline timeline"
) -> Path:
    """Draw ``events`` (one row per rank, labelled with its stage) and save the figure.

    Returns:
        The path written. Needs matplotlib (``pip install matplotlib``).
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as error:  # pragma: no cover - matplotlib is a dev/bench dependency
        raise ModuleNotFoundError(
            "the pipeline timeline is drawn with matplotlib: "
            "pip install 'lightning-parallel[bench]'"
        ) from error
    if not events:
        raise ValueError("no timeline events to plot; run at least one pipelined step")
    origin = min(event.start for event in events)
    ranks = sorted({event.rank for event in events})
    stage_of = {event.rank: event.stage for event in events}
    figure, axes = plt.subplots(figsize=(10, 0.6 * len(ranks) + 1.2))
    for row, rank in enumerate(ranks):
        for event in (e for e in events if e.rank == rank):
            height, offset = (0.3, 0.35) if event.kind == "allreduce" else (0.6, 0.0)
            axes.barh(
                row - offset,
                (event.end - event.start) * 1e3,
                left=(event.start - origin) * 1e3,
                height=height,
                color=_COLORS.get(event.kind, "#999999"),
                edgecolor="black" if event.kind in ("F", "B", "R", "W") else "none",
                linewidth=0.4,
            )
            if event.kind in ("F", "B") and event.micro_batch >= 0:
                axes.text(
                    (event.start - origin + event.seconds / 2) * 1e3,
                    row,
                    f"{event.kind}{event.micro_batch}",
                    ha="center",
                    va="center",
                    fontsize=6,
                    color="white",
                )
    axes.set_yticks(range(len(ranks)))
    axes.set_yticklabels([f"rank {r} (stage {stage_of[r]})" for r in ranks])
    axes.invert_yaxis()
    axes.set_xlabel("milliseconds")
    axes.set_title(title)
    handles = [plt.Rectangle((0, 0), 1, 1, color=color) for color in _COLORS.values()]
    axes.legend(handles, list(_COLORS), loc="upper right", fontsize=7, ncol=4)
    figure.tight_layout()
    target = Path(path)
    figure.savefig(target, dpi=120)
    plt.close(figure)
    return target


def events_to_dicts(events: Sequence[TimelineEvent]) -> list[dict[str, Any]]:
    """Events as plain dicts (for JSON)."""
    return [event.__dict__.copy() for event in events]


def gather_timeline(
    events: list[TimelineEvent], rank: int, world_size: int
) -> list[TimelineEvent] | None:
    """Every rank's ``events`` on rank 0 (collective over the world); ``None`` elsewhere."""
    gathered: list[Any] = [events]
    if world_size > 1:
        gathered = [None] * world_size
        dist.all_gather_object(gathered, events)
    if rank != 0:
        return None
    return [event for rank_events in gathered for event in rank_events]


def save_timeline(events: Sequence[TimelineEvent], path: Path, title: str) -> None:
    """Write ``events`` to ``path``: a plot titled ``title`` for ``.png``, else JSON
    (:func:`events_to_dicts`)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix == ".png":
        plot_timeline(events, path, title=title)
    else:
        path.write_text(json.dumps(events_to_dicts(events)))
