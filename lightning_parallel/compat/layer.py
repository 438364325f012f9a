"""One source, two builds: this package's Lightning layer for each Lightning namespace.

The strategies, callbacks, demo models and the CLI subclass Lightning's classes, and a class
can subclass only one of the two namespaces' (see :mod:`.namespaces`). The source is written
once, against ``pytorch_lightning`` (this package's required dependency), and lives at its own
path (``lightning_parallel.strategies`` ...). For ``lightning.pytorch`` the same files are loaded
a second time under ``lightning_parallel.lightning`` (``lightning_parallel.lightning.strategies``
...), with the Lightning import paths mapped the way Lightning's own build maps them to produce
its two packages:

======================================  ==============================================
in the source                           in the ``lightning.pytorch`` build
======================================  ==============================================
``pytorch_lightning``                   ``lightning.pytorch``
``lightning_fabric``                    ``lightning.fabric``
``lightning_parallel.strategies`` ...   ``lightning_parallel.lightning.strategies`` ...
======================================  ==============================================

Only the layer's modules (:data:`LAYER_MODULES`) are built twice; the technique cores they
import (``averaging``, ``compression``, ``pipeline`` ...) are plain torch and shared. The
mapping keeps every line where it was, so tracebacks and ``inspect`` point at the real file.
Classes of the second build pickle by their module name and unpickle in a spawned process,
where ``import lightning_parallel`` installs the finder again.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import os
import re
import sys
from collections.abc import Sequence
from types import ModuleType

from lightning_parallel.compat.namespaces import LIGHTNING, PYTORCH_LIGHTNING, Namespace

__all__: list[str] = []

# The modules (and packages, with everything under them) that import Lightning.
LAYER_MODULES: tuple[str, ...] = ("strategies", "callbacks", "demo.models", "demo.data", "cli")
_PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_ROOT = "lightning_parallel"
_LAYER_PATTERN = "|".join(re.escape(name) for name in LAYER_MODULES)
_REWRITES: tuple[tuple[re.Pattern[str], str], ...] = (
    (re.compile(r"\bpytorch_lightning\b"), LIGHTNING.pytorch),
    (re.compile(r"\blightning_fabric\b"), LIGHTNING.fabric),
    (re.compile(rf"\blightning_parallel\.({_LAYER_PATTERN})\b"), rf"{LIGHTNING.layer}.\1"),
)


def rewrite(source: str) -> str:
    """``source`` with its Lightning import paths mapped to the ``lightning.pytorch`` build."""
    for pattern, replacement in _REWRITES:
        source = pattern.sub(replacement, source)
    return source


def _in_layer(relative: str) -> bool:
    return any(relative == name or relative.startswith(name + ".") for name in LAYER_MODULES)


def _parent_of_layer(relative: str) -> bool:
    return any(name.startswith(relative + ".") for name in LAYER_MODULES)


def _source_path(relative: str) -> tuple[str, bool] | None:
    """The file of ``lightning_parallel.<relative>`` and whether it is a package."""
    base = os.path.join(_PACKAGE_ROOT, *relative.split("."))
    if os.path.isfile(os.path.join(base, "__init__.py")):
        return os.path.join(base, "__init__.py"), True
    if os.path.isfile(base + ".py"):
        return base + ".py", False
    return None


class _MappedSourceLoader(importlib.abc.SourceLoader):
    """Loads a layer module's file with :func:`rewrite` applied, never from bytecode caches.

    It defines no ``path_stats``, so the real module's ``.pyc`` (compiled from the unmapped
    source) is never read for it, and nothing is written.
    """

    def __init__(self, fullname: str, path: str) -> None:
        self.name = fullname
        self.path = path

    def get_filename(self, fullname: str) -> str:
        return self.path

    def get_data(self, path: str) -> bytes:
        with open(path, "rb") as handle:
            return handle.read()

    def source_to_code(self, data: bytes, path: str) -> object:  # type: ignore[override]
        return compile(rewrite(data.decode("utf-8")), path, "exec", dont_inherit=True)


class _EmptyPackageLoader(importlib.abc.Loader):
    """An intermediate package of the second build (``lightning_parallel.lightning.demo``)."""

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return None

    def exec_module(self, module: ModuleType) -> None:
        module.__doc__ = (
            f"The lightning.pytorch build of {module.__name__.replace('.lightning', '')}."
        )


class LayerFinder(importlib.abc.MetaPathFinder):
    """Finds ``lightning_parallel.lightning.<layer module>`` in this package's own files."""

    def find_spec(
        self,
        fullname: str,
        path: Sequence[str] | None = None,
        target: ModuleType | None = None,
    ) -> importlib.machinery.ModuleSpec | None:
        prefix = LIGHTNING.layer + "."
        if not fullname.startswith(prefix):
            return None
        relative = fullname[len(prefix) :]
        if _in_layer(relative):
            found = _source_path(relative)
            if found is None:
                return None
            file, is_package = found
            return importlib.util.spec_from_file_location(
                fullname,
                file,
                loader=_MappedSourceLoader(fullname, file),
                submodule_search_locations=[os.path.dirname(file)] if is_package else None,
            )
        if _parent_of_layer(relative):
            spec = importlib.machinery.ModuleSpec(fullname, _EmptyPackageLoader(), is_package=True)
            spec.submodule_search_locations = []
            return spec
        return None


_FINDER = LayerFinder()


def install_finder() -> None:
    """Put the finder first on ``sys.meta_path`` (once)."""
    if not any(isinstance(finder, LayerFinder) for finder in sys.meta_path):
        sys.meta_path.insert(0, _FINDER)


def module_name(namespace: Namespace, relative: str) -> str:
    """The full name of layer module ``relative`` (``"strategies.gropipe"``) for ``namespace``."""
    return f"{namespace.layer}.{relative}"


def import_layer(namespace: Namespace, relative: str) -> ModuleType:
    """Import the layer module ``relative`` of ``namespace``'s build."""
    if namespace is not PYTORCH_LIGHTNING:
        install_finder()
    return importlib.import_module(module_name(namespace, relative))


def namespace_of_module(name: str) -> Namespace:
    """Which build a layer module's ``__name__`` belongs to."""
    return LIGHTNING if name.startswith(LIGHTNING.layer + ".") else PYTORCH_LIGHTNING
