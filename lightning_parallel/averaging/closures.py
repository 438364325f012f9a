"""Per-step work of the averaging that must run inside the optimizer's closure.

Lightning hands the optimizer a closure that runs ``training_step`` and ``backward``; what the
averaging must do between the backward and the step goes after it:

1. in a synchronous step (post-local warm-up, the synchronous window), the mean of the
   gradients over the replicas, so that the step is exactly DDP's;
2. in a local step watched by the loss rules (:mod:`~lightning_parallel.averaging.plateau`),
   the step's loss fed to them: one scalar all-reduced, so that every rank decides alike.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import Tensor
from torch.optim import Optimizer

from lightning_parallel.averaging.replicas import ReplicaAveraging

__all__: list[str] = []


def averaging_gradients_after(
    averaging: ReplicaAveraging, optimizer: Optimizer, closure: Callable[[], Any]
) -> Callable[[], Any]:
    """``closure`` followed by the mean of the gradients of ``optimizer``'s parameters."""
    parameters = [p for group in optimizer.param_groups for p in group["params"]]

    def closure_with_mean_gradients() -> Any:
        result = closure()
        averaging.average_gradients(parameters)
        return result

    return closure_with_mean_gradients


def observing_loss_after(
    averaging: ReplicaAveraging, closure: Callable[[], Any]
) -> Callable[[], Any]:
    """``closure`` followed by feeding its loss to the loss rules (collective: a closure that
    returns no loss, such as manual optimization's empty one, feeds NaN, which they ignore)."""

    def closure_observing_loss() -> Any:
        result = closure()
        loss = result if isinstance(result, Tensor) and result.numel() == 1 else float("nan")
        averaging.observe_loss(loss)
        return result

    return closure_observing_loss
