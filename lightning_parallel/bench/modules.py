"""The model and data a benchmark trains: a bundled one by name, or any Lightning class by path.

``--model`` and ``--data`` take the same form as a SPEC, ``NAME`` or ``NAME:OPTIONS``:

- ``NAME`` is a bundled name (``vgg_mini``, ``digits``, ... see :mod:`lightning_parallel.demo`)
  or a class path, ``package.module.ClassName``: a ``pytorch_lightning.LightningModule`` for
  ``--model``, a ``pytorch_lightning.LightningDataModule`` for ``--data``, importable by every
  process of the run (from ``PYTHONPATH``, an installed package, or the directory the bench is
  started in);
- ``OPTIONS`` are the class's init arguments, ``key=value,...`` (values read as int, float,
  ``true``/``false``, ``none`` or text, as a SPEC's), or one JSON object for other types
  (``my.Net:{"sizes": [64, 32]}``).

Every process builds its own copy with :func:`build`. Where a class path is given,
:func:`check` builds the pair once in the bench's own process before any cluster is started, so
that a class that cannot be imported, is not a Lightning class, or whose ``__init__`` rejects
the arguments is an error at once, naming the fix. ``--batch-size`` and ``--seed`` go to a data
class's ``batch_size`` and ``seed`` arguments where its ``__init__`` has them (an option wins);
a bundled model trained on a data class takes its ``input_shape`` and ``num_classes`` from the
data's attributes of those names, or from its options.
"""

from __future__ import annotations

import importlib
import inspect
import os
import sys
from typing import Any

from lightning_parallel.bench.specs import Spec, parse_spec

__all__: list[str] = []

# what a bundled model reads from its data
_SIZED_BY_DATA = ("input_shape", "num_classes")


def is_class_path(name: str) -> bool:
    """Whether ``name`` (a ``--model``/``--data`` NAME) is a class path, not a bundled name."""
    return "." in name


def _kind(flag: str) -> str:
    return "LightningModule" if flag == "--model" else "LightningDataModule"


def load_class(path: str, flag: str) -> type:
    """Import the class ``path`` names for ``flag`` (``--model`` or ``--data``) and check it.

    Raises:
        ValueError: the module or the class is missing, or the class is not a
            ``pytorch_lightning`` ``LightningModule`` (``--model``) or ``LightningDataModule``
            (``--data``); the message names the fix.
    """
    import pytorch_lightning as pl

    from lightning_parallel.compat.namespaces import LIGHTNING, of_class

    module_name, _, class_name = path.rpartition(".")
    if not module_name or not class_name.isidentifier():
        raise ValueError(f"{flag} {path!r} is not a class path: write package.module.ClassName")
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        raise ValueError(
            f"{flag} {path}: cannot import module {module_name!r} ({error}); put its directory "
            f"on PYTHONPATH or install its package: every process of the bench imports it"
        ) from error
    cls = getattr(module, class_name, None)
    if cls is None:
        exported = getattr(module, "__all__", None)  # a module that re-exports says so
        found = sorted(
            name
            for name, value in vars(module).items()
            if isinstance(value, type)
            and not name.startswith("_")
            and (name in exported if exported else value.__module__ == module.__name__)
        )
        raise ValueError(
            f"{flag} {path}: module {module_name!r} has no {class_name!r}"
            + (f"; its classes: {', '.join(found)}" if found else "")
        )
    base = pl.LightningModule if flag == "--model" else pl.LightningDataModule
    if not (isinstance(cls, type) and issubclass(cls, base)):
        if isinstance(cls, type) and of_class(cls) == LIGHTNING:
            raise ValueError(
                f"{flag} {path} is a lightning.pytorch {_kind(flag)}; the bench trains with "
                f"pytorch_lightning's Trainer, which refuses it: derive it from "
                f"pytorch_lightning.{_kind(flag)} (import pytorch_lightning as pl)"
            )
        raise ValueError(
            f"{flag} {path} is not a {_kind(flag)}: name a subclass of "
            f"pytorch_lightning.{_kind(flag)}"
        )
    return cls


def _takes(cls: type, name: str) -> bool:
    """Whether ``cls.__init__`` has a parameter called ``name`` (not counting ``**kwargs``)."""
    parameter = inspect.signature(cls).parameters.get(name)
    return parameter is not None and parameter.kind not in (
        inspect.Parameter.VAR_POSITIONAL,
        inspect.Parameter.VAR_KEYWORD,
    )


def _instantiate(cls: type, spec: Spec, flag: str, arguments: dict[str, Any]) -> Any:
    """``cls(**arguments)``; an argument it does not take, or an error from its ``__init__``,
    becomes a ``ValueError`` naming the flag to fix."""
    try:
        inspect.signature(cls).bind(**arguments)
    except TypeError as error:
        accepted = [
            name
            for name, parameter in inspect.signature(cls).parameters.items()
            if parameter.kind
            not in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
        ]
        raise ValueError(
            f"{flag} {spec.text}: {spec.name} rejects its arguments ({error}); it takes "
            f"{', '.join(accepted) or 'no arguments'}: give them as {flag} "
            f"{spec.name}:key=value,..."
        ) from error
    try:
        return cls(**arguments)
    except Exception as error:
        raise ValueError(
            f"{flag} {spec.text}: {spec.name}({_call(arguments)}) failed: "
            f"{type(error).__name__}: {error}; fix the options after ':' in {flag}"
        ) from error


def _call(arguments: dict[str, Any]) -> str:
    return ", ".join(f"{key}={value!r}" for key, value in arguments.items())


def build_datamodule(text: str, batch_size: int, seed: int) -> Any:
    """The data module ``text`` names (``NAME[:OPTIONS]``), for this process."""
    from lightning_parallel.demo import build_datamodule as build_bundled

    spec = parse_spec(text)
    if not is_class_path(spec.name):
        return build_bundled(spec.name, **{"batch_size": batch_size, "seed": seed, **spec.options})
    cls = load_class(spec.name, "--data")
    given = {"batch_size": batch_size, "seed": seed}
    arguments = {key: value for key, value in given.items() if _takes(cls, key)}
    return _instantiate(cls, spec, "--data", {**arguments, **spec.options})


def build_model(text: str, datamodule: Any) -> Any:
    """The model ``text`` names (``NAME[:OPTIONS]``), for this process, sized by
    ``datamodule`` where it is a bundled model."""
    from lightning_parallel.demo import build_model as build_bundled

    spec = parse_spec(text)
    if is_class_path(spec.name):
        return _instantiate(load_class(spec.name, "--model"), spec, "--model", spec.options)
    if all(hasattr(datamodule, name) for name in _SIZED_BY_DATA):
        return build_bundled(spec.name, data=datamodule, **spec.options)
    # a bundled model on the user's data class
    missing = [name for name in _SIZED_BY_DATA if name not in spec.options]
    if missing:
        raise ValueError(
            f"--model {spec.text}: the bundled model takes {' and '.join(missing)} from its "
            f"data, and {type(datamodule).__name__} has no such attribute: give them as "
            f'options, e.g. --model \'{spec.name}:{{"input_shape": [3, 32, 32], '
            f'"num_classes": 10}}\''
        )
    try:
        return build_bundled(spec.name, **spec.options)
    except Exception as error:
        raise ValueError(
            f"--model {spec.text} failed: {type(error).__name__}: {error}; fix the options "
            f"after ':' in --model"
        ) from error


def build(model: str, data: str, batch_size: int, seed: int) -> tuple[Any, Any]:
    """The model and the data module of one bench process."""
    datamodule = build_datamodule(data, batch_size, seed)
    return build_model(model, datamodule), datamodule


def check(model: str, data: str, batch_size: int, seed: int) -> None:
    """Build the pair once here when either is a class path, before any process starts.

    Raises:
        ValueError: a class that cannot be imported, is not a Lightning class, or whose
            ``__init__`` rejects its arguments; the message names the fix.
    """
    if not any(is_class_path(parse_spec(text).name) for text in (model, data)):
        return  # bundled names are built in the processes, as they always were
    # the bench's processes run ``python -m``, which puts their working directory (this one)
    # first on their path: a module found there by them is found here too
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())
    for flag, text in (("--model", model), ("--data", data)):  # in the order they are read
        name = parse_spec(text).name
        if is_class_path(name):
            load_class(name, flag)
    build(model, data, batch_size, seed)
