"""Error feedback: what a codec did not send is remembered and added to the next gradient.

Algorithm (Seide et al. 2014, "1-bit SGD"; Karimireddy et al. 2019, "Error Feedback Fixes
SignSGD"), for one tensor with key ``k`` at step ``t``:

1. compensate: ``p_t = g_t + e_{t-1}`` (``e_0 = 0``);
2. the codec sends ``C(p_t)``;
3. update: ``e_t = p_t - C(p_t)``.

So ``C(p_t) + e_t == g_t + e_{t-1}`` at every step (nothing is lost, only delayed), which is the
invariant the tests check for every codec.

Residuals are keyed by a string (the parameter's name), never by a DDP bucket index or offset:
DDP rebuilds its buckets after the first iteration and the order and grouping change, while the
parameter names do not. Under gradient accumulation DDP skips communication on the
accumulating micro-batches, so the residual is applied once per optimizer step.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import Tensor

__all__: list[str] = []


class ErrorFeedback:
    """Residual memory keyed by parameter name: ``compensate`` before encoding, ``update`` after.

    Example::

        memory = ErrorFeedback()
        compensated = memory.compensate("fc.weight", grad)
        encoded = codec.encode(compensated)
        decoded = codec.decode(encoded)
        memory.update("fc.weight", compensated, decoded)
    """

    def __init__(self) -> None:
        self._residuals: dict[str, Tensor] = {}

    def compensate(self, key: str, gradient: Tensor) -> Tensor:
        """Return ``gradient + residual[key]`` as a new tensor (the residual starts at zero)."""
        residual = self._residuals.get(key)
        if residual is None:
            return gradient.clone()
        self._check(key, residual, gradient)
        return gradient + residual.to(gradient.dtype)

    @staticmethod
    def _check(key: str, residual: Tensor, gradient: Tensor) -> None:
        if residual.shape != gradient.shape:
            raise ValueError(
                f"error-feedback residual of {key!r} has shape {tuple(residual.shape)} but the "
                f"gradient has shape {tuple(gradient.shape)}; the model changed since the "
                "residuals were saved: call reset() or load matching residuals"
            )

    def compensate_(self, key: str, gradient: Tensor, part: slice | None = None) -> Tensor:
        """In place: add ``gradient`` to the residual storage of ``key`` and return that storage.

        The returned tensor *is* the residual: it holds ``p = g + e`` now, and the caller must
        leave the new residual ``p - C(p)`` in it (by subtracting what was sent). No new tensor
        is allocated after the first step, which matters for large layers (fresh allocations
        cost page faults every step).

        ``part`` (a slice of the flat ``gradient``): compensate only those values and return
        that view of the residual, so that a large layer can be encoded and sent piece by piece
        (the first call allocates the whole residual, zero outside ``part``).
        """
        residual = self._residuals.get(key)
        if residual is None:
            residual = gradient.detach().clone() if part is None else torch.zeros_like(gradient)
            self._residuals[key] = residual
            if part is None:
                return residual
        self._check(key, residual, gradient)
        if part is None:
            return residual.add_(gradient)
        return residual[part].add_(gradient[part])

    def update(self, key: str, compensated: Tensor, decoded: Tensor) -> None:
        """Store ``compensated - decoded`` as the new residual of ``key``."""
        self._residuals[key] = compensated - decoded

    def set(self, key: str, residual: Tensor) -> None:
        """Store ``residual`` as the residual of ``key`` (when it is computed directly)."""
        self._residuals[key] = residual

    def pop(self, key: str) -> Tensor | None:
        """Remove and return the residual of ``key`` (``None`` if it has none)."""
        return self._residuals.pop(key, None)

    def residual(self, key: str) -> Tensor | None:
        """The residual of ``key`` (``None`` before its first update)."""
        return self._residuals.get(key)

    def norm(self, key: str) -> float:
        """Euclidean norm of the residual of ``key`` (0 before its first update)."""
        residual = self._residuals.get(key)
        return 0.0 if residual is None else float(torch.linalg.vector_norm(residual))

    def __iter__(self) -> Iterator[str]:
        """Keys that hold a residual."""
        return iter(self._residuals)

    def __len__(self) -> int:
        return len(self._residuals)

    def reset(self) -> None:
        """Forget every residual."""
        self._residuals.clear()

    def state_dict(self) -> dict[str, Tensor]:
        """Residuals by key, detached copies on CPU (for checkpoints)."""
        return {key: value.detach().cpu().clone() for key, value in self._residuals.items()}

    def load_state_dict(self, state: dict[str, Tensor], device: torch.device | None = None) -> None:
        """Replace every residual with those of ``state`` (moved to ``device`` if given)."""
        self._residuals = {
            key: (value.to(device) if device is not None else value.clone())
            for key, value in state.items()
        }
