"""Peer codec: TernGrad stochastic ternarization (Wen et al. 2017)."""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import Tensor

from lightning_parallel.compression.codec import Codec, Encoded
from lightning_parallel.compression.packing import pack_2bit
from lightning_parallel.compression.randomness import RandomSource
from lightning_parallel.compression.two_bit import TwoBitQuantizer

__all__: list[str] = []


class TernGrad(Codec):
    """Ternarize to ``{-s, 0, +s}`` with ``s = max|p|`` and unbiased stochastic rounding.

    Algorithm, for a compensated gradient ``p``:

    1. optional clipping (the paper's "gradient clipping"): ``p <- clamp(p, ±c·std(p))``;
    2. ``s = max |p|``;
    3. ``b_i ~ Bernoulli(|p_i| / s)``; code ``sign(p_i) * b_i`` in 2 bits (16 per word);
    4. decode: ``s * sign * b`` (unbiased for the clipped ``p``; the clipped part and the
       rounding error go to the error-feedback residual).

    Args:
        clip_sigmas: ``c`` of step 1 (``None`` disables clipping).
        seed: seed of the rounding noise (the hook adds the rank).
    """

    name: ClassVar[str] = "terngrad"

    def __init__(self, clip_sigmas: float | None = 2.5, seed: int = 0) -> None:
        if clip_sigmas is not None and clip_sigmas <= 0:
            raise ValueError(f"clip_sigmas must be a positive value or None, got {clip_sigmas}")
        self.clip_sigmas = clip_sigmas
        self.random = RandomSource(seed)

    def encode(self, tensor: Tensor) -> Encoded:
        """Payload ``[words int32, s (1,) float32]``."""
        flat = tensor.reshape(-1).float()
        if self.clip_sigmas is not None and flat.numel() > 1:
            bound = self.clip_sigmas * flat.std()
            flat = torch.maximum(torch.minimum(flat, bound), -bound)
        scale = flat.abs().max() if flat.numel() else torch.zeros((), device=flat.device)
        probability = flat.abs() / scale.clamp_min(torch.finfo(torch.float32).tiny)
        sent = self.random.uniform_like(probability) < probability
        signs = sent.view(torch.int8) * torch.sign(flat).to(torch.int8)
        # Same 2-bit code as Hylo's quantizer (two's complement of the sign).
        return Encoded(
            [pack_2bit(TwoBitQuantizer.codes(signs)), scale.reshape(1)],
            {"shape": tuple(tensor.shape), "numel": flat.numel(), "dtype": tensor.dtype},
        )

    def decode(self, encoded: Encoded) -> Tensor:
        """Dense tensor of ``+s``, ``-s`` and ``0``."""
        words, scale = encoded.payload
        signs = TwoBitQuantizer.signs_from_words(words, encoded.context["numel"])
        values = signs.to(encoded.context["dtype"]) * scale.reshape(())
        return values.reshape(encoded.context["shape"])

    def state_dict(self) -> dict[str, Any]:
        """The rounding noise's generator state."""
        return {"random": self.random.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the rounding noise's generator state."""
        self.random.load_state_dict(state["random"])
