"""A stage's optimizer state in the layout of the user's optimizer over the whole model.

A pipeline rank's optimizer holds its stage's parameters only
(:func:`~lightning_parallel.pipeline.ownership.restrict_optimizer`), yet a checkpoint must hold
the state the user's optimizer would have over the whole model, numbered as
``configure_optimizers`` listed the parameters, so that it loads under any strategy. Parameters
are matched by their name in the model, the same on every rank:

1. :func:`whole_model_layout` turns the stage optimizer's ``state_dict()`` into that layout
   (its own parameters' state under their whole-model index; every group with every index);
2. :func:`load_whole_model_layout` does the reverse on resume: it picks, from a whole-model
   state (written by this strategy, ``ddp`` or one device), the entries of the stage's own
   parameters, and the groups' hyperparameters.

The other stages' pieces reach the root one at a time
(:func:`~lightning_parallel.pipeline.consolidate.gather_to_root`): :func:`stage_pieces` is
what a stage sends, :func:`merge_stages` puts every stage's weights and optimizer state in the
root's checkpoint and :func:`merge_pipeline_checkpoint` adds the split under ``"pipeline"``
(the boundaries, each stage's engine state), so that a resumed run keeps the same stages.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

__all__: list[str] = []


def whole_model_layout(
    optimizer: torch.optim.Optimizer,
    group_names: Sequence[Sequence[str]],
    name_of: Mapping[int, str],
) -> dict[str, Any]:
    """``optimizer.state_dict()`` in the whole-model layout.

    Args:
        optimizer: the stage's optimizer (same groups as the user's, fewer parameters).
        group_names: the name of every parameter of the user's optimizer, group by group.
        name_of: ``id(parameter) -> name`` for the stage's parameters.
    """
    state = optimizer.state_dict()
    position = {name: i for i, name in enumerate(n for group in group_names for n in group)}
    mine = [name_of[id(p)] for group in optimizer.param_groups for p in group["params"]]
    groups, start = [], 0
    for saved, names in zip(state["param_groups"], group_names):
        settings = {key: value for key, value in saved.items() if key != "params"}
        groups.append({**settings, "params": list(range(start, start + len(names)))})
        start += len(names)
    own = {position[mine[int(i)]]: value for i, value in state["state"].items()}
    return {"state": own, "param_groups": groups}


def load_whole_model_layout(
    optimizer: torch.optim.Optimizer,
    saved: Mapping[str, Any],
    group_names: Sequence[Sequence[str]],
    name_of: Mapping[int, str],
) -> None:
    """Install in the stage's ``optimizer`` its parameters' part of ``saved`` (whole-model
    layout) and every group's hyperparameters (learning rate, ...)."""
    flat = [name for group in group_names for name in group]
    by_name = {flat[int(i)]: value for i, value in saved["state"].items()}
    for group, saved_group in zip(optimizer.param_groups, saved["param_groups"]):
        group.update({key: value for key, value in saved_group.items() if key != "params"})
        for parameter in group["params"]:
            values = by_name.get(name_of[id(parameter)])
            if values is not None:
                optimizer.state[parameter] = {
                    key: _owned_copy(value, parameter) for key, value in values.items()
                }


def _owned_copy(value: Any, parameter: Tensor) -> Any:
    # a copy: the saved tensor may be a page of a memory-mapped checkpoint; step counters
    # (0-d) stay where the optimizer keeps them
    if not isinstance(value, Tensor):
        return value
    if value.dim() == 0:
        return value.clone()
    return value.detach().to(device=parameter.device, copy=True)


def merge_stages(
    checkpoint: dict[str, Any], stages: Sequence[Mapping[str, Any]], order: Sequence[str]
) -> dict[str, Any]:
    """Rank 0's checkpoint with every stage's weights and optimizer state merged in.

    Args:
        checkpoint: rank 0's own checkpoint (its stage only, whole-model optimizer layout).
        stages: each stage's pieces: ``state_dict``, ``optimizer_states`` (per optimizer, the
            ``state`` part) and ``stage`` (engine state).
        order: the model's ``state_dict`` keys in order.
    """
    weights: dict[str, Any] = {}
    for part in stages:
        weights.update(part["state_dict"])
    merged = dict(checkpoint)
    merged["state_dict"] = {key: weights[key] for key in order if key in weights}
    merged["optimizer_states"] = [
        {
            **saved,
            "state": dict(
                sorted(
                    (index, value)
                    for part in stages
                    for index, value in part["optimizer_states"][n].items()
                )
            ),
        }
        for n, saved in enumerate(checkpoint.get("optimizer_states", []))
    ]
    return merged


def stage_pieces(checkpoint: Mapping[str, Any], stage_state: Any) -> dict[str, Any]:
    """What a stage contributes to the whole checkpoint: its weights, the ``state`` part of
    each optimizer's state (whole-model layout) and its engine's ``stage_state``."""
    return {
        "state_dict": checkpoint.get("state_dict", {}),
        "optimizer_states": [s.get("state", {}) for s in checkpoint.get("optimizer_states", [])],
        "stage": stage_state,
    }


def merge_pipeline_checkpoint(
    checkpoint: dict[str, Any],
    stages: Sequence[Mapping[str, Any]],
    order: Sequence[str],
    boundaries: Sequence[int],
) -> dict[str, Any]:
    """:func:`merge_stages`, with the split and every stage's engine state under
    ``"pipeline"``: ``{"boundaries": [...], "stages": [stage_state, ...]}``."""
    merged = merge_stages(checkpoint, stages, order)
    merged["pipeline"] = {
        "boundaries": list(boundaries),
        "stages": [part["stage"] for part in stages],
    }
    return merged
