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

    def payload_nbytes(self, shape: torch.Size | tuple[int, ...]) -> int:
        """Bytes of the payload for a tensor of ``shape`` (float32), without encoding one."""
        return self.encode(torch.zeros(shape)).nbytes()

    def state_dict(self) -> dict[str, Any]:
        """State to checkpoint (random generators of stochastic codecs); empty by default."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:  # noqa: B027 (optional hook)
        """Restore what :meth:`state_dict` returned."""
