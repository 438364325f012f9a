"""lightning_parallel: parallel-training techniques from research, one ``Trainer`` argument away.

``import lightning_parallel`` registers every strategy name of the package with Lightning, so
``Trainer(strategy="<name>")`` works for each name in :func:`registered_names`.
"""

from lightning_parallel.__about__ import __version__
from lightning_parallel.callbacks import CommStats, HyloCompression, Straggler
from lightning_parallel.comm.accounting import track_collectives
from lightning_parallel.comm.ledger import CommLedger, process_ledger
from lightning_parallel.pipeline import HybridCosineLinearLR
from lightning_parallel.strategies import (
    GroPipeStrategy,
    HookedDDPStrategy,
    HyloStrategy,
    ModelAveragingStrategy,
    ParameterServerStrategy,
    PowerSGDDDPStrategy,
    SpecTrainStrategy,
    register_strategy,
    registered_names,
)

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
    "PowerSGDDDPStrategy",
    "SpecTrainStrategy",
    "Straggler",
    "__version__",
    "process_ledger",
    "register_strategy",
    "registered_names",
    "track_collectives",
]
