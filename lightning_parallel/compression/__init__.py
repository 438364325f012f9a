"""Hylo layer-wise gradient compression and peer codecs, in plain torch.

The pieces, from the bottom up: a :class:`Codec` (encode to a payload of tensors, decode back)
with :class:`ErrorFeedback` residuals keyed by parameter name; Hylo's codecs
:class:`KernelTopK` (convolutions), :class:`TwoBitQuantizer` and :class:`LowRank`
(fully-connected layers), the
identity :class:`NoCompression` and the peers :class:`TopK`, :class:`QSGD`, :class:`TernGrad`,
:class:`SignSGD`; the :class:`HyloPolicy` that assigns them by layer type and size; the
allreduce-compatible :class:`HyloExchange`; the :class:`CostModel`; and :class:`HyloHook`, the
DDP communication hook that ties them together. The Lightning side is
:class:`lightning_parallel.callbacks.HyloCompression`.
"""

from lightning_parallel.compression.codec import Codec, Encoded
from lightning_parallel.compression.cost_model import CostDecision, CostModel
from lightning_parallel.compression.error_feedback import ErrorFeedback
from lightning_parallel.compression.exchange import (
    HyloExchange,
    LayerGradient,
    LayerReport,
    two_phase_chunk,
)
from lightning_parallel.compression.hook import HyloHook
from lightning_parallel.compression.kernel_topk import KernelTopK
from lightning_parallel.compression.low_rank import LowRank
from lightning_parallel.compression.none import NoCompression
from lightning_parallel.compression.packing import (
    pack_2bit,
    pack_bits,
    unpack_2bit,
    unpack_bits,
    unpack_signed_2bit,
)
from lightning_parallel.compression.policy import HyloPolicy, LayerPlan
from lightning_parallel.compression.qsgd import QSGD
from lightning_parallel.compression.sign_sgd import SignSGD
from lightning_parallel.compression.terngrad import TernGrad
from lightning_parallel.compression.topk import TopK
from lightning_parallel.compression.two_bit import TwoBitQuantizer

__all__ = [
    "QSGD",
    "Codec",
    "CostDecision",
    "CostModel",
    "Encoded",
    "ErrorFeedback",
    "HyloExchange",
    "HyloHook",
    "HyloPolicy",
    "KernelTopK",
    "LayerGradient",
    "LayerPlan",
    "LayerReport",
    "LowRank",
    "NoCompression",
    "SignSGD",
    "TernGrad",
    "TopK",
    "TwoBitQuantizer",
    "pack_2bit",
    "pack_bits",
    "two_phase_chunk",
    "unpack_2bit",
    "unpack_bits",
    "unpack_signed_2bit",
]
