"""The user's optimizer restricted to one server shard: built from it, and kept in step with it.

The user's optimizer is the *template*: it never steps itself. Its trained parameters, in its
order (:func:`trained_parameters`), are the server's flat order, and a shard owns the run
``first .. first + count`` of them
(:class:`~lightning_parallel.parameter_server.layout.ShardLayout`). A shard's optimizer is
built and kept like this:

1. each of the template's parameter groups, in order, gives the part of its parameters that
   falls in the shard's run (if any) as one group of the shard's optimizer, with the template
   group's hyperparameters (:func:`shard_optimizer`); :func:`group_origins` gives each such
   group's index in the template;
2. the optimizer is the template's class, rebuilt over those groups with the template's
   defaults (:func:`~lightning_parallel.optimizers.rebuild_optimizer`); the server builds it
   over the views of its flat vector with :func:`optimizer_factory`;
3. before every update, :class:`HyperparameterMirror` copies each origin group's current
   hyperparameters (a learning rate a scheduler changed, ...) onto the shard's group, so that
   learning-rate schedulers on the user's optimizer keep working.

Checkpoints use the same origins to give each shard its part of the user's optimizer state
(:meth:`~lightning_parallel.parameter_server.runtime.ParameterServerRuntime.load_state`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import Tensor
from torch.optim import Optimizer

from lightning_parallel.optimizers import rebuild_optimizer

__all__: list[str] = []


def trained_parameters(optimizer: Optimizer) -> list[Tensor]:
    """The parameters ``optimizer`` trains, in its order (the flat order of the server)."""
    return [parameter for group in optimizer.param_groups for parameter in group["params"]]


def shard_optimizer(template: Optimizer, first: int, parameters: list[Tensor]) -> Optimizer:
    """``template``'s class, hyperparameters and groups over a shard's ``parameters``.

    ``parameters`` stand for the template's parameters ``first``, ``first+1``, ... in flat order.
    """
    groups: list[dict[str, Any]] = []
    index = 0
    for group in template.param_groups:
        size = len(group["params"])
        lo, hi = max(first, index), min(first + len(parameters), index + size)
        if lo < hi:
            settings = {key: value for key, value in group.items() if key != "params"}
            groups.append({**settings, "params": parameters[lo - first : hi - first]})
        index += size
    return rebuild_optimizer(template, groups)


def optimizer_factory(template: Optimizer, first: int) -> Callable[[list[Tensor]], Optimizer]:
    """What the server calls to build its optimizer (:func:`shard_optimizer`) over the views
    of its flat vector, standing for the template's parameters from ``first`` on."""

    def make(parameters: list[Tensor]) -> Optimizer:
        return shard_optimizer(template, first, parameters)

    return make


def group_origins(template: Optimizer, first: int, count: int) -> list[int]:
    """For each group of :func:`shard_optimizer`'s result, its index in the template."""
    origins, index = [], 0
    for position, group in enumerate(template.param_groups):
        size = len(group["params"])
        if max(first, index) < min(first + count, index + size):
            origins.append(position)
        index += size
    return origins


class HyperparameterMirror:
    """Copy the template's current hyperparameters (learning rate, ...) onto a shard's groups."""

    def __init__(self, template: Optimizer, origins: list[int]) -> None:
        self.template = template
        self.origins = origins

    def __call__(self, optimizer: Optimizer) -> None:
        for group, origin in zip(optimizer.param_groups, self.origins):
            for key, value in self.template.param_groups[origin].items():
                if key != "params":
                    group[key] = value


def mark_stepped(optimizer: Optimizer) -> None:
    """Tell torch's learning-rate schedulers that ``optimizer`` stepped: the server stepped in
    its place (with the rate :class:`HyperparameterMirror` copies). Without it every scheduler's
    first ``step()`` warns that it came before ``optimizer.step()``, though the schedule is
    right: torch reads the flag ``optimizer._opt_called``, which its schedulers' wrapper around
    ``optimizer.step`` sets."""
    optimizer._opt_called = True  # type: ignore[attr-defined]
