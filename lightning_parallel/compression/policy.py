"""Hylo's policy: which codec compresses which parameter, by layer type and size.

Rules (the thesis: "different layer types get different compression; only layers whose
parameter count exceeds a threshold are compressed"), for a parameter of shape ``S`` and
``n = prod(S)`` values, with ``codec="hylo"``. A layer's candidates:

1. a convolution weight (``len(S) >= 3``: ``(out, in, *kernel)``): :class:`KernelTopK` at the
   adaptive rate (``conv_rate`` at ``reference_numel`` parameters, smaller for larger layers)
   from ``min_compress_numel`` values, and :class:`LowRank` factors of rank ``rank`` (the
   weight viewed ``out x in * kh * kw``) from ``low_rank_min_numel`` (``conv_low_rank``);
2. a fully-connected weight (``len(S) == 2``, ``fc_bits=2``): :class:`TwoBitQuantizer` codes
   from ``min_compress_numel`` values and :class:`LowRank` factors from
   ``low_rank_min_numel`` (``fc_bits=32``: none);
3. anything else (biases, norms, small layers): none.

A layer without candidates is uncompressed, fused with the other uncompressed gradients of the
bucket into one allreduce. Before any measurement a layer takes its first candidate (kernel
top-k for a convolution, the fewer bytes for a fully-connected layer). The
:class:`~lightning_parallel.compression.CostModel` then keeps, per layer, the candidate whose
measured cost (encode + decode seconds + bytes over the measured link) is least among those
whose measured error ``|p - C(p)| / |p|`` is within ``error_budget``, or the dense allreduce
where the codec costs more than it saves.

Why low rank: rank-2 factors of a 4096 x 2048 gradient are 683x smaller than float32, 2-bit
codes 15.5x; on ``vgg_mini`` (98% of its weights in two such layers) the codes cost Hylo 3.7 MB
per step against PowerSGD's 1.1 MB, and the factors erred less (0.35-0.37 against 0.63-0.65 on
its first gradients). Measured on ``vgg_mini``, ``vgg16`` and ``resnet18`` at 100 Mbit/s, the
cost model kept low rank for every layer that has it as a candidate (``docs/hylo.md``).

Why two thresholds: 2-bit codes on ``vgg_mini``'s 10-class output layer and kernel top-k on
its 9,216- to 36,864-weight convolutions (threshold 8,192) cost 3 to 4 points of final accuracy
against DDP on each of three seeds, so kernel top-k and 2-bit codes start at 65,536 values
(``min_compress_numel``). With rank-8 factors on such convolutions the final accuracy stayed
within 0.5 point of DDP or above it (means of 3 seeds on ``vgg_mini``, ``resnet18`` and
``vgg16``), and on ``resnet18`` (width 16) they hold most of the bytes, so low rank starts at
8,192 (``low_rank_min_numel``).

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
from lightning_parallel.compression.low_rank import LowRank
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
LOW_RANK = "low_rank"  # rank-r factors P, Q, each allreduced (PowerSGD-style)
GATHER = "gather"  # any codec's payload allgathered, every rank decodes all (peer codecs)
#: every route, in the order of the hook's per-layer ``route`` gauge
ROUTES = (DENSE, KERNEL, TWO_BIT, LOW_RANK, GATHER)

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
#: parameters with fewer values have no low-rank candidate (docs/hylo.md: on resnet18 the
#: 9,216- to 36,864-weight convolutions hold most of the bytes)
LOW_RANK_MIN_NUMEL = 8192
#: rank of the low-rank candidate (docs/hylo.md: of ranks 2, 4 and 8 on vgg_mini, 8 trained best)
RANK = 8
#: the largest measured error ``|p - C(p)| / |p|`` a candidate codec may have (docs/hylo.md)
ERROR_BUDGET = 0.9


@dataclass(frozen=True)
class LayerPlan:
    """How one parameter's gradient is compressed and exchanged.

    Attributes:
        name: the parameter's name (the key of its error-feedback residual).
        shape: the parameter's shape.
        route: :data:`DENSE`, :data:`KERNEL`, :data:`TWO_BIT`, :data:`LOW_RANK` or
            :data:`GATHER`.
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
        fc_bits: 2 (fully-connected weights compressed: 2-bit codes or low-rank factors) or 32
            (uncompressed).
        threshold_factor: 2-bit threshold in units of the mean absolute gradient.
        min_compress_numel: parameters with fewer values are not sent as kernel top-k or 2-bit
            codes, nor by a peer codec (higher => fewer layers compressed).
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
        rank: rank of the :class:`LowRank` candidate; ``None``: no low-rank candidate (kernel
            top-k and 2-bit codes only, as before).
        error_budget: the largest measured relative error ``|p - C(p)| / |p|`` of a candidate
            the cost model may choose (lower => more accurate, more bytes); when no candidate
            is within it, the one with the least error is kept.
        conv_low_rank: convolutions get the low-rank candidate too (their weight viewed as
            ``out x (in * kh * kw)``), beside kernel top-k.
        low_rank_min_numel: parameters with at least this many values have the low-rank
            candidate (below ``min_compress_numel`` it is their only one).

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
        rank: int | None = RANK,
        error_budget: float = ERROR_BUDGET,
        conv_low_rank: bool = True,
        low_rank_min_numel: int = LOW_RANK_MIN_NUMEL,
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
        if error_budget <= 0:
            raise ValueError(f"error_budget must be a positive value, got {error_budget}")
        self.codec_name = codec
        self.error_budget = error_budget
        self.conv_low_rank = conv_low_rank
        if low_rank_min_numel < 1:
            raise ValueError(
                f"low_rank_min_numel must be a positive value, got {low_rank_min_numel}"
            )
        self.low_rank_min_numel = low_rank_min_numel
        self.low_rank_codec = LowRank(rank) if rank is not None else None
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
        """The plan of one parameter ``name`` of ``shape`` before any measurement."""
        candidates = self.candidates(name, shape)
        if candidates:
            return candidates[0]
        return LayerPlan(name, tuple(int(size) for size in shape), DENSE, self.dense_codec)

    def candidates(self, name: str, shape: Iterable[int]) -> list[LayerPlan]:
        """The compressed plans a parameter may take (empty: dense): a convolution's kernel
        top-k first, a fully-connected layer's fewest bytes first."""
        shape = tuple(int(size) for size in shape)
        numel = math.prod(shape)
        if self.codec_name == "none" or len(shape) < 2:
            return []
        if self.peer_codec is not None:
            if numel < self.min_compress_numel:
                return []
            return [LayerPlan(name, shape, GATHER, self.peer_codec)]
        conv, fc = len(shape) >= 3, len(shape) == 2 and self.fc_bits == 2
        large = numel >= self.min_compress_numel
        plans = []
        if conv and large:
            plans.append(LayerPlan(name, shape, KERNEL, self.kernel_codec))
        if fc and large:
            plans.append(LayerPlan(name, shape, TWO_BIT, self.two_bit_codec))
        low_rank = self.low_rank_codec
        takes_low_rank = fc or (conv and self.conv_low_rank)
        if low_rank is not None and takes_low_rank and numel >= self.low_rank_min_numel:
            plans.append(LayerPlan(name, shape, LOW_RANK, low_rank))
        if conv:
            return plans
        return sorted(plans, key=lambda plan: plan.codec.payload_nbytes(shape))

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
        if self.low_rank_codec is not None:
            codecs.append(self.low_rank_codec)
        if self.peer_codec is not None:
            codecs.append(self.peer_codec)
        return {codec.name: codec for codec in codecs}
