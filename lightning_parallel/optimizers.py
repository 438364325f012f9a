"""Rebuild a user's optimizer over other parameters: its class, settings and groups.

The pipelines rebuild the optimizer ``configure_optimizers`` returned over a stage's own
parameters, and the parameter server over each shard's. :func:`rebuild_optimizer` calls the
optimizer's class with the new parameter groups (each group carries its own settings) and those
of its ``defaults`` its constructor accepts: some classes keep defaults they do not take back
(``AdamW`` keeps ``decoupled_weight_decay``, which it always sets itself).
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any

import torch

__all__: list[str] = []


def rebuild_optimizer(
    template: torch.optim.Optimizer, param_groups: Sequence[dict[str, Any]]
) -> torch.optim.Optimizer:
    """``type(template)(param_groups, **accepted defaults)``.

    Raises:
        TypeError: the class cannot be built that way (the message names the fix).
    """
    cls = type(template)
    parameters = inspect.signature(cls.__init__).parameters
    takes_any = any(p.kind == p.VAR_KEYWORD for p in parameters.values())
    defaults = {
        key: value for key, value in template.defaults.items() if takes_any or key in parameters
    }
    try:
        return cls(list(param_groups), **defaults)
    except TypeError as error:
        raise TypeError(
            f"{cls.__name__} could not be rebuilt over other parameters as "
            f"{cls.__name__}(param_groups, **defaults): {error}. Use an optimizer whose "
            "constructor takes its parameter groups first and its settings as keywords (every "
            "torch.optim one does)"
        ) from error
