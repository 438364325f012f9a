"""Pack many tensors into one contiguous buffer per dtype, so that a round is a few collectives."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

__all__: list[str] = []


class FlatLayout:
    """How a list of tensors maps into flat buffers, one per ``(dtype, device)``.

    Buckets follow the order in which their ``(dtype, device)`` first appears, and tensors keep
    their order inside a bucket, so every rank with the same model builds the same layout.
    """

    def __init__(self, tensors: Sequence[Tensor]) -> None:
        self.shapes = [tensor.shape for tensor in tensors]
        self.numels = [tensor.numel() for tensor in tensors]
        keys: dict[tuple[torch.dtype, torch.device], list[int]] = {}
        for index, tensor in enumerate(tensors):
            keys.setdefault((tensor.dtype, tensor.device), []).append(index)
        self.buckets = list(keys.items())

    def pack(self, tensors: Sequence[Tensor]) -> list[Tensor]:
        """New flat buffers holding a copy of ``tensors``."""
        if len(tensors) != len(self.shapes):
            raise ValueError(f"expected {len(self.shapes)} tensors, got {len(tensors)}")
        buffers = []
        for (dtype, device), indices in self.buckets:
            if not indices:
                continue
            parts = [tensors[index].detach().reshape(-1) for index in indices]
            buffers.append(torch.cat(parts).to(dtype=dtype, device=device))
        return buffers

    def unpack(self, buffers: Sequence[Tensor]) -> list[Tensor]:
        """Views into ``buffers`` shaped like the packed tensors, in their original order."""
        unpacked: list[Tensor | None] = [None] * len(self.shapes)
        for buffer, (_, indices) in zip(buffers, self.buckets, strict=True):
            offset = 0
            for index in indices:
                numel = self.numels[index]
                unpacked[index] = buffer[offset : offset + numel].view(self.shapes[index])
                offset += numel
        return [tensor for tensor in unpacked if tensor is not None]

    @staticmethod
    def nbytes(buffers: Sequence[Tensor]) -> int:
        """Bytes held by ``buffers``."""
        return sum(buffer.numel() * buffer.element_size() for buffer in buffers)
