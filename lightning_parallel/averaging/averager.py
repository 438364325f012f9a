"""The one-method base class of every model-averaging algorithm."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any, ClassVar

import torch
from torch import Tensor

__all__: list[str] = []


class Averager(ABC):
    """Turn this worker's replica and the replicas' mean into the point it restarts from.

    An averager is pure arithmetic: the communication that produces the mean ``x̄ = (1/M)·Σ_i x_i``
    of the ``M`` replicas is done by :class:`~lightning_parallel.averaging.ReplicaAveraging`, which
    then calls :meth:`update` once per round with lists of tensors shaped like the model's
    trainable parameters (in ``module.parameters()`` order).

    Subclasses with state (a global model, a block momentum, a center variable, an outer
    optimizer) create it in :meth:`reset`, which is called once when the replicas agree (at the
    start of local training), and save it with :meth:`state_dict`, so that a resumed run
    continues exactly.
    """

    #: ``False`` for algorithms that never average during training (one-shot averaging).
    averages_during_training: ClassVar[bool] = True
    #: ``True`` when every worker restarts from the same point after a round (the replicas then
    #: agree until the next step, and evaluating them needs no communication).
    restarts_in_consensus: ClassVar[bool] = True
    #: ``True`` when the workers do not restart in consensus but the algorithm keeps a point they
    #: all agree on (EASGD's center): :meth:`agreed_point` gives it, and a regression of the
    #: loss rolls every replica back to it.
    keeps_agreed_point: ClassVar[bool] = False

    def agreed_point(self) -> list[Tensor] | None:
        """The parameters every worker agrees on after a round when they do not restart from
        one point (EASGD's center; ``None`` before :meth:`reset` and for the other algorithms):
        a regression of the loss rolls every replica back to a kept one."""
        return None

    def mean_of_restarts(self, mean: Sequence[Tensor]) -> list[Tensor] | None:
        """The mean over the workers of the points the next :meth:`update` with this ``mean``
        restarts them from, where the algorithm can tell it without an exchange (EASGD's
        restarts are affine in each replica, so their mean follows from ``x̄``); ``None``
        otherwise. Called before that :meth:`update`; averagers whose workers restart in
        consensus need not say (the restart point is the consensus)."""
        return None

    def __init__(self) -> None:
        self.world_size: int | None = None

    @property
    def started(self) -> bool:
        """Whether :meth:`reset` (or :meth:`load_state_dict`) has created the state."""
        return self.world_size is not None

    def reset(self, start: Sequence[Tensor], world_size: int) -> None:
        """Start from ``start``, the parameters every replica holds now (``world_size`` workers)."""
        self.world_size = world_size

    def stop(self) -> None:
        """Forget the round state until the next :meth:`reset` (a synchronous window restarts
        the averager, its momentum included, from the point the replicas agree on after it)."""
        self.world_size = None

    @abstractmethod
    def update(self, local: Sequence[Tensor], mean: Sequence[Tensor]) -> list[Tensor]:
        """Return the parameters this worker restarts from after a round.

        Args:
            local: this worker's replica ``x_i`` at the end of the round (do not modify).
            mean: the mean ``x̄`` of all replicas (do not modify).
        """

    def gauges(self) -> dict[str, float]:
        """Counts the round runner sets in the process ledger after each round, summed over
        the fragments' averagers (none by default)."""
        return {}

    def state_dict(self) -> dict[str, Any]:
        """The averager's state, identical on every rank (saved once in the checkpoint)."""
        return {"world_size": self.world_size}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned (its tensors may be on the CPU)."""
        self.world_size = state.get("world_size")

    def to(self, device: torch.device) -> None:  # noqa: B027 (optional hook)
        """Move the state to ``device``, the model's (a checkpoint is loaded onto the CPU, the
        model may live on a GPU). Nothing to move here; subclasses with tensors move them."""


def move_all(tensors: Sequence[Tensor], device: torch.device) -> list[Tensor]:
    """``tensors`` on ``device`` (the same tensors where they are there already)."""
    return [tensor.to(device) for tensor in tensors]


def clone_all(tensors: Sequence[Tensor]) -> list[Tensor]:
    """Detached copies of ``tensors`` (state that must not alias the model)."""
    return [tensor.detach().clone() for tensor in tensors]
