"""A seeded, checkpointable random source for stochastic codecs (QSGD, TernGrad)."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

__all__: list[str] = []


class RandomSource:
    """One ``torch.Generator`` per device, seeded once, whose state goes into checkpoints.

    Stochastic rounding must differ between ranks (else their errors correlate) and must be
    reproducible after a resume (else "resume is exact" fails): the Hylo hook seeds each rank with
    ``seed + rank`` and saves :meth:`state_dict` with the residuals.
    """

    def __init__(self, seed: int = 0) -> None:
        self._seed = seed
        self._generators: dict[str, torch.Generator] = {}

    def reseed(self, seed: int) -> None:
        """Start every generator afresh from ``seed``."""
        self._seed = seed
        self._generators.clear()

    def _generator(self, device: torch.device) -> torch.Generator:
        key = str(device)
        generator = self._generators.get(key)
        if generator is None:
            generator = torch.Generator(device=device)
            generator.manual_seed(self._seed)
            self._generators[key] = generator
        return generator

    def uniform_like(self, tensor: Tensor) -> Tensor:
        """Uniform ``[0, 1)`` samples with the shape, dtype and device of ``tensor``."""
        dtype = tensor.dtype if tensor.is_floating_point() else torch.float32
        generator = self._generator(tensor.device)
        return torch.rand(tensor.shape, generator=generator, dtype=dtype, device=tensor.device)

    def state_dict(self) -> dict[str, Any]:
        """Seed and generator states by device."""
        return {
            "seed": self._seed,
            "generators": {key: gen.get_state() for key, gen in self._generators.items()},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned."""
        self._seed = int(state["seed"])
        self._generators.clear()
        for key, generator_state in state["generators"].items():
            self._generator(torch.device(key)).set_state(generator_state)
