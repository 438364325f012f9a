"""The averaging algorithms by name: the strategy's ``algorithm`` and its hyperparameters.

``ModelAveragingStrategy(algorithm=..., block_momentum=..., outer_lr=..., ...)`` hands the
name and the hyperparameters here as it received them; what comes back is the canonical name and
a function building a fresh :class:`~lightning_parallel.averaging.Averager` (one per fit, so a
trainer reused for a second fit starts the algorithm again). A hyperparameter that belongs to
another algorithm, or an outer optimizer torch does not have, is refused naming the fix.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
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
)
from lightning_parallel.averaging.outer_optimizer import (
    DILOCO_OUTER_LR,
    DILOCO_OUTER_MOMENTUM,
    OUTER_STEP_CAP,
    OuterOptimizerFactory,
)
from lightning_parallel.strategies.arguments import optional_bool, optional_float

__all__: list[str] = []

ALGORITHMS: tuple[str, ...] = ("periodic", "one_shot", "bmuf", "easgd", "outer_optimizer")
_ALIASES = {"local_sgd": "periodic", "model_averaging": "periodic", "diloco": "outer_optimizer"}
_HYPERPARAMETERS = {
    "bmuf": ("block_momentum", "block_learning_rate", "nesterov"),
    "easgd": ("alpha", "beta", "center_first"),
    "outer_optimizer": (
        "outer_optimizer",
        "outer_lr",
        "outer_momentum",
        "outer_nesterov",
        "outer_step_cap",
    ),
}
_OWNERS = {key: owner for owner, keys in _HYPERPARAMETERS.items() for key in keys}
_FLAGS = frozenset({"nesterov", "center_first", "outer_nesterov"})


def averager_factory(
    algorithm: str | Averager, **hyperparameters: Any
) -> tuple[str, Callable[[], Averager]]:
    """The canonical algorithm name and a function building a fresh averager for it (picklable,
    as the ``spawn`` launcher pickles the strategy, when the algorithm's arguments are).

    ``hyperparameters`` are the strategy's keywords from ``block_momentum`` to
    ``outer_step_cap`` as it received them (``None``: unset, the algorithm's default); a
    function building one with a wrong value is refused here, before any process starts.
    """
    given = {
        name: _typed(name, value) for name, value in hyperparameters.items() if value is not None
    }
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
        detail = ", ".join(f"{key} (for {_OWNERS[key]})" for key in stray)
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
    step_cap = given.get("outer_step_cap", OUTER_STEP_CAP)
    return name, functools.partial(OuterOptimizerAverager, factory, step_cap=step_cap)


def _given(averager: Averager) -> Averager:
    return averager


def _typed(name: str, value: object) -> Any:
    """A hyperparameter checked for its kind: a flag, a number, or the outer optimizer."""
    if name in _FLAGS:
        return optional_bool(name, value)
    if name == "outer_optimizer":
        return value
    if name not in _OWNERS:
        raise TypeError(f"unknown averaging hyperparameter {name!r}")
    return optional_float(name, value)


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
