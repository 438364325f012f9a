"""Streaming rounds: the model cut into fragments of whole layers, synchronised at staggered steps.

Streaming DiLoCo (Douillard et al., "Streaming DiLoCo with overlapping communication",
arXiv 2501.18512) does not send the whole model once per round: it cuts the parameters into
``F`` fragments and synchronises fragment ``f`` every ``H`` steps at its own phase, so that a
round's traffic is one fragment and the link carries a steady trickle instead of one burst of
the model's size every ``H`` steps. Here:

1. **layers** are the modules that own trainable parameters directly (a ``Linear``'s weight and
   bias stay together), in ``module.named_modules()`` order;
2. the layers are cut into ``F`` contiguous fragments whose largest is as small as the cuts
   allow (by bytes): a layer larger than ``1/F`` of the model is a fragment of its own;
3. each floating-point buffer (BatchNorm statistics) goes with its module's parameters, or
   with the last parameters before it;
4. fragment ``f`` (0-based) ends a round at local step ``round((f + 1) · H / F)`` after the
   warm-up and every ``H`` steps after that: with ``H = 16, F = 4`` at 4, 8, 12, 16, 20, ...
   The last fragment keeps the unfragmented schedule's steps.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

__all__: list[str] = []


@dataclass(frozen=True)
class Fragment:
    """Which of a round's tensors a fragment holds, by position, and when it synchronises.

    Attributes:
        index: the fragment's number, ``0 … F − 1``.
        parameters: positions in the trainable parameters (``module.parameters()`` order).
        buffers: positions in the round's buffers (the floating-point buffers, in order).
        phase: local steps after the warm-up at which its first round ends (then every ``H``).
    """

    index: int
    parameters: tuple[int, ...]
    buffers: tuple[int, ...]
    phase: int


def _layers(module: nn.Module, trainable: Sequence[Tensor]) -> list[list[int]]:
    """Positions of ``trainable`` grouped by the module that owns them, in module order."""
    position = {id(parameter): index for index, parameter in enumerate(trainable)}
    layers, seen = [], set()
    for submodule in module.modules():
        owned = []
        for parameter in submodule.parameters(recurse=False):
            index = position.get(id(parameter))
            if index is not None and index not in seen:
                seen.add(index)
                owned.append(index)
        if owned:
            layers.append(owned)
    missing = [index for index in range(len(trainable)) if index not in seen]
    if missing:  # parameters not reachable as a module's own (should not happen): one layer
        layers.append(missing)
    return layers


def _cut(sizes: Sequence[int], count: int) -> list[int]:
    """Start indices of ``count`` contiguous groups of ``sizes`` whose largest sum is smallest."""

    def groups_needed(capacity: int) -> int:
        groups, total = 1, 0
        for size in sizes:
            if total + size > capacity:
                groups, total = groups + 1, 0
            total += size
        return groups

    low, high = max(sizes), sum(sizes)
    while low < high:  # the smallest capacity that needs at most ``count`` groups
        middle = (low + high) // 2
        if groups_needed(middle) <= count:
            high = middle
        else:
            low = middle + 1
    starts, total = [0], 0
    for index, size in enumerate(sizes):
        if total + size > low:
            starts.append(index)
            total = 0
        total += size
    # fewer groups than asked (a dominant layer): split the groups with most layers
    while len(starts) < count:
        bounds = [*starts, len(sizes)]
        widest = max(range(len(starts)), key=lambda g: bounds[g + 1] - bounds[g])
        if bounds[widest + 1] - bounds[widest] < 2:
            break
        starts.insert(widest + 1, (bounds[widest] + bounds[widest + 1]) // 2)
    return starts


def plan_fragments(
    module: nn.Module,
    trainable: Sequence[Tensor],
    buffers: Sequence[Tensor],
    count: int,
    period: int,
) -> list[Fragment]:
    """Cut ``module``'s ``trainable`` parameters and round ``buffers`` into ``count`` fragments.

    Args:
        module: the replica (its module tree gives the layers).
        trainable: the parameters a round averages, in order.
        buffers: the buffers a round averages, in order (may be empty).
        count: ``F``, at least 1, at most the number of layers and at most ``period``.
        period: ``H``, local steps between two rounds of the same fragment.
    """
    if isinstance(count, bool) or int(count) != count or count < 1:
        raise ValueError(f"fragments must be a positive integer, got {count!r}")
    if count > period:
        raise ValueError(
            f"fragments={count} needs period >= {count} (each fragment synchronises once per "
            f"period, at its own step); got period={period}"
        )
    layers = _layers(module, trainable)
    if count > max(1, len(layers)):
        raise ValueError(
            f"fragments={count} but the model has {len(layers)} layers with trainable "
            f"parameters; use fragments <= {len(layers)}"
        )
    sizes = [
        sum(trainable[i].numel() * trainable[i].element_size() for i in layer) for layer in layers
    ]
    starts = [*_cut(sizes, count), len(layers)] if layers else [0, 0]
    owner = {}  # parameter position -> fragment
    for fragment, (start, end) in enumerate(itertools.pairwise(starts)):
        for layer in layers[start:end]:
            for index in layer:
                owner[index] = fragment
    buffer_fragment = _buffer_owners(module, trainable, buffers, owner)
    return [
        Fragment(
            index=fragment,
            parameters=tuple(sorted(i for i, f in owner.items() if f == fragment)),
            buffers=tuple(i for i, f in enumerate(buffer_fragment) if f == fragment),
            phase=round((fragment + 1) * period / count),
        )
        for fragment in range(len(starts) - 1)
    ]


def _buffer_owners(
    module: nn.Module,
    trainable: Sequence[Tensor],
    buffers: Sequence[Tensor],
    owner: dict[int, int],
) -> list[int]:
    """The fragment of each buffer: its module's parameters', else the last one's before it."""
    position = {id(parameter): index for index, parameter in enumerate(trainable)}
    wanted = {id(buffer): index for index, buffer in enumerate(buffers)}
    result = [0] * len(buffers)
    current = 0
    for submodule in module.modules():
        own = [position[id(p)] for p in submodule.parameters(recurse=False) if id(p) in position]
        if own:
            current = owner[own[0]]
        for buffer in submodule.buffers(recurse=False):
            index = wanted.get(id(buffer))
            if index is not None:
                result[index] = current
    return result


def fragment_bytes(fragment: Fragment, trainable: Sequence[Tensor]) -> int:
    """Bytes of ``fragment``'s parameters."""
    return sum(trainable[i].numel() * trainable[i].element_size() for i in fragment.parameters)


def due_fragments(fragments: Sequence[Fragment], local_step: int, period: int) -> list[int]:
    """The fragments whose round ends at ``local_step`` (steps counted after the warm-up)."""
    return [
        fragment.index
        for fragment in fragments
        if local_step >= fragment.phase and (local_step - fragment.phase) % period == 0
    ]


def flat_delta(tensors: Sequence[Tensor], anchor: Sequence[Tensor]) -> Tensor:
    """``tensors − anchor``, flattened into one float32 buffer (the outer delta a round sends)."""
    return torch.cat(
        [(t.detach().float() - a.float()).reshape(-1) for t, a in zip(tensors, anchor, strict=True)]
    )
