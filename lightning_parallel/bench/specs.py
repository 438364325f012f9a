"""Turn a benchmark SPEC (``NAME`` or ``NAME:key=value,...``) into a Lightning strategy.

NAME is looked up, in order:

1. in the baseline registry (:func:`register_baseline`): peers that are not strategy names of
   this package, each built by its own factory; modules in ``lightning_parallel.bench.peers``
   register theirs when imported (every module there is imported before lookup);
2. in Lightning's ``StrategyRegistry``, which holds Lightning's names (``ddp``, ...) and every
   name this package registers (``ddp_fp16``, ``ddp_powersgd``, ...): the strategy class is
   built with the registered ``init_params`` updated by the SPEC's options.

Options the ``Trainer`` takes (:data:`TRAINER_OPTIONS`, e.g.
``parameter_server:accumulate_grad_batches=4``) go to the ``Trainer`` of that run, the others to
the strategy. Option values are parsed as int, float, bool (``true``/``false``), ``none``, or
kept as text: ``ddp_powersgd:rank=2,start_powerSGD_iter=4``; or the options are one JSON object,
for values of other types: ``NAME:{"sizes": [64, 32]}``.
"""

from __future__ import annotations

import importlib
import inspect
import json
import pkgutil
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from pytorch_lightning.strategies import Strategy, StrategyRegistry

__all__: list[str] = []

BaselineFactory = Callable[..., Strategy]

TRAINER_OPTIONS = ("accumulate_grad_batches",)
"""SPEC options given to the run's ``Trainer`` rather than to its strategy."""


@dataclass(frozen=True)
class Spec:
    """A parsed SPEC: the text as given, the strategy name and its options."""

    text: str
    name: str
    options: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class _Baseline:
    factory: BaselineFactory
    description: str


_BASELINES: dict[str, _Baseline] = {}
_PLUGINS_LOADED = False


def parse_value(text: str) -> Any:
    """``"2"`` -> 2, ``"0.5"`` -> 0.5, ``"true"`` -> True, ``"none"`` -> None, else the text."""
    lowered = text.strip().lower()
    if lowered in ("true", "yes", "on"):
        return True
    if lowered in ("false", "no", "off"):
        return False
    if lowered in ("none", "null"):
        return None
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            continue
    return text.strip()


def parse_spec(text: str) -> Spec:
    """Parse ``NAME``, ``NAME:key=value,key=value`` or ``NAME:{JSON object}``.

    A NAME is lowercased unless it is a class path (``package.module.ClassName``, as
    ``--model`` and ``--data`` take).

    Raises:
        ValueError: empty name, an option without ``=``, an option given twice, or options
            that start with ``{`` but are not a JSON object with identifier keys.
    """
    name, _, rest = text.strip().partition(":")
    name = name.strip()
    name = name if "." in name else name.lower()
    if not name:
        raise ValueError(f"spec {text!r} has no strategy name; write NAME or NAME:key=value,...")
    as_json = rest.strip().startswith("{")
    options = _json_options(rest, text) if as_json else {}
    for item in [] if as_json else filter(None, (part.strip() for part in rest.split(","))):
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep or not key.isidentifier():
            raise ValueError(
                f"option {item!r} of spec {text!r} is not key=value; e.g. 'ddp_powersgd:rank=2'"
            )
        if key in options:
            raise ValueError(f"option {key!r} is given twice in spec {text!r}")
        options[key] = parse_value(value)
    if "." not in name and isinstance(options.get("timeout"), (int, float)):
        # the strategies take a timedelta, as Lightning's do: converted here, at the edge (a
        # class path is a user's model or data, whose arguments are passed as given)
        options["timeout"] = timedelta(seconds=float(options["timeout"]))
    return Spec(text.strip(), name, options)


def _json_options(rest: str, text: str) -> dict[str, Any]:
    """The options of ``NAME:{...}``: one JSON object whose keys are argument names."""
    try:
        options = json.loads(rest)
    except json.JSONDecodeError as error:
        raise ValueError(
            f"the options of {text!r} start with '{{' but are not JSON ({error}); e.g. "
            f'\'NAME:{{"sizes": [64, 32], "lr": 0.1}}\''
        ) from error
    if not isinstance(options, dict) or not all(
        isinstance(key, str) and key.isidentifier() for key in options
    ):
        raise ValueError(f"the options of {text!r} must be one JSON object of named arguments")
    return options


def register_baseline(name: str, factory: BaselineFactory, description: str = "") -> None:
    """Make ``name`` usable as a SPEC: ``factory(**options)`` returns the strategy to train with.

    Call it at import time of a module in ``lightning_parallel.bench.peers`` (imported by the
    benchmark before it resolves names), or before calling the runner in-process.
    """
    if name != name.lower() or not name:
        raise ValueError(f"baseline name {name!r} must be non-empty and lowercase")
    _BASELINES[name] = _Baseline(factory, description)


def load_plugins() -> None:
    """Import the package's strategies and every peer module, so that all names are known."""
    global _PLUGINS_LOADED
    if _PLUGINS_LOADED:
        return
    importlib.import_module("lightning_parallel")
    importlib.import_module("lightning_parallel.strategies.ddp_hooks")
    peers = importlib.import_module("lightning_parallel.bench.peers")
    for module in pkgutil.iter_modules(peers.__path__, prefix=f"{peers.__name__}."):
        importlib.import_module(module.name)
    _PLUGINS_LOADED = True


def available() -> dict[str, str]:
    """Every name a SPEC may use, with its one-line description."""
    load_plugins()
    names = {name: StrategyRegistry[name]["description"] for name in StrategyRegistry}
    names.update({name: baseline.description for name, baseline in _BASELINES.items()})
    return dict(sorted(names.items()))


def expand_specs(specs: list[str]) -> list[str]:
    """``specs`` with ``all`` replaced by every name of this package's registry, Lightning's
    ``ddp`` and every baseline (the pipeline peers), in that order, each once."""
    if "all" not in specs:
        return list(specs)
    from lightning_parallel.compat.registration import registered_names

    load_plugins()
    every = ["ddp", *sorted(registered_names()), *sorted(_BASELINES)]
    expanded: list[str] = []
    for spec in specs:
        for name in every if spec == "all" else [spec]:
            if name not in expanded:
                expanded.append(name)
    return expanded


def resolve(spec: Spec | str) -> tuple[Callable[..., Strategy], dict[str, Any]]:
    """The constructor and keyword arguments that build ``spec``'s strategy.

    Raises:
        ValueError: unknown name (the message lists the known ones).
    """
    spec = parse_spec(spec) if isinstance(spec, str) else spec
    load_plugins()
    if spec.name in _BASELINES:
        return _BASELINES[spec.name].factory, dict(spec.options)
    if spec.name in StrategyRegistry:
        entry = StrategyRegistry[spec.name]
        return entry["strategy"], {**entry["init_params"], **spec.options}
    raise ValueError(
        f"unknown strategy {spec.name!r} in spec {spec.text!r}; "
        f"choose one of: {', '.join(available())}"
    )


def split_trainer_options(spec: Spec) -> tuple[Spec, dict[str, Any]]:
    """``spec`` without its :data:`TRAINER_OPTIONS`, and those options (for the ``Trainer``)."""
    trainer = {k: v for k, v in spec.options.items() if k in TRAINER_OPTIONS}
    rest = {k: v for k, v in spec.options.items() if k not in TRAINER_OPTIONS}
    return Spec(spec.text, spec.name, rest), trainer


def build_strategy(spec: Spec | str) -> Strategy:
    """Build the strategy ``spec`` names, with its options.

    Raises:
        ValueError: unknown name, or an option the strategy does not accept (the message lists
            the accepted ones).
    """
    spec = parse_spec(spec) if isinstance(spec, str) else spec
    constructor, kwargs = resolve(spec)
    accepted = _accepted_options(constructor)
    unknown = [key for key in spec.options if accepted is not None and key not in accepted]
    if unknown:
        raise ValueError(
            f"spec {spec.text!r}: {spec.name} has no option {', '.join(map(repr, unknown))}; "
            f"it accepts {', '.join(sorted(accepted or ()))}"
        )
    return constructor(**kwargs)


def _accepted_options(constructor: Callable[..., Any]) -> set[str] | None:
    """Keyword names ``constructor`` accepts, following ``**kwargs`` through DDP's chain.

    A DDP strategy passes unknown keywords up its base classes and finally to
    ``DistributedDataParallel``; ``None`` means "cannot tell" (another ``**kwargs``).
    """
    from pytorch_lightning.strategies import DDPStrategy
    from torch.nn.parallel import DistributedDataParallel

    from lightning_parallel.strategies.base import ParallelStrategyBase

    if isinstance(constructor, type) and issubclass(constructor, ParallelStrategyBase):
        return constructor.accepted_keywords()
    callables: list[Callable[..., Any]] = [constructor]
    if isinstance(constructor, type) and issubclass(constructor, DDPStrategy):
        callables = [
            klass.__init__  # type: ignore[misc]
            for klass in constructor.__mro__
            if issubclass(klass, DDPStrategy) and "__init__" in vars(klass)
        ] + [DistributedDataParallel.__init__]
    names: set[str] = set()
    open_ended = False
    for function in callables:
        for parameter in inspect.signature(function).parameters.values():
            if parameter.kind is inspect.Parameter.VAR_KEYWORD:
                open_ended = True
            elif parameter.kind is not inspect.Parameter.VAR_POSITIONAL:
                names.add(parameter.name)
    names -= {"self", "module"}
    if open_ended and not (isinstance(constructor, type) and issubclass(constructor, DDPStrategy)):
        return None
    return names
