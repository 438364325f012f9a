"""lightning_parallel: parallel-training techniques from research, one ``Trainer`` argument away.

``import lightning_parallel`` registers every strategy name of the package with Lightning, so
``Trainer(strategy="<name>")`` works for each name in :func:`registered_names`, whether your
code imports ``lightning.pytorch`` (``import lightning as L``) or ``pytorch_lightning``: the
names go into each namespace's registry when that namespace is imported.

The strategy and callback classes are real classes of one Lightning namespace each:
``lightning_parallel.GroPipeStrategy`` is the ``lightning.pytorch`` class when the ``lightning``
distribution is installed (``import lightning as L``), else the ``pytorch_lightning`` one.
``lightning_parallel.lightning`` and ``lightning_parallel.pytorch_lightning`` name each build
explicitly (see :mod:`lightning_parallel.compat.public`).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from lightning_parallel.__about__ import __version__
from lightning_parallel.comm.accounting import track_collectives
from lightning_parallel.comm.exit import destroy_group_at_exit as _destroy_group_at_exit
from lightning_parallel.comm.ledger import CommLedger, process_ledger
from lightning_parallel.compat import public as _public
from lightning_parallel.compat import registration as _registration
from lightning_parallel.compat.registration import register_strategy, registered_names
from lightning_parallel.cpu_memory import hold_freed_memory
from lightning_parallel.files import PartialCheckpointError
from lightning_parallel.pipeline import HybridCosineLinearLR

if TYPE_CHECKING:  # what a type checker reads: the lightning.pytorch build
    from lightning_parallel.lightning import (
        CommStats,
        GroPipeStrategy,
        HookedDDPStrategy,
        HyloCompression,
        HyloStrategy,
        ModelAveragingStrategy,
        ParameterServerStrategy,
        PowerSGDDDPStrategy,
        SpecTrainStrategy,
        Straggler,
    )

_destroy_group_at_exit()  # see comm/exit.py
_registration.install()


def __getattr__(name: str) -> Any:
    """A public class, from the build :func:`.compat.public.top_level_namespace` names.

    Imported on first use, so that ``import lightning_parallel`` imports no Lightning.
    """
    if name not in _public.PUBLIC_CLASSES:
        raise AttributeError(f"module 'lightning_parallel' has no attribute {name!r}")
    namespace = _public.top_level_namespace()
    value = getattr(importlib.import_module(_public.PUBLIC_MODULES[namespace.key]), name)
    globals()[name] = value
    return value


__all__ = [
    "CommLedger",
    "CommStats",
    "GroPipeStrategy",
    "HybridCosineLinearLR",
    "HookedDDPStrategy",
    "HyloCompression",
    "HyloStrategy",
    "ModelAveragingStrategy",
    "ParameterServerStrategy",
    "PartialCheckpointError",
    "PowerSGDDDPStrategy",
    "SpecTrainStrategy",
    "Straggler",
    "__version__",
    "hold_freed_memory",
    "process_ledger",
    "register_strategy",
    "registered_names",
    "track_collectives",
]
