"""Hylo's convolution codec: send only the most important kernels, at a rate set by layer size.

Algorithm (Hylo, convolution layers), for a weight gradient ``G`` of shape
``(out_channels, in_channels, *kernel_shape)``:

1. view ``G`` as ``K = out_channels * in_channels`` kernels of ``s = prod(kernel_shape)``
   values: ``G.reshape(K, s)`` (one reshape, no copy);
2. importance of kernel ``j``: its gradient norm ``n_j = ||G_j||_2`` (one ``norm(dim=1)``);
3. adaptive rate from the layer's parameter scale ``P = K * s``:
   ``rate = clamp(conv_rate * (reference_numel / P) ** rate_exponent, min_rate, max_rate)``:
   bigger layers send a smaller fraction (their kernels are more redundant, and they dominate
   the bytes); ``k = max(1, ceil(rate * K))`` kernels are sent;
4. send the ``k`` kernels of largest importance (``topk`` over ``n``) densely, with their
   indices; the others are zero in the decoded tensor and stay in the error-feedback residual.

In the data-parallel exchange the importance is not local: every rank allreduces its ``n``
(one number per kernel) and all ranks select the same kernels from the sum, so the selected
values can be summed by a plain dense allreduce (``encode(tensor, importance=global_norms)``).
"""

from __future__ import annotations

import math
from typing import ClassVar

import torch
from torch import Tensor

from lightning_parallel.compression.codec import Codec, Encoded

__all__: list[str] = []


class KernelTopK(Codec):
    """Send the ``k`` convolution kernels of largest gradient norm; ``k`` adapts to layer size.

    Args:
        conv_rate: fraction of kernels sent by a layer of ``reference_numel`` parameters
            (higher => less compression).
        reference_numel: the layer size at which the rate equals ``conv_rate``.
        rate_exponent: how fast the rate falls with layer size (0 => the same rate for all).
        min_rate: lower bound of the rate.
        max_rate: upper bound of the rate.

    Example::

        codec = KernelTopK(conv_rate=0.05)
        encoded = codec.encode(conv.weight.grad)  # the top kernels and their indices
        estimate = codec.decode(encoded)  # same shape, zeros where kernels were not sent
    """

    name: ClassVar[str] = "kernel_topk"

    def __init__(
        self,
        conv_rate: float = 0.05,
        reference_numel: int = 65536,
        rate_exponent: float = 0.5,
        min_rate: float = 0.01,
        max_rate: float = 0.25,
    ) -> None:
        if not 0.0 < min_rate <= max_rate <= 1.0:
            raise ValueError(
                f"need 0 < min_rate <= max_rate <= 1, got min_rate={min_rate}, max_rate={max_rate}"
            )
        if not 0.0 < conv_rate <= 1.0:
            raise ValueError(f"conv_rate must be in (0, 1], got {conv_rate}")
        if reference_numel < 1:
            raise ValueError(f"reference_numel must be a positive value, got {reference_numel}")
        if rate_exponent < 0:
            raise ValueError(f"rate_exponent must be >= 0, got {rate_exponent}")
        self.conv_rate = conv_rate
        self.reference_numel = reference_numel
        self.rate_exponent = rate_exponent
        self.min_rate = min_rate
        self.max_rate = max_rate

    @staticmethod
    def kernel_layout(shape: torch.Size | tuple[int, ...]) -> tuple[int, int]:
        """``(number of kernels, values per kernel)`` of a weight of ``shape`` (ndim >= 3)."""
        if len(shape) < 3:
            raise ValueError(
                "KernelTopK needs a convolution weight (out, in, *kernel), got shape "
                f"{tuple(shape)}"
            )
        kernels = int(shape[0]) * int(shape[1])
        return kernels, int(math.prod(shape[2:]))

    def rate(self, numel: int) -> float:
        """Fraction of kernels sent by a layer of ``numel`` parameters."""
        scaled = self.conv_rate * (self.reference_numel / max(numel, 1)) ** self.rate_exponent
        return min(self.max_rate, max(self.min_rate, scaled))

    def kernels_to_send(self, shape: torch.Size | tuple[int, ...]) -> int:
        """Number ``k`` of kernels a layer of ``shape`` sends per step."""
        kernels, size = self.kernel_layout(shape)
        return max(1, min(kernels, math.ceil(self.rate(kernels * size) * kernels)))

    def wire_nbytes(self, shape: torch.Size | tuple[int, ...]) -> int:
        """The exchange's bytes: one bfloat16 norm per kernel, then the selected kernels'
        float32 values (no indices: every rank selects the same kernels)."""
        kernels, size = self.kernel_layout(shape)
        return 2 * kernels + 4 * self.kernels_to_send(shape) * size

    def importance(self, tensor: Tensor) -> Tensor:
        """Per-kernel gradient norm, shape ``(kernels,)``: one reshape and one norm."""
        kernels, size = self.kernel_layout(tensor.shape)
        return torch.linalg.vector_norm(tensor.reshape(kernels, size), dim=1)

    def select(self, importance: Tensor, shape: torch.Size | tuple[int, ...]) -> Tensor:
        """Indices of the ``k`` most important kernels (sorted, so every rank agrees on order)."""
        indices = torch.topk(importance.float(), self.kernels_to_send(shape), sorted=False).indices
        return torch.sort(indices).values

    def encode(self, tensor: Tensor, importance: Tensor | None = None) -> Encoded:
        """Payload ``[values (k, s), indices (k,) int32]`` of the most important kernels.

        Args:
            tensor: the (compensated) convolution weight gradient.
            importance: per-kernel importance agreed by all ranks; the local kernel norms when
                ``None``.
        """
        kernels, size = self.kernel_layout(tensor.shape)
        scores = self.importance(tensor) if importance is None else importance
        indices = self.select(scores, tensor.shape)
        values = tensor.reshape(kernels, size).index_select(0, indices)
        return Encoded(
            [values, indices.to(torch.int32)], {"shape": tuple(tensor.shape), "dtype": tensor.dtype}
        )

    def decode(self, encoded: Encoded) -> Tensor:
        """Dense tensor with the sent kernels in place and zeros elsewhere."""
        shape = encoded.context["shape"]
        values, indices = encoded.payload
        kernels, size = self.kernel_layout(shape)
        dense = torch.zeros(kernels, size, dtype=values.dtype, device=values.device)
        dense.index_copy_(0, indices.long(), values)
        return dense.reshape(shape)
