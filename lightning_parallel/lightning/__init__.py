"""The public classes for ``lightning.pytorch`` (``import lightning as L``), and their build.

``from lightning_parallel.lightning import GroPipeStrategy`` names the class that
``lightning.Trainer`` accepts, whatever else is installed; ``lightning_parallel.pytorch_lightning``
has the same names for ``pytorch_lightning`` (see :mod:`lightning_parallel.compat.public`).

Below this package, ``strategies``, ``callbacks``, ``demo.models``, ``demo.data`` and ``cli`` are
the files of ``lightning_parallel.strategies`` ... with ``pytorch_lightning`` mapped to
``lightning.pytorch``, written by :mod:`lightning_parallel.compat.generate`: at build time for a
wheel, and here, in a source checkout, whenever they are missing or older than their source.
"""

from lightning_parallel.compat.generate import ensure_current

ensure_current()

from lightning_parallel.lightning.callbacks import (  # noqa: E402 (written just above)
    CommStats,
    HyloCompression,
    Straggler,
)
from lightning_parallel.lightning.strategies import (  # noqa: E402
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
