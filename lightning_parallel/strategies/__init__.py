"""Lightning strategies of this package; importing this package registers their names."""

from lightning_parallel.compat import register_strategy, registered_names
from lightning_parallel.strategies import averaging_presets  # noqa: F401  (registers the names)
from lightning_parallel.strategies.ddp_hooks import HookedDDPStrategy, PowerSGDDDPStrategy
from lightning_parallel.strategies.gropipe import GroPipeStrategy
from lightning_parallel.strategies.hylo import HyloStrategy
from lightning_parallel.strategies.model_averaging import ModelAveragingStrategy
from lightning_parallel.strategies.parameter_server import ParameterServerStrategy
from lightning_parallel.strategies.spectrain import SpecTrainStrategy

__all__ = [
    "GroPipeStrategy",
    "HookedDDPStrategy",
    "HyloStrategy",
    "ModelAveragingStrategy",
    "ParameterServerStrategy",
    "PowerSGDDDPStrategy",
    "SpecTrainStrategy",
    "register_strategy",
    "registered_names",
]
