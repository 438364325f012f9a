"""A round of averaging in flight, what each fragment last agreed on, and how a late round lands."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from lightning_parallel.averaging.averager import move_all
from lightning_parallel.averaging.flat import FlatLayout
from lightning_parallel.averaging.reduction import ReductionWork, counted

__all__: list[str] = []


@dataclass
class Round:
    """A round whose reduction was started and whose result is not applied yet.

    ``snapshot`` holds the fragment's tensors when the round started: its parameters first
    (``num_parameters``), then its buffers (``num_buffers``), then averaged optimizer state.
    The parameters either travel with the rest as values (``sums``, reduced by the averaging's
    reduction) or, quantized, as one flat delta from the fragment's anchor (``delta``, summed
    by the quantized gather); ``parameter_means`` is set when a compressor averaged them.
    """

    fragment: int
    snapshot: list[Tensor]
    layout: FlatLayout  # of the tensors reduced as values
    sums: list[Tensor]  # flat buffers, summed in place over the ranks
    work: ReductionWork | None  # None once the sums are complete
    num_parameters: int
    num_buffers: int
    started_at: int  # optimizer steps counted when the round started
    apply_at: int  # the optimizer step count at which it is applied (``started_at + delay``)
    delta: Tensor | None = None  # flat sum of the parameters' deltas (quantized route)
    delta_work: ReductionWork | None = None
    blocked_seconds: float = 0.0  # time training waited for this round so far
    parameter_means: list[Tensor] | None = None  # set when ``parameter_mean`` averaged them
    ranks: int | None = None  # ranks the sums hold, where fewer than the world (a lost rank)
    delta_ranks: int | None = None  # the same for ``delta``

    def wait(self) -> None:
        """Complete the round's communication (its result is applied later, on schedule)."""
        if self.work is not None:
            self.ranks = counted(self.work, 0) or None
            self.work = None
        if self.delta_work is not None:
            self.delta_ranks = counted(self.delta_work, 0) or None
            self.delta_work = None

    def state_dict(self) -> dict[str, Any]:
        """The round, complete (call :meth:`wait` first), for a checkpoint."""
        return {
            "fragment": self.fragment,
            "snapshot": [tensor.clone() for tensor in self.snapshot],
            "sums": [tensor.clone() for tensor in self.sums],
            "delta": None if self.delta is None else self.delta.clone(),
            "num_parameters": self.num_parameters,
            "num_buffers": self.num_buffers,
            "started_at": self.started_at,
            "apply_at": self.apply_at,
        }

    @classmethod
    def from_state_dict(cls, state: dict[str, Any], device: torch.device) -> Round:
        """The round of :meth:`state_dict`, its tensors on ``device`` (the model's)."""
        snapshot = move_all(state["snapshot"], device)
        num_parameters = int(state["num_parameters"])
        delta = state.get("delta")
        reduced = snapshot[num_parameters:] if delta is not None else snapshot
        started_at = int(state["started_at"])
        return cls(
            fragment=int(state.get("fragment", 0)),
            snapshot=snapshot,
            layout=FlatLayout(reduced),
            sums=move_all(state["sums"], device),
            work=None,
            num_parameters=num_parameters,
            # a checkpoint from before fragments: buffers are whatever is not a parameter
            num_buffers=int(state.get("num_buffers", len(snapshot) - num_parameters)),
            started_at=started_at,
            apply_at=int(state.get("apply_at", started_at + 1)),
            delta=None if delta is None else delta.to(device),
        )


@dataclass
class Agreement:
    """What every rank agreed on at a fragment's last round (identical on every rank).

    ``anchor`` is the point the fragment's parameters restart from when the averager restarts
    every replica from one point (periodic: the mean; BMUF: its restart point; DiLoCo: the
    global model), else their mean (EASGD): quantized rounds send the replicas' delta from it,
    and ``before_validation="global"`` evaluates it. ``buffers`` are the round's mean buffers
    (``None`` until the fragment's first round: during a warm-up each replica's BatchNorm
    statistics are its own).
    """

    anchor: list[Tensor]
    buffers: list[Tensor] | None = None
    residual: Tensor | None = None  # error feedback of this rank's quantized delta (local)

    def state_dict(self) -> dict[str, Any]:
        """The shared part (the residual is this rank's own: see :meth:`local_state_dict`)."""
        return {
            "anchor": [tensor.clone() for tensor in self.anchor],
            "buffers": None if self.buffers is None else [b.clone() for b in self.buffers],
        }

    @classmethod
    def from_state_dict(cls, state: dict[str, Any], device: torch.device) -> Agreement:
        """The agreement of :meth:`state_dict` on ``device``."""
        buffers = state.get("buffers")
        return cls(
            anchor=move_all(state["anchor"], device),
            buffers=None if buffers is None else move_all(buffers, device),
        )


def land(
    live: Sequence[Tensor],
    snapshot: Sequence[Tensor],
    targets: Sequence[Tensor],
    moved: bool,
    alpha: float | None,
) -> None:
    """Write a round's ``targets`` into the ``live`` tensors (in place).

    If no optimizer step was taken since the round started, the live tensors become the
    targets. Otherwise the local steps taken meanwhile are merged:

    - ``alpha=None`` keeps them: ``x ← target + (x − x_snapshot)`` (what the replica did since
      the round started is added to where the round says to restart);
    - ``alpha=α`` mixes as Streaming DiLoCo does: ``x ← α·x + (1 − α)·target`` (``α = 0``
      drops the local steps taken during the round, ``α = 1`` ignores the round).
    """
    with torch.no_grad():
        for tensor, start, target in zip(live, snapshot, targets, strict=True):
            if not moved:
                tensor.copy_(target)
            elif alpha is None:
                tensor.copy_(target + (tensor - start))
            else:
                tensor.lerp_(target.to(tensor.dtype), 1.0 - alpha)


def check_sync_delay(sync_delay: int | None, overlap: bool, period: int | None) -> int:
    """``sync_delay`` validated (``None``: 1 with ``overlap``, else 0)."""
    if sync_delay is None:
        return 1 if overlap else 0
    if isinstance(sync_delay, bool) or int(sync_delay) != sync_delay or sync_delay < 0:
        raise ValueError(f"sync_delay must be a non-negative integer, got {sync_delay!r}")
    if overlap and sync_delay == 0:
        raise ValueError("overlap=True delays rounds by one step; drop it or set sync_delay >= 1")
    if period is not None and sync_delay > period:
        raise ValueError(
            f"sync_delay={sync_delay} must not exceed the period ({period}): a fragment's "
            "round must land before the same fragment's next round starts"
        )
    return int(sync_delay)


def check_alpha(alpha: float | None) -> float | None:
    """``fragment_update_alpha`` validated: ``None`` or a number in ``[0, 1]``."""
    if alpha is None:
        return None
    if isinstance(alpha, bool) or not 0.0 <= float(alpha) <= 1.0:
        raise ValueError(f"fragment_update_alpha must be in [0, 1] or None, got {alpha!r}")
    return float(alpha)


def add_mean_delta(anchor: Sequence[Tensor], delta_sum: Tensor, world_size: int) -> list[Tensor]:
    """``anchor + delta_sum / W``, shaped like ``anchor`` (new tensors)."""
    means, offset = [], 0
    for tensor in anchor:
        numel = tensor.numel()
        part = delta_sum[offset : offset + numel].view(tensor.shape) / world_size
        means.append((tensor.float() + part).to(tensor.dtype))
        offset += numel
    return means
