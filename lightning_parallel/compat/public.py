"""Public class names that stand for the build matching the user's Lightning.

``lightning_parallel.GroPipeStrategy(...)`` has to be accepted by ``lightning.Trainer`` in one
script and by ``pytorch_lightning.Trainer`` in another, in the same environment. The public name
is a :class:`LayerClass`: calling it builds the class of the namespace that
:func:`.namespaces.active` names at that moment (after the script's own imports), ``isinstance``
is true for an instance of either build, and subclassing it subclasses that namespace's build.
"""

from __future__ import annotations

import inspect
import sys
from typing import Any

from lightning_parallel.compat import layer
from lightning_parallel.compat.namespaces import NAMESPACES, Namespace, active

__all__: list[str] = []


class LayerClass(type):
    """Metaclass of a public name whose class depends on the Lightning namespace in use."""

    _layer_module: str
    _layer_name: str

    def __new__(mcs, name: str, bases: tuple[type, ...], namespace: dict[str, Any]) -> Any:
        if any(isinstance(base, LayerClass) for base in bases):
            # a user's subclass: subclass the build of the namespace in use
            resolved = tuple(
                base.build() if isinstance(base, LayerClass) else base for base in bases
            )
            return type(resolved[0])(name, resolved, namespace)
        return super().__new__(mcs, name, bases, namespace)

    def build(cls, namespace: Namespace | None = None) -> type:
        """The class of ``namespace``'s build (default: the namespace in use)."""
        from lightning_parallel.compat import registration

        namespace = namespace or active()
        registration.load(namespace)
        module = layer.import_layer(namespace, cls._layer_module)
        return getattr(module, cls._layer_name)  # type: ignore[no-any-return]

    def _loaded_builds(cls) -> list[type]:
        builds = []
        for namespace in NAMESPACES:
            module = sys.modules.get(layer.module_name(namespace, cls._layer_module))
            if module is not None and hasattr(module, cls._layer_name):
                builds.append(getattr(module, cls._layer_name))
        return builds

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        return cls.build()(*args, **kwargs)

    def __instancecheck__(cls, instance: Any) -> bool:
        return any(isinstance(instance, build) for build in cls._loaded_builds())

    def __subclasscheck__(cls, subclass: type) -> bool:
        return any(issubclass(subclass, build) for build in cls._loaded_builds())

    @property
    def __signature__(cls) -> inspect.Signature:
        return inspect.signature(cls.build())

    def __repr__(cls) -> str:
        return f"<lightning_parallel class {cls.__name__} (follows the Lightning in use)>"


def public_class(relative_module: str, name: str, summary: str) -> LayerClass:
    """The public name ``name`` for the class defined in layer module ``relative_module``."""
    pytorch_path = f"lightning_parallel.{relative_module}.{name}"
    lightning_path = f"lightning_parallel.lightning.{relative_module}.{name}"
    doc = (
        f"{summary}\n\n"
        f"Calling this name builds ``{lightning_path}`` when your code uses ``lightning.pytorch`` "
        f"(``import lightning as L``) and ``{pytorch_path}`` when it uses ``pytorch_lightning``; "
        f"see :class:`{pytorch_path}` for the arguments. ``isinstance`` accepts either, and a "
        f"subclass of this name subclasses the build of the Lightning in use."
    )
    cls = LayerClass(name, (), {"__doc__": doc, "__module__": "lightning_parallel"})
    cls._layer_module = relative_module
    cls._layer_name = name
    return cls
