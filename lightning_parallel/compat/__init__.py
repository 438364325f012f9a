"""Lightning compatibility: both namespaces, lazy registration, and the private API in one place.

- :mod:`.namespaces`: ``lightning.pytorch`` and ``pytorch_lightning``, which are installed, and
  which one the user's code uses;
- :mod:`.generate`: the ``lightning.pytorch`` build of the Lightning layer (strategies,
  callbacks, demo models, CLI), written as real files from the ``pytorch_lightning`` source;
- :mod:`.registration`: strategy names in each namespace's ``StrategyRegistry``;
- :mod:`.public`: which build the top-level class names are (by installation, not import order);
- :mod:`.private`: every use of Lightning's private API, checked at construction.

Only this package and the layer's modules import Lightning; the technique cores never do.
"""

from lightning_parallel.compat.namespaces import (
    LIGHTNING,
    NAMESPACES,
    PYTORCH_LIGHTNING,
    Namespace,
    active,
    by_key,
    installed,
)
from lightning_parallel.compat.private import CHECKED, SUPPORTED, LightningCompatError, check
from lightning_parallel.compat.registration import load, register_strategy, registered_names

__all__ = [
    "CHECKED",
    "LIGHTNING",
    "NAMESPACES",
    "PYTORCH_LIGHTNING",
    "SUPPORTED",
    "LightningCompatError",
    "Namespace",
    "active",
    "by_key",
    "check",
    "installed",
    "load",
    "register_strategy",
    "registered_names",
]
