"""GroPipe's hybrid learning-rate decay: a cosine curve, then a straight line to the end.

Cosine decay keeps the learning rate high for long and falls fast in its middle; GroPipe's
thesis follows it with a linear decay so that training ends at a chosen rate on a fixed
schedule. The thesis gives the shape, not the constants; the exact form chosen here, for step
``t`` (``scheduler.step()`` calls so far), base rate ``η₀`` of each parameter group, total
steps ``T``, warm-up ``W``, cosine length ``C = round(cosine_fraction · (T − W))``,
``η_s = switch_ratio · η₀`` and ``η_e = final_ratio · η₀``:

1. warm-up, ``t < W``: ``η = η₀ · (t + 1) / W``;
2. cosine, ``W ≤ t < W + C``: ``η = η_s + (η₀ − η_s) · ½ · (1 + cos(π · (t − W) / C))``,
   from ``η₀`` down to ``η_s``;
3. linear, ``W + C ≤ t ≤ T``: ``η = η_s + (η_e − η_s) · (t − W − C) / (T − W − C)``, from
   ``η_s`` down to ``η_e``;
4. after ``T``: ``η_e``.

The curve is continuous at both joins. With ``cosine_fraction=1`` there is no linear tail and the
cosine ends at ``η_e`` instead of ``η_s``. Example::

    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    scheduler = HybridCosineLinearLR(optimizer, total_steps=1000, cosine_fraction=0.8)
    for batch in data:
        ...
        optimizer.step()
        scheduler.step()
"""

from __future__ import annotations

import math

from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler

__all__: list[str] = []


class HybridCosineLinearLR(LRScheduler):
    """Decay the learning rate along a cosine, then linearly (GroPipe's hybrid schedule).

    Args:
        optimizer: the wrapped optimizer; each parameter group's ``lr`` is its ``η₀``.
        total_steps: ``T``, steps until the rate reaches ``final_ratio · η₀``.
        cosine_fraction: share of the post-warm-up steps spent on the cosine (``0 < f ≤ 1``;
            higher => longer cosine, shorter linear tail).
        switch_ratio: rate at the switch from cosine to linear, as a fraction of ``η₀``.
        final_ratio: rate at ``total_steps``, as a fraction of ``η₀`` (``≤ switch_ratio``).
        warmup_steps: ``W``, steps of linear warm-up from ``η₀/W`` (0: none).
        last_epoch: index of the last step when resuming (``-1``: start).
    """

    def __init__(
        self,
        optimizer: Optimizer,
        total_steps: int,
        cosine_fraction: float = 0.75,
        switch_ratio: float = 0.1,
        final_ratio: float = 0.0,
        warmup_steps: int = 0,
        last_epoch: int = -1,
    ) -> None:
        if total_steps < 1:
            raise ValueError(f"total_steps must be at least 1, got {total_steps}")
        if not 0 <= warmup_steps < total_steps:
            raise ValueError(f"warmup_steps must be in 0..total_steps-1, got {warmup_steps}")
        if not 0 < cosine_fraction <= 1:
            raise ValueError(f"cosine_fraction must be in (0, 1], got {cosine_fraction}")
        if not 0 <= final_ratio <= switch_ratio <= 1:
            raise ValueError(
                "need 0 <= final_ratio <= switch_ratio <= 1, got "
                f"final_ratio={final_ratio}, switch_ratio={switch_ratio}"
            )
        self.total_steps = total_steps
        self.warmup_steps = warmup_steps
        self.cosine_steps = max(1, round(cosine_fraction * (total_steps - warmup_steps)))
        self.switch_ratio = switch_ratio
        self.final_ratio = final_ratio
        super().__init__(optimizer, last_epoch)

    def factor(self, step: int) -> float:
        """``η(step) / η₀`` (the four cases of the module docstring)."""
        warmup, cosine, total = self.warmup_steps, self.cosine_steps, self.total_steps
        linear = total - warmup - cosine
        if step < warmup:
            return (step + 1) / warmup
        if step < warmup + cosine:
            # with no linear tail (cosine_fraction=1) the cosine itself ends at final_ratio
            low = self.switch_ratio if linear > 0 else self.final_ratio
            progress = (step - warmup) / cosine
            return low + (1 - low) * 0.5 * (1 + math.cos(math.pi * progress))
        if step >= total or linear <= 0:
            return self.final_ratio
        progress = (step - warmup - cosine) / linear
        return self.switch_ratio + (self.final_ratio - self.switch_ratio) * progress

    def get_lr(self) -> list[float]:  # type: ignore[override]
        return [float(base) * self.factor(self.last_epoch) for base in self.base_lrs]

    def _get_closed_form_lr(self) -> list[float]:
        return self.get_lr()
