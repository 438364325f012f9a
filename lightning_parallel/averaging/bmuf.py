"""Block-wise model-update filtering (BMUF): a momentum on the model change of each round."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from lightning_parallel.averaging.averager import Averager, clone_all, move_all

__all__: list[str] = []


class BlockMomentumAverager(Averager):
    """Filter the global model's change of each round with a block momentum (BMUF).

    Algorithm (global model ``x_g``, block momentum ``Δ``, ``M`` workers):

    1. the workers take ``H`` local steps from the same point ``x_0`` (``x_g``, or
       ``x_g + η·Δ`` with Nesterov block momentum); their mean is ``x̄``;
    2. the block gradient is the round's progress, ``G = x̄ − x_0``;
    3. ``Δ ← η·Δ + ζ·G`` (block momentum ``η``, block learning rate ``ζ``);
    4. ``x_g ← x_g + Δ``;
    5. workers restart from ``x_g + η·Δ`` (Nesterov block momentum, the default, which looks one
       round ahead), or from ``x_g`` (classic block momentum).

    This is SGD with momentum ``η`` (heavy ball, or torch's Nesterov form) and learning rate
    ``ζ`` on the pseudo-gradient ``x_0 − x̄``. ``η = 0, ζ = 1`` is periodic averaging. Chen and
    Huo, "Scalable training of deep learning machines by incremental block training with
    intra-block parallel optimization and blockwise model-update filtering", ICASSP 2016.

    Defaults, and why: if the workers' mean moves by ``d`` every round, the restart point moves
    by ``ζ/(1 − η)·d`` once the momentum has built up (``(1 + η)·ζ·d`` in the first round with
    Nesterov). The paper's ``η = 1 − 1/M, ζ = 1`` multiplies the step by ``M``: it restores the
    progress a worker alone would have made on all ``M`` shards, like scaling the learning rate
    by ``M``, and suits an inner learning rate tuned for one worker with room to spare. This
    strategy asks for the learning rate you would use for DDP, which is already the scaled one:
    on the bundled ``vgg_mini`` and ``convnet`` the paper's values trained more slowly than
    periodic averaging in 3 epochs, and diverged on ``convnet`` with Nesterov block momentum
    (docs/averaging_defaults.md, "The presets' outer steps"). The defaults keep the step:
    ``ζ = 1 − η`` (``block_learning_rate=None``), so the block momentum ``η = 0.5`` smooths
    the rounds' noise (the first round moves ``1 − η² = 3/4`` of the way) without enlarging the
    step. For the paper's values pass ``block_momentum=None`` (``1 − 1/M``) and
    ``block_learning_rate=1`` (with ``nesterov=False``, the former default), and lower the inner
    learning rate if it trains unsteadily.

    Args:
        block_momentum: ``η`` in ``[0, 1)`` (default 0.5); ``None`` for the paper's ``1 − 1/M``.
        block_learning_rate: ``ζ > 0``; ``None`` (default) for ``1 − η``, which keeps the
            restart point moving as fast as the workers' mean.
        nesterov: restart the workers from ``x_g + η·Δ`` (default) rather than ``x_g``.
    """

    def __init__(
        self,
        block_momentum: float | None = 0.5,
        block_learning_rate: float | None = None,
        nesterov: bool = True,
    ) -> None:
        super().__init__()
        if block_momentum is not None and not 0.0 <= block_momentum < 1.0:
            raise ValueError(
                f"block_momentum must be in [0, 1), got {block_momentum}; "
                "use None for the paper's 1 - 1/M"
            )
        if block_learning_rate is not None and block_learning_rate <= 0.0:
            raise ValueError(
                f"block_learning_rate must be positive, got {block_learning_rate}; "
                "use None for 1 - block_momentum"
            )
        self.block_momentum_setting = block_momentum
        self.block_learning_rate_setting = block_learning_rate
        self.nesterov = bool(nesterov)
        self.global_model: list[Tensor] = []
        self.block_momentum_buffer: list[Tensor] = []

    @property
    def block_momentum(self) -> float:
        """The ``η`` in use (``1 − 1/M`` when set to ``None``)."""
        if self.block_momentum_setting is not None:
            return self.block_momentum_setting
        if self.world_size is None:
            raise RuntimeError("BlockMomentumAverager.reset() must run before its first round")
        return 1.0 - 1.0 / self.world_size

    @property
    def block_learning_rate(self) -> float:
        """The ``ζ`` in use (``1 − η`` unless set)."""
        if self.block_learning_rate_setting is not None:
            return self.block_learning_rate_setting
        return 1.0 - self.block_momentum

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
            # The block's progress is measured from where the workers started it: with Nesterov
            # that is x_g + η·Δ, not x_g. Measuring it from x_g would count the look-ahead
            # η·Δ again every round, Δ ← η·(1 + ζ)·Δ + ζ·(progress), which grows without bound
            # at the paper's η = 1 − 1/M, ζ = 1.
            block_gradient = average - global_model
            if self.nesterov:
                block_gradient.sub_(delta, alpha=momentum)
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

    def to(self, device: torch.device) -> None:
        self.global_model = move_all(self.global_model, device)
        self.block_momentum_buffer = move_all(self.block_momentum_buffer, device)
