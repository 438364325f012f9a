"""The registered model-averaging presets: ``model_averaging`` / ``local_sgd``, ``bmuf``,
``easgd`` and ``diloco``, each a name for :class:`ModelAveragingStrategy` with its defaults.

The defaults keep the step of the inner optimizer (tuned as for DDP) rather than multiply it:
per round, with the workers' mean moving 1, BMUF moves 0.75 then 1, EASGD keeps 95% of the
progress, DiLoCo moves 1 (its Nesterov outer momentum turns the step, ``outer_step_cap=1``
keeps its length). docs/model_averaging.md ("Defaults") gives the papers' own values, which are
arguments away, and docs/averaging_defaults.md the measurements.
"""

from __future__ import annotations

from lightning_parallel.averaging.outer_optimizer import DILOCO_OUTER_LR, DILOCO_OUTER_MOMENTUM
from lightning_parallel.compat import register_strategy
from lightning_parallel.strategies.model_averaging import ModelAveragingStrategy

__all__: list[str] = []

register_strategy(
    "model_averaging",
    ModelAveragingStrategy,
    "model averaging (local SGD): replicas averaged every `period` optimizer steps",
    algorithm="periodic",
    period=8,
)
register_strategy(
    "local_sgd",
    ModelAveragingStrategy,
    "local SGD: replicas averaged every `period` optimizer steps (= model_averaging)",
    algorithm="periodic",
    period=8,
)
register_strategy(
    "bmuf",
    ModelAveragingStrategy,
    "BMUF: Nesterov block momentum 0.5, block learning rate 0.5, every `period` steps",
    algorithm="bmuf",
    period=8,
)
register_strategy(
    "easgd",
    ModelAveragingStrategy,
    "synchronous EASGD: replicas and a center variable pull on each other every `period` steps",
    algorithm="easgd",
    period=6,
    beta=0.9,
    center_first=True,
)
register_strategy(
    "diloco",
    ModelAveragingStrategy,
    "DiLoCo: outer Nesterov SGD (lr 0.7, momentum 0.5) on the pseudo-gradient every `period` "
    "steps, each outer step no longer than the workers' mean moved",
    algorithm="outer_optimizer",
    period=16,
    outer_optimizer="sgd",
    outer_lr=DILOCO_OUTER_LR,
    outer_momentum=DILOCO_OUTER_MOMENTUM,
    outer_nesterov=True,
)
