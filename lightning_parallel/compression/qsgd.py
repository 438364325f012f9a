"""Peer codec: QSGD stochastic quantization (Alistarh et al. 2017)."""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import Tensor

from lightning_parallel.compression.codec import Codec, Encoded
from lightning_parallel.compression.packing import pack_bits, unpack_bits
from lightning_parallel.compression.randomness import RandomSource

__all__: list[str] = []


class QSGD(Codec):
    """Quantize each value to one of ``2 * levels + 1`` levels of ``||p||_2``, unbiased.

    Algorithm, for a compensated gradient ``p`` and ``s = levels``:

    1. ``norm = ||p||_2``; ``l_i = s * |p_i| / norm`` in ``[0, s]``;
    2. stochastic rounding: ``q_i = floor(l_i) + Bernoulli(l_i - floor(l_i))`` (so
       ``E[q_i] = l_i``);
    3. code ``sign(p_i) * q_i + s`` in ``bits`` bits (4 bits for ``s <= 7``), packed into
       32-bit words; payload: the words and ``norm``;
    4. decode: ``norm * (code - s) / s``.

    Args:
        levels: quantization levels ``s`` per sign (higher => less compression); 1..127.
        seed: seed of the rounding noise (the hook adds the rank).
    """

    name: ClassVar[str] = "qsgd"

    def __init__(self, levels: int = 7, seed: int = 0) -> None:
        if not 1 <= levels <= 127:
            raise ValueError(f"levels must be in 1..127, got {levels}")
        self.levels = levels
        self.bits = next(b for b in (2, 4, 8) if 2 * levels + 1 <= 2**b)
        self.random = RandomSource(seed)

    def encode(self, tensor: Tensor) -> Encoded:
        """Payload ``[words int32, norm (1,) float32]``."""
        flat = tensor.reshape(-1).float()
        norm = torch.linalg.vector_norm(flat)
        scaled = flat.abs() * (self.levels / norm.clamp_min(torch.finfo(torch.float32).tiny))
        lower = scaled.floor()
        level = lower + (self.random.uniform_like(scaled) < scaled - lower).float()
        codes = (torch.sign(flat) * level).to(torch.int64) + self.levels
        return Encoded(
            [pack_bits(codes, self.bits), norm.reshape(1)],
            {"shape": tuple(tensor.shape), "numel": flat.numel(), "dtype": tensor.dtype},
        )

    def decode(self, encoded: Encoded) -> Tensor:
        """Dense tensor ``norm * level / s``."""
        words, norm = encoded.payload
        codes = unpack_bits(words, encoded.context["numel"], self.bits)
        values = (codes.to(torch.float32) - self.levels) * (norm / self.levels)
        return values.to(encoded.context["dtype"]).reshape(encoded.context["shape"])

    def state_dict(self) -> dict[str, Any]:
        """The rounding noise's generator state."""
        return {"random": self.random.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the rounding noise's generator state."""
        self.random.load_state_dict(state["random"])
