"""Hylo's policy: which codec compresses which parameter, by layer type and size.

Rules (the thesis: "different layer types get different compression; only layers whose
parameter count exceeds a threshold are compressed"), for a parameter of shape ``S`` and
``n = prod(S)`` values, with ``codec="hylo"``:

1. ``n < min_compress_numel`` (biases, norms, small layers): uncompressed, fused with the other
   uncompressed gradients of the bucket into one allreduce;
2. a convolution weight (``len(S) >= 3``: ``(out, in, *kernel)``): :class:`KernelTopK` at the
   adaptive rate (``conv_rate`` at ``reference_numel`` parameters, smaller for larger layers);
3. a fully-connected weight (``len(S) == 2``): :class:`TwoBitQuantizer` (``fc_bits=2``), or
   uncompressed with ``fc_bits=32``;
4. anything else: uncompressed.

The default threshold, 65,536 values (256 KiB of float32), keeps small convolutions and a
classifier's output layer dense. They hold little of the bytes, and their gradients matter
most per value. On ``vgg_mini`` (digits, 2 ranks, 10 epochs), 2-bit codes on its 10-class
output layer and kernel top-k on its 9,216- to 36,864-weight convolutions (threshold 8,192)
cost 3 to 4 points of final accuracy against DDP on each of three seeds. They saved 0.26 MB
of a 3.7 MB step. With 65,536 the gap was -2.3, -0.8 and +0.8 points (``docs/hylo.md``).

With a peer codec (``"topk"``, ``"qsgd"``, ``"terngrad"``, ``"signsgd"``) every parameter of at
least ``min_compress_numel`` values uses that codec, whatever its layer type; ``"none"``
compresses nothing (the hook then equals plain DDP). Codecs are looked up in a registry, so a
new one is one entry.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from torch import Tensor

from lightning_parallel.compression.codec import Codec
from lightning_parallel.compression.kernel_topk import KernelTopK
from lightning_parallel.compression.none import NoCompression
from lightning_parallel.compression.qsgd import QSGD
from lightning_parallel.compression.sign_sgd import SignSGD
from lightning_parallel.compression.terngrad import TernGrad
from lightning_parallel.compression.topk import TopK
from lightning_parallel.compression.two_bit import TwoBitQuantizer

__all__: list[str] = []

#: How a layer's gradient travels (see :mod:`~lightning_parallel.compression.exchange`).
DENSE = "dense"  # fused allreduce, uncompressed
KERNEL = "kernel"  # globally agreed kernel selection, selected kernels allreduced densely
TWO_BIT = "two_bit"  # 2-bit codes, two-phase compressed allreduce (or allgather)
GATHER = "gather"  # any codec's payload allgathered, every rank decodes all (peer codecs)

#: Peer codecs by name: factory from the policy's options.
PEER_CODECS: dict[str, Callable[[Mapping[str, Any]], Codec]] = {
    "topk": lambda options: TopK(ratio=options.get("topk_ratio", 0.01)),
    "qsgd": lambda options: QSGD(levels=options.get("qsgd_levels", 7)),
    "terngrad": lambda options: TernGrad(),
    "signsgd": lambda options: SignSGD(),
}
CODEC_NAMES = ("hylo", "none", *PEER_CODECS)
FC_BITS = (2, 32)
#: parameters with fewer values go uncompressed by default (see the module docstring)
MIN_COMPRESS_NUMEL = 65536


@dataclass(frozen=True)
class LayerPlan:
    """How one parameter's gradient is compressed and exchanged.

    Attributes:
        name: the parameter's name (the key of its error-feedback residual).
        shape: the parameter's shape.
        route: :data:`DENSE`, :data:`KERNEL`, :data:`TWO_BIT` or :data:`GATHER`.
        codec: the codec (:class:`NoCompression` for dense layers).
    """

    name: str
    shape: tuple[int, ...]
    route: str
    codec: Codec

    @property
    def numel(self) -> int:
        """Number of values of the parameter."""
        return math.prod(self.shape)

    @property
    def compressed(self) -> bool:
        """Whether the gradient is compressed (any route but dense)."""
        return self.route != DENSE


class HyloPolicy:
    """Map each parameter to a codec and an exchange route by layer type and size.

    Args:
        codec: ``"hylo"`` (per layer type), a peer codec name (``"topk"``, ``"qsgd"``,
            ``"terngrad"``, ``"signsgd"``) applied to every large parameter, or ``"none"``.
        conv_rate: fraction of kernels a convolution of ``reference_numel`` parameters sends
            (higher => less compression); see :class:`KernelTopK`.
        fc_bits: 2 (2-bit quantization of fully-connected weights) or 32 (uncompressed).
        threshold_factor: 2-bit threshold in units of the mean absolute gradient.
        min_compress_numel: parameters with fewer values are sent uncompressed (higher => fewer
            layers compressed).
        reference_numel: layer size at which a convolution's rate equals ``conv_rate``.
        rate_exponent: how fast the convolution rate falls with layer size.
        min_rate: lower bound of the convolution rate.
        max_rate: upper bound of the convolution rate.
        topk_ratio: fraction of values sent by the ``"topk"`` peer codec.
        qsgd_levels: levels per sign of the ``"qsgd"`` peer codec.
        reconstruction: what 2-bit codes decode to: ``"mean"`` (the mean magnitude of the
            values sent) or ``"threshold"`` (``tau`` itself); see :class:`TwoBitQuantizer`.
        block_size: values per 2-bit block, each with its own threshold and scale (a multiple
            of 16), or ``None`` for one per tensor; see :class:`TwoBitQuantizer`.

    Example::

        policy = HyloPolicy(conv_rate=0.05, min_compress_numel=8192)
        plans = policy.plan(model.named_parameters())
        plans["layers.0.0.weight"].route  # "kernel"
    """

    def __init__(
        self,
        codec: str = "hylo",
        conv_rate: float = 0.05,
        fc_bits: int = 2,
        threshold_factor: float = 1.0,
        min_compress_numel: int = MIN_COMPRESS_NUMEL,
        reference_numel: int = 65536,
        rate_exponent: float = 0.5,
        min_rate: float = 0.01,
        max_rate: float = 0.25,
        topk_ratio: float = 0.01,
        qsgd_levels: int = 7,
        reconstruction: str = "mean",
        block_size: int | None = 512,
    ) -> None:
        if codec not in CODEC_NAMES:
            raise ValueError(f"codec must be one of {CODEC_NAMES}, got {codec!r}")
        if fc_bits not in FC_BITS:
            raise ValueError(
                f"fc_bits must be 2 (2-bit quantization) or 32 (uncompressed), got {fc_bits}"
            )
        if min_compress_numel < 1:
            raise ValueError(
                f"min_compress_numel must be a positive value, got {min_compress_numel}"
            )
        self.codec_name = codec
        self.fc_bits = fc_bits
        self.min_compress_numel = min_compress_numel
        self.kernel_codec = KernelTopK(
            conv_rate, reference_numel, rate_exponent, min_rate, max_rate
        )
        self.two_bit_codec = TwoBitQuantizer(threshold_factor, reconstruction, block_size)
        self.dense_codec = NoCompression()
        options = {"topk_ratio": topk_ratio, "qsgd_levels": qsgd_levels}
        self.peer_codec = PEER_CODECS[codec](options) if codec in PEER_CODECS else None

    def assign(self, name: str, shape: Iterable[int]) -> LayerPlan:
        """The plan of one parameter ``name`` of ``shape``."""
        shape = tuple(int(size) for size in shape)
        dense = LayerPlan(name, shape, DENSE, self.dense_codec)
        if self.codec_name == "none" or math.prod(shape) < self.min_compress_numel:
            return dense
        if self.peer_codec is not None:
            return LayerPlan(name, shape, GATHER, self.peer_codec)
        if len(shape) >= 3:
            return LayerPlan(name, shape, KERNEL, self.kernel_codec)
        if len(shape) == 2 and self.fc_bits == 2:
            return LayerPlan(name, shape, TWO_BIT, self.two_bit_codec)
        return dense

    def plan(self, named_parameters: Iterable[tuple[str, Tensor]]) -> dict[str, LayerPlan]:
        """Plans of every parameter that requires a gradient, by name."""
        return {
            name: self.assign(name, param.shape)
            for name, param in named_parameters
            if param.requires_grad
        }

    def codecs(self) -> dict[str, Codec]:
        """Every codec this policy may use, by codec name (for checkpointing their state)."""
        codecs: list[Codec] = [self.dense_codec, self.kernel_codec, self.two_bit_codec]
        if self.peer_codec is not None:
            codecs.append(self.peer_codec)
        return {codec.name: codec for codec in codecs}
