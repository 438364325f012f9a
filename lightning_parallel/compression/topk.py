"""Peer codec: element-wise top-k sparsification (Aji & Heafield 2017; Stich et al. 2018)."""

from __future__ import annotations

import math
from typing import ClassVar

import torch
from torch import Tensor

from lightning_parallel.compression.codec import Codec, Encoded

__all__: list[str] = []


class TopK(Codec):
    """Send the ``k = ceil(ratio * n)`` values of largest magnitude and their indices.

    Algorithm (with error feedback, "sparsified SGD with memory"):

    1. ``idx = topk(|p|, k)`` over the flattened compensated gradient ``p``;
    2. payload: ``p[idx]`` (float) and ``idx`` (int32), ``8k`` bytes instead of ``4n``;
    3. decode: scatter the values into zeros; the rest stays in the residual.

    Sparse payloads of different ranks have different indices, so they are exchanged by
    allgather (bytes per rank grow with the world size), unlike Hylo's kernel selection.

    Args:
        ratio: fraction of values sent (higher => less compression).
    """

    name: ClassVar[str] = "topk"

    def __init__(self, ratio: float = 0.01) -> None:
        if not 0.0 < ratio <= 1.0:
            raise ValueError(f"ratio must be in (0, 1], got {ratio}")
        self.ratio = ratio

    def values_to_send(self, numel: int) -> int:
        """``k`` for a tensor of ``numel`` values."""
        return max(1, min(numel, math.ceil(self.ratio * numel)))

    def encode(self, tensor: Tensor) -> Encoded:
        """Payload ``[values (k,), indices (k,) int32]``."""
        flat = tensor.reshape(-1)
        indices = torch.topk(flat.abs(), self.values_to_send(flat.numel()), sorted=False).indices
        return Encoded(
            [flat.index_select(0, indices), indices.to(torch.int32)],
            {"shape": tuple(tensor.shape), "numel": flat.numel()},
        )

    def decode(self, encoded: Encoded) -> Tensor:
        """Dense tensor with the sent values in place and zeros elsewhere."""
        values, indices = encoded.payload
        dense = torch.zeros(encoded.context["numel"], dtype=values.dtype, device=values.device)
        dense.index_copy_(0, indices.long(), values)
        return dense.reshape(encoded.context["shape"])
