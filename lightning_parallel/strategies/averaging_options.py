"""The model-averaging strategy's arguments: text and names turned into averagers and checks.

The strategy's constructor hands its arguments here as they come (the bench's SPEC and the
command line pass text); what comes back is typed and checked, so that a wrong value fails in
``ModelAveragingStrategy(...)``, naming the fix, and not in the worker processes.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.optim import Optimizer

from lightning_parallel.averaging import (
    Averager,
    BlockMomentumAverager,
    ElasticAverager,
    OneShotAverager,
    OuterOptimizerAverager,
    PeriodicAverager,
    ReplicaAveraging,
)
from lightning_parallel.averaging.collapse import ReplicaCollapse
from lightning_parallel.averaging.outer_optimizer import (
    DILOCO_OUTER_LR,
    DILOCO_OUTER_MOMENTUM,
    OuterOptimizerFactory,
)
from lightning_parallel.averaging.plateau import LossSpike, PlateauExit
from lightning_parallel.averaging.policies import check_choice
from lightning_parallel.averaging.quantize import OUTER_DTYPES
from lightning_parallel.averaging.rounds import check_alpha, check_sync_delay
from lightning_parallel.strategies.arguments import optional_bool, optional_float, optional_int

__all__: list[str] = []

VALIDATION_POLICIES: tuple[str, ...] = ("round", "mean", "global")
ALGORITHMS: tuple[str, ...] = ("periodic", "one_shot", "bmuf", "easgd", "outer_optimizer")
_ALIASES = {"local_sgd": "periodic", "model_averaging": "periodic", "diloco": "outer_optimizer"}
_HYPERPARAMETERS = {
    "bmuf": ("block_momentum", "block_learning_rate", "nesterov"),
    "easgd": ("alpha", "beta", "center_first"),
    "outer_optimizer": ("outer_optimizer", "outer_lr", "outer_momentum", "outer_nesterov"),
}


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


def averager_factory(
    algorithm: str | Averager, hyperparameters: dict[str, Any]
) -> tuple[str, Callable[[], Averager]]:
    """The canonical algorithm name and a function building a fresh averager for it (picklable,
    as the ``spawn`` launcher pickles the strategy, when the algorithm's arguments are)."""
    given = {name: value for name, value in hyperparameters.items() if value is not None}
    if isinstance(algorithm, Averager):
        if given:
            raise ValueError(
                f"{', '.join(sorted(given))} configure a named algorithm; set them on the "
                f"{type(algorithm).__name__} you pass instead"
            )
        return type(algorithm).__name__, functools.partial(_given, algorithm)
    if not isinstance(algorithm, str):
        raise TypeError(f"algorithm must be a name or an Averager, got {type(algorithm).__name__}")
    name = _ALIASES.get(algorithm.lower(), algorithm.lower())
    if name not in ALGORITHMS:
        choices = ", ".join(repr(choice) for choice in (*ALGORITHMS, *_ALIASES))
        raise ValueError(f"algorithm must be one of {choices}; got {algorithm!r}")
    allowed = _HYPERPARAMETERS.get(name, ())
    stray = sorted(set(given) - set(allowed))
    if stray:
        owners = {key: owner for owner, keys in _HYPERPARAMETERS.items() for key in keys}
        detail = ", ".join(f"{key} (for {owners[key]})" for key in stray)
        raise ValueError(f"algorithm={name!r} does not use {detail}; remove them")
    if name == "periodic":
        return name, PeriodicAverager
    if name == "one_shot":
        return name, OneShotAverager
    options = {key: given[key] for key in allowed if key in given}  # unset: the class's default
    if name == "bmuf":
        return name, functools.partial(BlockMomentumAverager, **options)
    if name == "easgd":
        return name, functools.partial(ElasticAverager, **options)
    factory = _outer_optimizer_factory(
        given.get("outer_optimizer", "sgd"),
        given.get("outer_lr"),
        given.get("outer_momentum"),
        given.get("outer_nesterov"),
    )
    return name, functools.partial(OuterOptimizerAverager, factory)


def _given(averager: Averager) -> Averager:
    return averager


def _outer_optimizer_factory(
    optimizer: str | OuterOptimizerFactory,
    lr: float | None,
    momentum: float | None,
    nesterov: bool | None,
) -> OuterOptimizerFactory:
    """Build the outer optimizer from a ``torch.optim`` class name and hyperparameters."""
    if callable(optimizer) and not isinstance(optimizer, str):
        if lr is not None or momentum is not None or nesterov is not None:
            raise ValueError(
                "outer_lr, outer_momentum and outer_nesterov apply to a named outer_optimizer; "
                "set them inside the function you pass"
            )
        return optimizer
    if not isinstance(optimizer, str):
        raise TypeError(
            f"outer_optimizer must name a torch.optim class or be a function, got {optimizer!r}"
        )
    classes = {
        name.lower(): value
        for name, value in vars(torch.optim).items()
        if isinstance(value, type) and issubclass(value, Optimizer) and value is not Optimizer
    }
    optimizer_class = classes.get(optimizer.lower())
    if optimizer_class is None:
        raise ValueError(
            f"outer_optimizer {optimizer!r} is not a torch.optim class; use one of "
            f"{', '.join(sorted(classes))}"
        )
    accepted = inspect.signature(optimizer_class).parameters
    options: dict[str, Any] = {"lr": DILOCO_OUTER_LR if lr is None else lr}
    if optimizer_class is torch.optim.SGD:
        options["momentum"] = DILOCO_OUTER_MOMENTUM if momentum is None else momentum
        options["nesterov"] = True if nesterov is None else nesterov
        if options["nesterov"] and options["momentum"] == 0:
            options["nesterov"] = False  # torch rejects Nesterov without momentum
    else:
        for key, value in (("momentum", momentum), ("nesterov", nesterov)):
            if value is None:
                continue
            if key not in accepted:
                raise ValueError(
                    f"torch.optim.{optimizer_class.__name__} takes no {key}; remove outer_{key}"
                )
            options[key] = value
    optimizer_class(  # bad values (negative lr, ...) fail at construction
        [torch.zeros(1)], **options
    )
    return functools.partial(optimizer_class, **options)
