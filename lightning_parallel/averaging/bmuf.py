"""Block-wise model-update filtering (BMUF): a momentum on the model change of each round."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from lightning_parallel.averaging.averager import Averager, clone_all

__all__: list[str] = []


class BlockMomentumAverager(Averager):
    """Filter the global model's change of each round with a block momentum (BMUF).

    Algorithm (global model ``x_g``, block momentum ``Δ``, ``M`` workers):

    1. the workers take ``H`` local steps from the same point; their mean is ``x̄``;
    2. the block gradient is ``G = x̄ − x_g``;
    3. ``Δ ← η·Δ + ζ·G`` (block momentum ``η``, block learning rate ``ζ``);
    4. ``x_g ← x_g + Δ``;
    5. workers restart from ``x_g`` (classic block momentum), or from ``x_g + η·Δ``
       (Nesterov block momentum, which looks one round ahead).

    ``η = 0, ζ = 1`` is periodic averaging. The paper's advice is ``η ≈ 1 − 1/M`` and ``ζ ≈ 1``;
    ``block_momentum=None`` picks ``1 − 1/M`` for the run's ``M``. Chen and Huo, "Scalable
    training of deep learning machines by incremental block training with intra-block parallel
    optimization and blockwise model-update filtering", ICASSP 2016.

    Args:
        block_momentum: ``η`` in ``[0, 1)``; ``None`` for ``1 − 1/M``.
        block_learning_rate: ``ζ > 0``.
        nesterov: restart the workers from ``x_g + η·Δ``.
    """

    def __init__(
        self,
        block_momentum: float | None = None,
        block_learning_rate: float = 1.0,
        nesterov: bool = False,
    ) -> None:
        super().__init__()
        if block_momentum is not None and not 0.0 <= block_momentum < 1.0:
            raise ValueError(
                f"block_momentum must be in [0, 1), got {block_momentum}; "
                "use None for the paper's 1 - 1/M"
            )
        if block_learning_rate <= 0.0:
            raise ValueError(f"block_learning_rate must be positive, got {block_learning_rate}")
        self.block_momentum_setting = block_momentum
        self.block_learning_rate = float(block_learning_rate)
        self.nesterov = bool(nesterov)
        self.global_model: list[Tensor] = []
        self.block_momentum_buffer: list[Tensor] = []

    @property
    def block_momentum(self) -> float:
        """The ``η`` in use (``1 − 1/M`` unless set)."""
        if self.block_momentum_setting is not None:
            return self.block_momentum_setting
        if self.world_size is None:
            raise RuntimeError("BlockMomentumAverager.reset() must run before its first round")
        return 1.0 - 1.0 / self.world_size

    def reset(self, start: Sequence[Tensor], world_size: int) -> None:
        super().reset(start, world_size)
        self.global_model = clone_all(start)
        self.block_momentum_buffer = [torch.zeros_like(tensor) for tensor in self.global_model]

    def update(self, local: Sequence[Tensor], mean: Sequence[Tensor]) -> list[Tensor]:
        momentum = self.block_momentum
        restart = []
        for global_model, delta, average in zip(
            self.global_model, self.block_momentum_buffer, mean, strict=True
        ):
            block_gradient = average - global_model
            delta.mul_(momentum).add_(block_gradient, alpha=self.block_learning_rate)
            global_model.add_(delta)
            if self.nesterov:
                restart.append(global_model + momentum * delta)
            else:
                restart.append(global_model.clone())
        return restart

    def state_dict(self) -> dict[str, Any]:
        return {
            **super().state_dict(),
            "global_model": clone_all(self.global_model),
            "block_momentum": clone_all(self.block_momentum_buffer),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.global_model = clone_all(state["global_model"])
        self.block_momentum_buffer = clone_all(state["block_momentum"])
