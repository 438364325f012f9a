"""lightning_parallel: parallel-training techniques from research, one ``Trainer`` argument away.

``import lightning_parallel`` registers every strategy name of the package with Lightning, so
``Trainer(strategy="<name>")`` works for each name in :func:`registered_names`, whether your
code imports ``lightning.pytorch`` (``import lightning as L``) or ``pytorch_lightning``: the
names go into each namespace's registry when that namespace is imported.

The strategy and callback classes below follow the Lightning your code uses (see
:mod:`lightning_parallel.compat`): ``GroPipeStrategy(...)`` is accepted by ``L.Trainer`` in a
script that imports ``lightning`` and by ``pytorch_lightning.Trainer`` in one that imports that.
"""

from lightning_parallel.__about__ import __version__
from lightning_parallel.comm.accounting import track_collectives
from lightning_parallel.comm.exit import destroy_group_at_exit as _destroy_group_at_exit
from lightning_parallel.comm.ledger import CommLedger, process_ledger
from lightning_parallel.compat import layer as _layer
from lightning_parallel.compat import registration as _registration
from lightning_parallel.compat.public import public_class as _public_class
from lightning_parallel.compat.registration import register_strategy, registered_names
from lightning_parallel.pipeline import HybridCosineLinearLR

_layer.install_finder()
_destroy_group_at_exit()  # see comm/exit.py

GroPipeStrategy = _public_class(
    "strategies.gropipe",
    "GroPipeStrategy",
    "GroPipe: pipeline stages inside groups, data parallel across groups.",
)
HookedDDPStrategy = _public_class(
    "strategies.ddp_hooks", "HookedDDPStrategy", "DDP whose comm hook is registered on CPU too."
)
PowerSGDDDPStrategy = _public_class(
    "strategies.ddp_hooks", "PowerSGDDDPStrategy", "DDP with torch's PowerSGD comm hook."
)
HyloStrategy = _public_class(
    "strategies.hylo", "HyloStrategy", "DDP with Hylo layer-wise gradient compression."
)
ModelAveragingStrategy = _public_class(
    "strategies.model_averaging",
    "ModelAveragingStrategy",
    "Model averaging: local SGD, one-shot, BMUF, EASGD and outer optimizers such as DiLoCo.",
)
ParameterServerStrategy = _public_class(
    "strategies.parameter_server",
    "ParameterServerStrategy",
    "Asynchronous, staleness-aware training on a parameter server.",
)
SpecTrainStrategy = _public_class(
    "strategies.spectrain", "SpecTrainStrategy", "A no-flush pipeline with weight prediction."
)
CommStats = _public_class(
    "callbacks.comm_stats", "CommStats", "Communication telemetry: bytes, time and gauges per step."
)
HyloCompression = _public_class(
    "callbacks.hylo", "HyloCompression", "Hylo layer-wise gradient compression as a callback."
)
Straggler = _public_class(
    "callbacks.straggler", "Straggler", "Slows one rank down, for benchmarks of stragglers."
)

_registration.install()

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
