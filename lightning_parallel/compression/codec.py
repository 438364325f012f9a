"""The one interface every gradient compressor implements: encode to a payload, decode back.

A codec turns a (error-compensated) gradient tensor into an :class:`Encoded`: the ``payload``
tensors that travel on the wire and a ``context`` that stays local and tells ``decode`` how to
rebuild a dense tensor of the original shape. Codecs are stateless with respect to the
gradient (error feedback lives in :class:`~lightning_parallel.compression.ErrorFeedback`), so one
instance serves every layer assigned to it; stochastic codecs keep only their random generator,
which :meth:`Codec.state_dict` saves for an exact resume.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from torch import Tensor

__all__: list[str] = []


@dataclass
class Encoded:
    """A compressed tensor: what is sent (``payload``) and what is kept (``context``).

    Attributes:
        payload: tensors that go on the wire, in a fixed order per codec. Their shapes depend
            only on the input's shape (never on its values), so every rank of a data-parallel
            group produces payloads of the same sizes and they can be gathered in one buffer.
        context: local information ``decode`` needs (the original shape, dtype, ...).
    """

    payload: list[Tensor]
    context: dict[str, Any] = field(default_factory=dict)

    def nbytes(self) -> int:
        """Bytes of the payload (what one rank puts on the wire for this tensor)."""
        return sum(t.numel() * t.element_size() for t in self.payload)


class Codec(ABC):
    """Compress a gradient to a payload of tensors and decompress it back.

    Subclasses implement :meth:`encode` and :meth:`decode` with whole-tensor torch operations
    (no Python loop over elements or kernels). ``decode(encode(x))`` is the codec's estimate of
    ``x``; the difference is what error feedback carries into the next step.
    """

    #: Short name used in policies, strategy options and telemetry.
    name: ClassVar[str] = "codec"

    @abstractmethod
    def encode(self, tensor: Tensor) -> Encoded:
        """Compress ``tensor`` (any shape, floating point) into an :class:`Encoded`."""

    @abstractmethod
    def decode(self, encoded: Encoded) -> Tensor:
        """Rebuild a dense tensor with the shape and dtype of the tensor that was encoded."""

    def encode_(self, tensor: Tensor, workspace: Tensor | None = None) -> Encoded:
        """Encode ``tensor`` and leave what was not sent in it: ``tensor - decode(encoded)``.

        This is the error-feedback step of a codec, on the residual storage itself
        (:meth:`ErrorFeedback.compensate_` returns it). The default encodes, decodes and
        subtracts; a codec whose encoding computes the residual on the way (the 2-bit
        quantizer) overrides it to skip the copy, the decode and the subtraction.

        Args:
            tensor: the compensated gradient ``p = g + e``, overwritten with the new residual.
            workspace: optional scratch tensor of ``tensor``'s size, reused across steps.
        """
        encoded = self.encode(tensor)
        # A payload may alias the input (the identity codec sends the tensor itself): it must
        # keep the values sent, not the residual written below.
        storage = tensor.untyped_storage().data_ptr()
        encoded.payload = [
            part.clone() if part.untyped_storage().data_ptr() == storage else part
            for part in encoded.payload
        ]
        tensor.sub_(self.decode(encoded))
        return encoded

    def decode_add_(self, encoded: Encoded, out: Tensor, workspace: Tensor | None = None) -> Tensor:
        """Add the decoded tensor to ``out`` (of the encoded tensor's size) and return ``out``.

        ``workspace``: optional scratch tensor of ``out``'s size that a codec may decode into.
        """
        return out.add_(self.decode(encoded).reshape(out.shape))

    def payload_nbytes(self, shape: torch.Size | tuple[int, ...]) -> int:
        """Bytes of the payload for a tensor of ``shape`` (float32), without encoding one."""
        return self.encode(torch.zeros(shape)).nbytes()

    def wire_nbytes(self, shape: torch.Size | tuple[int, ...]) -> int:
        """Bytes one rank contributes to the exchange for a tensor of ``shape`` (before the
        collective's own factor); the payload's by default."""
        return self.payload_nbytes(shape)

    def state_dict(self) -> dict[str, Any]:
        """State to checkpoint (random generators of stochastic codecs); empty by default."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:  # noqa: B027 (optional hook)
        """Restore what :meth:`state_dict` returned."""
