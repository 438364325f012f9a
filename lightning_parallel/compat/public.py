"""Which build the public class names at the top of ``lightning_parallel`` are.

A class subclasses one Lightning namespace, and a type checker must know which, so each build
has its own module of public names, and the top of the package is one of them, chosen by
installation and not by import order:

- ``lightning_parallel.lightning``: the ``lightning.pytorch`` classes (``import lightning as L``);
- ``lightning_parallel.pytorch_lightning``: the ``pytorch_lightning`` classes;
- ``lightning_parallel``: the ``lightning.pytorch`` classes when the ``lightning`` distribution
  is installed, else the ``pytorch_lightning`` ones. The environment variable
  ``LIGHTNING_PARALLEL_NAMESPACE`` (``lightning`` or ``pytorch_lightning``) overrides it.

Type checkers read the top of the package as the ``lightning.pytorch`` build.
"""

from __future__ import annotations

import os

from lightning_parallel.compat.namespaces import (
    LIGHTNING,
    NAMESPACE_VARIABLE,
    PYTORCH_LIGHTNING,
    Namespace,
    by_key,
)

__all__: list[str] = []

# each public class, and the layer package that defines it in either build
PUBLIC_CLASSES: dict[str, str] = {
    "GroPipeStrategy": "strategies",
    "HookedDDPStrategy": "strategies",
    "HyloStrategy": "strategies",
    "ModelAveragingStrategy": "strategies",
    "ParameterServerStrategy": "strategies",
    "PowerSGDDDPStrategy": "strategies",
    "SpecTrainStrategy": "strategies",
    "CommStats": "callbacks",
    "HyloCompression": "callbacks",
    "Straggler": "callbacks",
}
# the module of public names of each build
PUBLIC_MODULES: dict[str, str] = {
    LIGHTNING.key: "lightning_parallel.lightning",
    PYTORCH_LIGHTNING.key: "lightning_parallel.pytorch_lightning",
}


def top_level_namespace() -> Namespace:
    """The namespace whose classes ``lightning_parallel.<Class>`` gives (see the module's text)."""
    forced = os.environ.get(NAMESPACE_VARIABLE)
    if forced:
        return by_key(forced)
    return LIGHTNING if LIGHTNING.is_installed() else PYTORCH_LIGHTNING
