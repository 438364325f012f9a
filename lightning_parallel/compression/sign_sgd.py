"""Peer codec: scaled signSGD with error feedback (EF-SignSGD, Karimireddy et al. 2019)."""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import Tensor

from lightning_parallel.compression.codec import Codec, Encoded
from lightning_parallel.compression.packing import pack_bits, unpack_bits

__all__: list[str] = []


class SignSGD(Codec):
    """Send one bit per value, the sign, scaled by the mean magnitude ``||p||_1 / n``.

    Algorithm, for a compensated gradient ``p`` of ``n`` values:

    1. ``scale = ||p||_1 / n``;
    2. code 1 where ``p_i < 0``, else 0; 32 codes per 32-bit word;
    3. decode: ``scale * (1 - 2 * code)``; the error goes to the residual (without it,
       signSGD can diverge, which is the point of the paper).
    """

    name: ClassVar[str] = "signsgd"

    def encode(self, tensor: Tensor) -> Encoded:
        """Payload ``[words int32, scale (1,) float32]``."""
        flat = tensor.reshape(-1)
        scale = (
            flat.abs().mean(dtype=torch.float32)
            if flat.numel()
            else torch.zeros((), device=flat.device)
        )
        return Encoded(
            [pack_bits(flat < 0, 1), scale.reshape(1)],
            {"shape": tuple(tensor.shape), "numel": flat.numel(), "dtype": tensor.dtype},
        )

    def decode(self, encoded: Encoded) -> Tensor:
        """Dense tensor of ``±scale``."""
        words, scale = encoded.payload
        codes = unpack_bits(words, encoded.context["numel"], 1)
        dtype = encoded.context["dtype"]
        values = (1.0 - 2.0 * codes.to(dtype)) * scale.to(dtype)
        return values.reshape(encoded.context["shape"])
