"""An asynchronous, staleness-aware parameter server in plain torch.

Workers push gradients and pull weights over ``torch.distributed`` point-to-point messages
(gloo, a process group of its own); server shards, threads of ordinary ranks, apply them under
an :class:`UpdatePolicy`: staleness-scaled learning rate, dropping, n-softsync, bounded
staleness (SSP) and delay compensation (DC-ASGD). :func:`simulate` runs the same server on
simulated workers with seeded timing. ``ParameterServerStrategy`` (in
``lightning_parallel.strategies``) plugs it into Lightning.
"""

from lightning_parallel.parameter_server.budget import EpochBudget
from lightning_parallel.parameter_server.client import ParameterClient
from lightning_parallel.parameter_server.faults import WorkerFailure
from lightning_parallel.parameter_server.host import ShardHost
from lightning_parallel.parameter_server.layout import ShardLayout
from lightning_parallel.parameter_server.policies import (
    STALENESS_SCALINGS,
    ExponentialScaling,
    InverseScaling,
    SqrtScaling,
    StalenessScaling,
    UpdatePolicy,
    staleness_scaling,
)
from lightning_parallel.parameter_server.runtime import ParameterServerRuntime
from lightning_parallel.parameter_server.server import ShardServer, WorkerStatus
from lightning_parallel.parameter_server.simulation import SimulationResult, simulate
from lightning_parallel.parameter_server.telemetry import ServerStatistics

__all__ = [
    "STALENESS_SCALINGS",
    "EpochBudget",
    "ExponentialScaling",
    "InverseScaling",
    "ParameterClient",
    "ParameterServerRuntime",
    "ServerStatistics",
    "ShardHost",
    "ShardLayout",
    "ShardServer",
    "SimulationResult",
    "SqrtScaling",
    "StalenessScaling",
    "UpdatePolicy",
    "WorkerFailure",
    "WorkerStatus",
    "simulate",
    "staleness_scaling",
]
