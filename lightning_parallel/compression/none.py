"""The identity codec: send the tensor as it is (small layers, biases, norms)."""

from __future__ import annotations

from typing import ClassVar

from torch import Tensor

from lightning_parallel.compression.codec import Codec, Encoded

__all__: list[str] = []


class NoCompression(Codec):
    """Send the gradient uncompressed; ``decode(encode(x)) == x`` and the residual stays zero.

    In the Hylo hook uncompressed layers are not encoded one by one: they are fused into one
    buffer and allreduced together. This class exists so that every layer has a codec and so that
    the error-feedback invariant is checked for it like for the others.
    """

    name: ClassVar[str] = "none"

    def encode(self, tensor: Tensor) -> Encoded:
        """Return the tensor itself as the payload."""
        return Encoded([tensor.reshape(-1)], {"shape": tuple(tensor.shape)})

    def decode(self, encoded: Encoded) -> Tensor:
        """Return the payload in the original shape."""
        return encoded.payload[0].reshape(encoded.context["shape"])
