"""The direction a prediction moves the weights along, per unit learning rate: the paper's
smoothed gradient, SGD's momentum buffer or Adam's update direction."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_parallel.pipeline.noflush.weights import param_group_index, tensor_bytes

__all__: list[str] = []


class SmoothedGradient:
    """The paper's direction, ``v_t = gamma·v_{t-1} + (1-gamma)·g_t``, times the step scale.

    Args:
        parameters: the stage's trainable parameters.
        gamma: smoothing factor gamma (the paper uses the momentum coefficient).
        step_scale: how far one update moves per unit of ``η·v`` (``(1-d)/(1-μ)`` for torch's
            ``SGD(momentum=μ, dampening=d)``, 1 for plain SGD).
    """

    def __init__(self, parameters: Sequence[Tensor], gamma: float, step_scale: float = 1.0) -> None:
        if not 0.0 <= gamma < 1.0:
            raise ValueError(f"gamma must be in [0, 1), got {gamma}")
        self.gamma = gamma
        self.step_scale = step_scale
        self.velocity = [
            torch.zeros_like(p, memory_format=torch.preserve_format) for p in parameters
        ]

    def observe(self, gradients: Sequence[Tensor | None]) -> None:
        """Fold the gradients of the update just applied into ``v``."""
        pairs = [(v, g.detach()) for v, g in zip(self.velocity, gradients) if g is not None]
        if pairs:
            velocity, grads = [v for v, _ in pairs], [g for _, g in pairs]
            torch._foreach_mul_(velocity, self.gamma)
            torch._foreach_add_(velocity, grads, alpha=1.0 - self.gamma)

    def direction(self, index: int, parameter: Tensor) -> tuple[Tensor, float]:
        """Displacement per unit learning rate of parameter ``index``, as (tensor, factor):
        the update subtracts ``factor·tensor`` (no copy is made)."""
        return self.velocity[index], self.step_scale

    def nbytes(self) -> int:
        return tensor_bytes(self.velocity)


class MomentumBuffer:
    """torch SGD's own momentum buffer as the direction: the paper's ``v`` at no memory cost.

    For ``SGD(momentum=μ, dampening=d)`` and ``gamma = μ``, ``buf_t = (1-d)/(1-μ)·v_t`` (the
    same recursion; equal from the first update when ``d = 0``), so reading the buffer gives
    :class:`SmoothedGradient`'s direction without keeping ``v``.

    Args:
        parameters: the stage's trainable parameters.
        optimizer: a ``torch.optim.SGD`` with momentum.
    """

    def __init__(self, parameters: Sequence[nn.Parameter], optimizer: Optimizer) -> None:
        if not isinstance(optimizer, torch.optim.SGD):
            raise TypeError(
                "direction='momentum_buffer' needs torch.optim.SGD, got "
                f"{type(optimizer).__name__}; use direction='smoothed_gradient'"
            )
        self.parameters = list(parameters)
        self.optimizer = optimizer

    def observe(self, gradients: Sequence[Tensor | None]) -> None:
        """Nothing to keep: the optimizer updates its buffer."""

    def direction(self, index: int, parameter: Tensor) -> tuple[Tensor, float]:
        """The momentum buffer of parameter ``index`` (zeros before the first update)."""
        buffer = self.optimizer.state.get(self.parameters[index], {}).get("momentum_buffer")
        return (torch.zeros_like(parameter), 1.0) if buffer is None else (buffer, 1.0)

    def nbytes(self) -> int:
        return 0


class AdamDirection:
    """Adam's own update direction ``m̂/(√v̂+ε)`` (+ ``λ·W`` when weight decay is decoupled).

    Reads the optimizer's state, so it costs no memory of its own.

    Args:
        parameters: the stage's trainable parameters.
        optimizer: a ``torch.optim.Adam`` or ``AdamW``.
    """

    def __init__(self, parameters: Sequence[nn.Parameter], optimizer: Optimizer) -> None:
        if not isinstance(optimizer, torch.optim.Adam):
            raise TypeError(
                f"direction='adam' needs torch.optim.Adam or AdamW, got {type(optimizer).__name__};"
                " use direction='smoothed_gradient'"
            )
        self.parameters = list(parameters)
        self.optimizer = optimizer
        self.groups = param_group_index(self.parameters, optimizer)

    def observe(self, gradients: Sequence[Tensor | None]) -> None:
        """Nothing to keep: Adam's moments are the smoothed statistics."""

    def direction(self, index: int, parameter: Tensor) -> tuple[Tensor, float]:
        """Adam's displacement per unit learning rate of parameter ``index``, factor 1."""
        p = self.parameters[index]
        state = self.optimizer.state.get(p, {})
        if "exp_avg" not in state or self.groups[index] < 0:
            return torch.zeros_like(parameter), 1.0
        group = self.optimizer.param_groups[self.groups[index]]
        beta1, beta2 = group["betas"]
        step = float(state["step"])
        second = state["max_exp_avg_sq"] if group.get("amsgrad", False) else state["exp_avg_sq"]
        m_hat = state["exp_avg"] / (1.0 - beta1**step)
        v_hat = second / (1.0 - beta2**step)
        direction = m_hat / (v_hat.sqrt() + group["eps"])
        decoupled = group.get(
            "decoupled_weight_decay", isinstance(self.optimizer, torch.optim.AdamW)
        )
        if decoupled and group["weight_decay"]:
            direction = direction + group["weight_decay"] * parameter
        if group.get("maximize", False):
            direction = -direction
        return direction, 1.0

    def nbytes(self) -> int:
        return 0


Direction = SmoothedGradient | MomentumBuffer | AdamDirection
