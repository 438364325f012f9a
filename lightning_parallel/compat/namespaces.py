"""The two Lightning namespaces, which of them are installed, and which one the user's code uses.

Lightning ships the same trainer twice: ``pytorch_lightning`` (distribution
``pytorch-lightning``, with ``lightning_fabric``) and ``lightning.pytorch`` (distribution
``lightning``, with ``lightning.fabric``). They are two copies of the code, so their classes
are distinct: ``lightning.pytorch.Trainer`` refuses a strategy that subclasses
``pytorch_lightning``'s ``Strategy`` and the other way round. Since ``lightning`` depends on
``pytorch-lightning``, a user of ``import lightning as L`` has both installed.

This module only looks: it never imports a Lightning namespace that is not already imported,
so ``sys.modules`` keeps telling which one the user's code chose.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import os
import sys
from dataclasses import dataclass
from types import ModuleType

__all__: list[str] = []


@dataclass(frozen=True)
class Namespace:
    """One Lightning namespace and where this package's Lightning layer lives for it.

    Attributes:
        key: ``"lightning"`` or ``"pytorch_lightning"``.
        pytorch: the trainer package (``"lightning.pytorch"`` or ``"pytorch_lightning"``).
        fabric: its fabric package (``"lightning.fabric"`` or ``"lightning_fabric"``).
        distribution: the PyPI distribution that installs it.
        layer: the module prefix under which this package's strategies, callbacks and demo
            classes subclass this namespace's classes (see
            :mod:`lightning_parallel.compat.generate`).
    """

    key: str
    pytorch: str
    fabric: str
    distribution: str
    layer: str

    def is_installed(self) -> bool:
        """Whether the namespace can be imported (checked without importing it)."""
        top, _, sub = self.pytorch.partition(".")
        spec = (
            importlib.util.find_spec(top) if top not in sys.modules else sys.modules[top].__spec__
        )
        if spec is None:
            return False
        if not sub:
            return True
        locations = spec.submodule_search_locations or []
        return any(os.path.isdir(os.path.join(location, sub)) for location in locations)

    def is_imported(self) -> bool:
        """Whether some code of this process has imported the namespace's trainer package."""
        return self.pytorch in sys.modules

    def module(self) -> ModuleType:
        """The trainer package (``lightning.pytorch`` or ``pytorch_lightning``), imported."""
        return importlib.import_module(self.pytorch)

    def module_of(self, relative: str) -> str:
        """The full name of this build's layer module ``relative`` (``"strategies.gropipe"``)."""
        return f"{self.layer}.{relative}"

    def version(self) -> str:
        """The installed distribution's version, read from its metadata (no import)."""
        return importlib.metadata.version(self.distribution)


LIGHTNING = Namespace(
    key="lightning",
    pytorch="lightning.pytorch",
    fabric="lightning.fabric",
    distribution="lightning",
    layer="lightning_parallel.lightning",
)
PYTORCH_LIGHTNING = Namespace(
    key="pytorch_lightning",
    pytorch="pytorch_lightning",
    fabric="lightning_fabric",
    distribution="pytorch-lightning",
    layer="lightning_parallel",
)
# the order is the preference where nothing else decides: ``lightning.pytorch`` is the import
# that Lightning's own documentation uses
NAMESPACES: tuple[Namespace, ...] = (LIGHTNING, PYTORCH_LIGHTNING)


def by_key(key: str) -> Namespace:
    """The namespace named ``key`` (``"lightning"`` or ``"pytorch_lightning"``).

    Raises:
        ValueError: another key; the message lists the valid ones.
    """
    for namespace in NAMESPACES:
        if key in (namespace.key, namespace.pytorch):
            return namespace
    raise ValueError(
        f"unknown Lightning namespace {key!r}; use one of {[ns.key for ns in NAMESPACES]}"
    )


def installed() -> list[Namespace]:
    """The namespaces that can be imported here, in order of preference."""
    return [namespace for namespace in NAMESPACES if namespace.is_installed()]


NAMESPACE_VARIABLE = "LIGHTNING_PARALLEL_NAMESPACE"


def active() -> Namespace:
    """The namespace that the user's code works with, decided as late as possible.

    0. the environment variable ``LIGHTNING_PARALLEL_NAMESPACE`` (``lightning`` or
       ``pytorch_lightning``), when set, decides;
    1. exactly one namespace imported in this process: that one;
    2. both imported: ``lightning.pytorch`` (import the class from
       ``lightning_parallel.strategies`` to get the ``pytorch_lightning`` one explicitly);
    3. none imported yet: the first installed, ``lightning.pytorch`` before ``pytorch_lightning``.

    Raises:
        ModuleNotFoundError: neither is installed (names the distributions to install).
    """
    forced = os.environ.get(NAMESPACE_VARIABLE)
    if forced:
        return by_key(forced)
    imported = [namespace for namespace in NAMESPACES if namespace.is_imported()]
    if imported:
        return imported[0]
    available = installed()
    if not available:
        raise ModuleNotFoundError(
            "lightning_parallel needs Lightning: pip install lightning (or pytorch-lightning)"
        )
    return available[0]


def of_class(cls: type) -> Namespace | None:
    """The namespace whose classes ``cls`` derives from, or ``None`` for a Lightning-free class."""
    for klass in cls.__mro__:
        module = klass.__module__ or ""
        for namespace in NAMESPACES:
            if module == namespace.pytorch or module.startswith(namespace.pytorch + "."):
                return namespace
            if module == namespace.fabric or module.startswith(namespace.fabric + "."):
                return namespace
    return None


def of_object(obj: object) -> Namespace | None:
    """The namespace of ``obj``'s class (a class itself counts as its own)."""
    return of_class(obj if isinstance(obj, type) else type(obj))
