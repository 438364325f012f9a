"""The model-averaging strategy's arguments, typed and checked: the schedule, the round
policies, streaming rounds, the loss rules, and what a checkpoint must match to resume.

The strategy's constructor hands its arguments here as it received them; what comes back is
typed and checked, so that a wrong value fails in ``ModelAveragingStrategy(...)``, naming the
fix, and not in the worker processes. The algorithm and its hyperparameters are
:mod:`~lightning_parallel.strategies.averaging_algorithms`'.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from lightning_parallel.averaging import AveragingSchedule, ReplicaAveraging
from lightning_parallel.averaging.collapse import ReplicaCollapse
from lightning_parallel.averaging.plateau import LossSpike, PlateauExit
from lightning_parallel.averaging.policies import (
    BUFFER_POLICIES,
    OPTIMIZER_STATE_POLICIES,
    check_choice,
)
from lightning_parallel.averaging.quantize import OUTER_DTYPES
from lightning_parallel.averaging.reduction import REDUCE_KINDS
from lightning_parallel.averaging.rounds import check_alpha, check_sync_delay
from lightning_parallel.strategies.arguments import optional_bool, optional_float, optional_int

__all__: list[str] = []

VALIDATION_POLICIES: tuple[str, ...] = ("round", "mean", "global")


def schedule_arguments(
    algorithm: str, period: object, warmup_steps: object
) -> tuple[int | None, int]:
    """The period (``None`` for ``one_shot``, which has no rounds) and the warm-up, checked."""
    rounds = None if algorithm == "one_shot" else optional_int("period", period)
    if rounds is None and algorithm != "one_shot":
        raise ValueError(
            "period must be a positive integer; use algorithm='one_shot' to average only "
            "at the end of training"
        )
    warmup = optional_int("warmup_steps", warmup_steps) or 0
    AveragingSchedule(rounds, warmup)  # validates both
    return rounds, warmup


@dataclass(frozen=True)
class RoundPolicies:
    """How a round treats what is not a parameter, and how it travels (see
    ``ModelAveragingStrategy``'s ``buffers`` to ``ranks_per_host``)."""

    buffers: str
    optimizer_state: str
    reduce: str
    overlap: bool
    before_validation: str
    ranks_per_host: int | None


def round_policies(
    buffers: str,
    optimizer_state: str,
    reduce: str,
    overlap: object,
    before_validation: str,
    ranks_per_host: object,
) -> RoundPolicies:
    """The round policies as the strategy's constructor received them, checked."""
    per_host = optional_int("ranks_per_host", ranks_per_host)
    if per_host is not None and per_host < 1:
        raise ValueError(f"ranks_per_host must be positive, got {per_host}")
    return RoundPolicies(
        buffers=check_choice("buffers", buffers, BUFFER_POLICIES),
        optimizer_state=check_choice("optimizer_state", optimizer_state, OPTIMIZER_STATE_POLICIES),
        reduce=check_choice("reduce", reduce, REDUCE_KINDS),
        overlap=bool(optional_bool("overlap", overlap)),
        before_validation=check_choice("before_validation", before_validation, VALIDATION_POLICIES),
        ranks_per_host=per_host,
    )


@dataclass(frozen=True)
class StreamingOptions:
    """Streaming rounds and low-precision deltas, checked (see ``ModelAveragingStrategy``)."""

    fragments: int
    sync_delay: int
    fragment_update_alpha: float | None
    outer_dtype: str
    outer_error_feedback: bool


def streaming_options(
    algorithm: str,
    period: int | None,
    overlap: bool,
    fragments: object,
    sync_delay: object,
    fragment_update_alpha: object,
    outer_dtype: str,
    outer_error_feedback: object,
) -> StreamingOptions:
    """The streaming arguments typed and checked against the algorithm and period."""
    count = optional_int("fragments", fragments) or 1
    if count < 1 or (period is not None and count > period):
        raise ValueError(f"fragments must be between 1 and period ({period}), got {count}")
    if count > 1 and period is None:
        raise ValueError("fragments > 1 needs rounds during training; one_shot has none")
    dtype = check_choice("outer_dtype", outer_dtype, OUTER_DTYPES)
    if dtype != "fp32" and algorithm == "one_shot":
        raise ValueError(
            "one_shot averages once, at the end, in full precision: outer_dtype applies to "
            "rounds during training; remove it or choose another algorithm"
        )
    feedback = bool(optional_bool("outer_error_feedback", outer_error_feedback))
    if feedback and dtype == "fp32":
        raise ValueError(
            "outer_error_feedback keeps what a low-precision outer_dtype drops; with "
            "outer_dtype='fp32' nothing is dropped: set outer_dtype or remove it"
        )
    return StreamingOptions(
        fragments=count,
        sync_delay=check_sync_delay(optional_int("sync_delay", sync_delay), overlap, period),
        fragment_update_alpha=check_alpha(
            optional_float("fragment_update_alpha", fragment_update_alpha)
        ),
        outer_dtype=dtype,
        outer_error_feedback=feedback,
    )


@dataclass(frozen=True)
class LossRules:
    """What the strategy does about the training loss, typed and checked (see
    :class:`~lightning_parallel.strategies.model_averaging.ModelAveragingStrategy`'s
    ``synchronous_window`` to ``replace_collapsed``)."""

    synchronous_window: int
    plateau_drop: float
    rollback_on_spike: bool
    spike_ratio: float
    spike_regression: float | None
    replace_collapsed: bool

    def engine_arguments(self) -> dict[str, Any]:
        """The rules as :class:`~lightning_parallel.averaging.ReplicaAveraging` takes them
        (fresh objects: each run watches its own loss)."""
        spike = LossSpike(self.spike_ratio, regression=self.spike_regression)
        return {
            "plateau": PlateauExit(self.plateau_drop) if self.synchronous_window else None,
            "window_steps": self.synchronous_window,
            "spike": spike if self.rollback_on_spike else None,
            "collapse": ReplicaCollapse() if self.replace_collapsed else None,
        }


def loss_rules(
    synchronous_window: object,
    plateau_drop: object,
    rollback_on_spike: object,
    spike_ratio: object,
    spike_regression: object,
    replace_collapsed: object,
) -> LossRules:
    """The loss rules' options as the strategy's constructor received them, checked."""
    window = optional_int("synchronous_window", synchronous_window)
    window = 0 if window is None else window
    if window < 0:
        raise ValueError(
            f"synchronous_window must be a non-negative number of optimizer steps (0: none), "
            f"got {window}"
        )
    drop = optional_float("plateau_drop", plateau_drop)
    if drop is None or not 0.0 < drop < 1.0:
        raise ValueError(
            f"plateau_drop must be in (0, 1) (the smoothed loss's relative fall that ends the "
            f"plateau), got {drop}"
        )
    ratio = optional_float("spike_ratio", spike_ratio)
    if ratio is None or not ratio > 1.0:
        raise ValueError(
            f"spike_ratio must be above 1 (times the smoothed loss that counts as a spike), "
            f"got {ratio}; rollback_on_spike=False turns the rule off"
        )
    regression = optional_float("spike_regression", spike_regression)
    if regression is not None and not 0.0 < regression <= 1.0:
        raise ValueError(
            f"spike_regression must be in (0, 1] (a share of the way back to the starting "
            f"loss), got {regression}; None watches spikes only"
        )
    return LossRules(
        synchronous_window=window,
        plateau_drop=drop,
        rollback_on_spike=bool(optional_bool("rollback_on_spike", rollback_on_spike)),
        spike_ratio=ratio,
        spike_regression=regression,
        replace_collapsed=bool(optional_bool("replace_collapsed", replace_collapsed)),
    )


def resume_mismatch(
    restored: dict[str, Any], averaging: ReplicaAveraging, algorithm: str
) -> str | None:
    """Why a checkpoint's averaging state cannot resume exactly in ``averaging`` (``None``: it
    can): another world size, algorithm or fragment count, or agreed points kept in one run
    and not in the other."""
    fragments = restored["shared"].get("fragments", 1)
    kept = bool(restored["shared"].get("agreements_kept", False))
    if (
        restored.get("world_size") != averaging.world_size
        or restored.get("algorithm") != algorithm
        or fragments != len(averaging.fragments)
    ):
        return (
            f"the checkpoint's model averaging ran {restored.get('algorithm')} on "
            f"{restored.get('world_size')} processes in {fragments} fragment(s), this run "
            f"{algorithm} on {averaging.world_size} in {len(averaging.fragments)}"
        )
    if kept != averaging.keeps_agreement:
        return (
            "the checkpoint's rounds "
            + ("kept" if kept else "did not keep")
            + " each fragment's agreed point and this run's "
            + ("do" if averaging.keeps_agreement else "do not")
            + " (outer_dtype or before_validation='global' changed)"
        )
    return None
