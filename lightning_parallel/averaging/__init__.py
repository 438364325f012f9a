"""Model averaging in plain torch: averagers, their schedule and policies, and the round runner.

Workers train their own replica and synchronize models, not gradients, every ``H`` optimizer
steps. :class:`Averager` subclasses are the algorithms (pure arithmetic on the replica and the
mean); :class:`ReplicaAveraging` runs the rounds over ``torch.distributed``.
"""

from lightning_parallel.averaging.averager import Averager
from lightning_parallel.averaging.bmuf import BlockMomentumAverager
from lightning_parallel.averaging.collapse import ReplicaCollapse
from lightning_parallel.averaging.easgd import ElasticAverager
from lightning_parallel.averaging.flat import FlatLayout
from lightning_parallel.averaging.one_shot import OneShotAverager
from lightning_parallel.averaging.outer_optimizer import (
    OuterOptimizerAverager,
    diloco_outer_optimizer,
    lookahead_outer_optimizer,
    slowmo_outer_optimizer,
)
from lightning_parallel.averaging.periodic import PeriodicAverager
from lightning_parallel.averaging.plateau import LossSpike, PlateauExit
from lightning_parallel.averaging.policies import BUFFER_POLICIES, OPTIMIZER_STATE_POLICIES
from lightning_parallel.averaging.reduction import FlatAllReduce, build_reduction
from lightning_parallel.averaging.replicas import ReplicaAveraging
from lightning_parallel.averaging.schedule import AveragingSchedule

__all__ = [
    "BUFFER_POLICIES",
    "OPTIMIZER_STATE_POLICIES",
    "Averager",
    "AveragingSchedule",
    "BlockMomentumAverager",
    "ElasticAverager",
    "FlatAllReduce",
    "FlatLayout",
    "LossSpike",
    "OneShotAverager",
    "OuterOptimizerAverager",
    "PeriodicAverager",
    "PlateauExit",
    "ReplicaAveraging",
    "ReplicaCollapse",
    "build_reduction",
    "diloco_outer_optimizer",
    "lookahead_outer_optimizer",
    "slowmo_outer_optimizer",
]
