"""Strategy names in every Lightning registry, registered when that Lightning is imported.

``Trainer(strategy="gropipe")`` looks the name up in the ``StrategyRegistry`` of the trainer's
own namespace, so each installed namespace needs the names, bound to its build of our classes.
Registering means importing that build, which imports the namespace: done eagerly for a
namespace that is already imported, and for the others by a finder that waits until the user's
code imports them. Nothing here imports a Lightning the user did not (see
:func:`.namespaces.active`).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import logging
import sys
from collections.abc import Sequence
from types import ModuleType
from typing import Any

from lightning_parallel.compat.namespaces import Namespace, installed, of_class

__all__: list[str] = []

log = logging.getLogger(__name__)

# The layer modules whose import registers names and whose classes are public.
_REGISTERING = ("strategies", "callbacks")

_NAMES: dict[str, str] = {}
_LOADED: set[str] = set()
_FAILED: dict[str, BaseException] = {}


def register_strategy(name: str, strategy_cls: type, description: str, **init_params: Any) -> None:
    """Register ``strategy_cls`` under ``name`` in the registry of its Lightning namespace.

    Args:
        name: lowercase name accepted by ``Trainer(strategy=...)``.
        strategy_cls: a Lightning ``Strategy`` subclass (of either namespace).
        description: one line shown by ``lightning-parallel strategies``.
        init_params: keyword arguments passed to ``strategy_cls`` when built from the name.

    Raises:
        ValueError: ``name`` is not lowercase, or ``strategy_cls`` is no Lightning class.
    """
    if name != name.lower():
        raise ValueError(f"strategy name {name!r} must be lowercase; use {name.lower()!r}")
    namespace = of_class(strategy_cls)
    if namespace is None:
        raise ValueError(f"{strategy_cls!r} is not a Lightning Strategy subclass")
    registry = importlib.import_module(f"{namespace.pytorch}.strategies").StrategyRegistry
    registry.register(name, strategy_cls, description=description, override=True, **init_params)
    _NAMES[name] = description


def registered_names() -> dict[str, str]:
    """Names this package registers, mapped to their one-line description."""
    if not _NAMES:
        from lightning_parallel.compat.namespaces import active

        load(active())
    return dict(_NAMES)


def load(namespace: Namespace) -> None:
    """Import ``namespace``'s build of the layer, which registers its strategy names (once).

    Raises:
        Exception: whatever the import raised (an incompatible Lightning, say), also on a
            later call.
    """
    if namespace.key in _FAILED:
        raise _FAILED[namespace.key]
    if namespace.key in _LOADED:
        return
    _LOADED.add(namespace.key)
    try:
        for relative in _REGISTERING:
            importlib.import_module(namespace.module_of(relative))
    except BaseException as error:
        _FAILED[namespace.key] = error
        raise


def _load_quietly(namespace: Namespace) -> None:
    # runs inside the user's `import lightning`: a failure must not break that import; it is
    # raised again when one of our classes or names is used
    try:
        load(namespace)
    except Exception as error:
        log.warning(
            "lightning_parallel could not register its strategies with %s: %s",
            namespace.pytorch,
            error,
        )


class _AfterImport(importlib.abc.Loader):
    """Runs the real loader, then registers our names in the namespace it just imported."""

    def __init__(self, loader: importlib.abc.Loader, namespace: Namespace) -> None:
        self.loader = loader
        self.namespace = namespace

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self.loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self.loader.exec_module(module)
        _load_quietly(self.namespace)


class RegistrationFinder(importlib.abc.MetaPathFinder):
    """Watches for the first import of a Lightning trainer package not yet imported."""

    def __init__(self, namespaces: Sequence[Namespace]) -> None:
        self.waiting = {namespace.pytorch: namespace for namespace in namespaces}

    def find_spec(
        self,
        fullname: str,
        path: Sequence[str] | None = None,
        target: ModuleType | None = None,
    ) -> importlib.machinery.ModuleSpec | None:
        namespace = self.waiting.pop(fullname, None)
        if namespace is None:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return spec
        spec.loader = _AfterImport(spec.loader, namespace)
        return spec


def install() -> None:
    """Register in every imported namespace now, and in the others when they are imported."""
    waiting = []
    for namespace in installed():
        if namespace.is_imported():
            _load_quietly(namespace)
        else:
            waiting.append(namespace)
    if waiting and not any(isinstance(finder, RegistrationFinder) for finder in sys.meta_path):
        sys.meta_path.insert(0, RegistrationFinder(waiting))
