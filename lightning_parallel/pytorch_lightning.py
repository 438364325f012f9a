"""The public classes for ``pytorch_lightning`` (``import pytorch_lightning as pl``).

``from lightning_parallel.pytorch_lightning import GroPipeStrategy`` names the class that
``pytorch_lightning.Trainer`` accepts, whatever else is installed; ``lightning_parallel.lightning``
has the same names for ``lightning.pytorch`` (see :mod:`lightning_parallel.compat.public`).
"""

from lightning_parallel.callbacks import CommStats, HyloCompression, Straggler
from lightning_parallel.strategies import (
    GroPipeStrategy,
    HookedDDPStrategy,
    HyloStrategy,
    ModelAveragingStrategy,
    ParameterServerStrategy,
    PowerSGDDDPStrategy,
    SpecTrainStrategy,
)

__all__ = [
    "CommStats",
    "GroPipeStrategy",
    "HookedDDPStrategy",
    "HyloCompression",
    "HyloStrategy",
    "ModelAveragingStrategy",
    "ParameterServerStrategy",
    "PowerSGDDDPStrategy",
    "SpecTrainStrategy",
    "Straggler",
]
