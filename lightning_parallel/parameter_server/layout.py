"""Which parameters each server shard owns, and how they sit in one flat vector.

The trained parameters (those of the user's optimizer, in its order) are laid end to end in a
flat vector. Shard k owns a contiguous run of *whole* parameters, so that its optimizer sees
the parameters with their own shapes (per-parameter state such as momentum or Adam moments
keeps the user's layout, and optimizers that use per-parameter norms stay correct).

Example: parameters of 6, 2, 3 and 5 elements on 2 shards::

    flat     [ p0 p0 p0 p0 p0 p0 | p1 p1 | p2 p2 p2 | p3 p3 p3 p3 p3 ]
    shard 0  [ p0 ............ p1 ]                     elements 0..8
    shard 1                        [ p2 .......... p3 ]  elements 8..16
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

__all__: list[str] = []


@dataclass(frozen=True)
class ShardLayout:
    """Shapes of the flat parameters and the parameter range of every shard.

    Attributes:
        shapes: shape of each parameter, in flat order.
        bounds: ``(first, stop)`` parameter indices of each shard.
    """

    shapes: tuple[torch.Size, ...]
    bounds: tuple[tuple[int, int], ...]

    @classmethod
    def balanced(cls, shapes: Sequence[torch.Size], shards: int) -> ShardLayout:
        """Cut the parameters into ``shards`` contiguous runs of about equal size.

        Shard k ends at the first parameter boundary at or past k/shards of the elements,
        keeping at least one parameter per shard.
        """
        shapes = tuple(torch.Size(shape) for shape in shapes)
        if shards < 1:
            raise ValueError(f"shards must be >= 1, got {shards}")
        if shards > len(shapes):
            raise ValueError(
                f"cannot cut {len(shapes)} parameters into {shards} shards (each shard owns whole "
                f"parameters); use shards <= {len(shapes)}"
            )
        numels = [shape.numel() for shape in shapes]
        total = sum(numels)
        bounds: list[tuple[int, int]] = []
        first, running = 0, 0
        for index, numel in enumerate(numels):
            running += numel
            shard = len(bounds)
            remaining_params = len(numels) - index - 1
            remaining_shards = shards - shard - 1
            if shard == shards - 1:
                continue
            if running * shards >= (shard + 1) * total or remaining_params == remaining_shards:
                bounds.append((first, index + 1))
                first = index + 1
        bounds.append((first, len(numels)))
        return cls(shapes, tuple(bounds))

    @property
    def shards(self) -> int:
        return len(self.bounds)

    @property
    def numels(self) -> tuple[int, ...]:
        return tuple(shape.numel() for shape in self.shapes)

    def parameters_of(self, shard: int) -> range:
        """Indices (flat order) of the parameters shard ``shard`` owns."""
        return range(*self.bounds[shard])

    def elements_of(self, shard: int) -> tuple[int, int]:
        """``(start, stop)`` element offsets of shard ``shard`` in the flat vector."""
        numels = self.numels
        first, stop = self.bounds[shard]
        start = sum(numels[:first])
        return start, start + sum(numels[first:stop])

    @property
    def total(self) -> int:
        return sum(self.numels)


def flatten_gradients(buffer: Tensor, parameters: Sequence[Tensor]) -> Tensor:
    """Copy the gradients of ``parameters`` end to end into ``buffer`` (no gradient: zeros)."""
    if sum(parameter.numel() for parameter in parameters) != buffer.numel():
        raise ValueError("the gradient buffer does not match the parameters' total size")
    offset = 0
    with torch.no_grad():
        for parameter in parameters:
            numel = parameter.numel()
            target = buffer[offset : offset + numel]
            if parameter.grad is None:
                target.zero_()
            else:
                target.copy_(parameter.grad.detach().reshape(-1))
            offset += numel
    return buffer


def copy_flat_to(flat: Tensor, tensors: Sequence[Tensor]) -> None:
    """Copy the flat vector ``flat`` back into ``tensors`` (their shapes, devices, in place)."""
    offset = 0
    with torch.no_grad():
        for tensor in tensors:
            numel = tensor.numel()
            tensor.copy_(flat[offset : offset + numel].view_as(tensor))
            offset += numel
