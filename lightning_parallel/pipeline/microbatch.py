"""Split a mini-batch of any structure into micro-batches along dimension 0, and merge back.

A batch is a tree of tensors inside tuples, lists, dicts and named tuples; leaves that are not
tensors (strings, numbers, ``None``) are copied into every micro-batch unchanged. Every tensor
leaf must have the same size ``N`` along dimension 0; micro-batch ``j`` of ``m`` holds rows
``torch.tensor_split(range(N), m)[j]``, so sizes differ by at most one and the micro-batches
concatenate back to the batch exactly.

:class:`MicroBatchStep` is one training step's batch as micro-batches, the way every pipeline
engine's step keeps it: each micro-batch's weight ``n_j/N`` in the step's loss, and what the
user's ``training_step`` returned on each.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

__all__: list[str] = []


def _tensor_leaves(tree: Any) -> list[torch.Tensor]:
    if isinstance(tree, torch.Tensor):
        return [tree]
    if isinstance(tree, Mapping):
        return [leaf for value in tree.values() for leaf in _tensor_leaves(value)]
    if isinstance(tree, (list, tuple)):
        return [leaf for value in tree for leaf in _tensor_leaves(value)]
    return []


def batch_size(batch: Any) -> int:
    """Size along dimension 0 shared by every tensor of ``batch``.

    Raises:
        ValueError: the batch holds no tensor, a 0-dimensional tensor, or tensors whose first
            dimensions differ.
    """
    leaves = _tensor_leaves(batch)
    if not leaves:
        raise ValueError(
            "the batch holds no tensor to split into micro-batches; return tensors (in tuples, "
            "lists or dicts) from the dataloader"
        )
    sizes = {tuple(leaf.shape[:1]) for leaf in leaves}
    if () in sizes:
        raise ValueError(
            "a 0-dimensional tensor in the batch cannot be split into micro-batches; give every "
            "tensor a leading batch dimension"
        )
    if len(sizes) != 1:
        raise ValueError(
            f"tensors of the batch differ in their first dimension {sorted(s[0] for s in sizes)}; "
            "micro-batching splits every tensor along dimension 0, so they must agree"
        )
    return int(leaves[0].shape[0])


def _rebuild(template: Any, values: Sequence[Any]) -> Any:
    if isinstance(template, tuple) and hasattr(template, "_fields"):  # a named tuple
        return type(template)(*values)
    return type(template)(values)


def _split(tree: Any, chunks: int) -> list[Any]:
    if isinstance(tree, torch.Tensor):
        return list(torch.tensor_split(tree, chunks, dim=0))
    if isinstance(tree, Mapping):
        parts = {key: _split(value, chunks) for key, value in tree.items()}
        return [type(tree)({key: parts[key][j] for key in tree}) for j in range(chunks)]  # type: ignore[call-arg]
    if isinstance(tree, (list, tuple)):
        parts_list = [_split(value, chunks) for value in tree]
        return [_rebuild(tree, [part[j] for part in parts_list]) for j in range(chunks)]
    return [tree] * chunks


def split_microbatches(batch: Any, chunks: int) -> list[Any]:
    """Split ``batch`` into ``min(chunks, N)`` micro-batches along dimension 0.

    A batch smaller than ``chunks`` (the last batch of an epoch) gives one micro-batch per
    sample rather than empty ones.

    Args:
        batch: tensors nested in tuples, lists, named tuples and dicts.
        chunks: number of micro-batches wanted; at least 1.

    Returns:
        The micro-batches, each with the structure of ``batch``.
    """
    if chunks < 1:
        raise ValueError(f"chunks must be at least 1, got {chunks}")
    size = batch_size(batch)
    return _split(batch, min(chunks, size))


def microbatch_sizes(batch: Any, chunks: int) -> list[int]:
    """Sizes along dimension 0 of the micro-batches :func:`split_microbatches` returns."""
    size = batch_size(batch)
    count = min(chunks, size)
    return [len(part) for part in torch.tensor_split(torch.arange(size), count)]


def merge_microbatches(parts: Sequence[Any]) -> Any:
    """Concatenate micro-batches (or per-micro-batch outputs) back into one batch.

    Tensors are concatenated along dimension 0 (0-dimensional tensors are stacked); other
    leaves are taken from the first micro-batch.
    """
    if not parts:
        raise ValueError("merge_microbatches needs at least one micro-batch")
    first = parts[0]
    if isinstance(first, torch.Tensor):
        if first.dim() == 0:
            return torch.stack(list(parts))
        return torch.cat(list(parts), dim=0)
    if isinstance(first, Mapping):
        return type(first)({key: merge_microbatches([p[key] for p in parts]) for key in first})  # type: ignore[call-arg]
    if isinstance(first, (list, tuple)):
        return _rebuild(
            first, [merge_microbatches([p[i] for p in parts]) for i in range(len(first))]
        )
    return first


@dataclass
class MicroBatchStep:
    """One training step's micro-batches and the user's results on them.

    Args:
        batch: the whole batch.
        micro: its micro-batches (:func:`split_microbatches`).
        hook_args: what Lightning passed the step after the batch (``batch_idx``).
        sizes: each micro-batch's size ``n_j``.
        total: the batch's size ``N``.
        results: what the user's ``training_step`` returned, by micro-batch.
    """

    batch: Any
    micro: list[Any]
    hook_args: tuple[Any, ...]
    sizes: list[int]
    total: int
    results: dict[int, Any] = field(default_factory=dict)

    @classmethod
    def split(cls, batch: Any, hook_args: tuple[Any, ...], chunks: int) -> MicroBatchStep:
        """``batch`` split into ``min(chunks, N)`` micro-batches."""
        micro = split_microbatches(batch, chunks)
        sizes = [batch_size(part) for part in micro]
        return cls(batch, micro, hook_args, sizes, sum(sizes))

    @property
    def count(self) -> int:
        """The number of micro-batches."""
        return len(self.micro)

    def weight(self, index: int) -> float:
        """Micro-batch ``index``'s share ``n_j/N`` of the batch."""
        return self.sizes[index] / self.total

    def loss_of(self, index: int, result: Any, strategy: str) -> torch.Tensor:
        """Keep micro-batch ``index``'s ``result`` and return its loss (the tensor, or the
        ``"loss"`` of a dict); ``strategy`` names the strategy in the error.

        Raises:
            ValueError: no loss tensor (a skipped step, which a pipeline cannot skip).
        """
        self.results[index] = result
        loss = result.get("loss") if isinstance(result, dict) else result
        if not isinstance(loss, torch.Tensor):
            raise ValueError(
                "training_step must return the loss tensor (or a dict with 'loss') for every "
                f"micro-batch under {strategy}; skipping a step is not supported"
            )
        return loss

    def output(self, loss: torch.Tensor) -> Any:
        """What the step returns to Lightning: the step's ``loss``, with the other keys of the
        last micro-batch's result when it is a dict."""
        last = self.results.get(self.count - 1)
        if isinstance(last, dict):
            return {**{k: v for k, v in last.items() if k != "loss"}, "loss": loss}
        return loss
