"""The stage transport on gloo processes: frames, and descriptions announced only on change."""

from __future__ import annotations

from typing import Any

import torch
from helpers.distributed import run_distributed

from lightning_parallel.pipeline.transport import StageTransport


def outputs() -> list[Any]:
    """Stage outputs in the order a pipeline might send them: repeated shapes, a smaller last
    micro-batch, evaluation (no grad), a tuple of mixed dtypes, tensors smaller than a header
    and one larger than it, an empty one."""
    generator = torch.Generator().manual_seed(3)
    full = torch.randn(4, 3, generator=generator)
    return [
        full.requires_grad_(True),
        torch.randn(4, 3, generator=generator).requires_grad_(True),
        torch.randn(2, 3, generator=generator).requires_grad_(True),
        torch.randn(4, 3, generator=generator),
        (
            torch.randn(2, 5, dtype=torch.float64, generator=generator).requires_grad_(True),
            torch.arange(3),
            torch.tensor(True),
            torch.randn(300, generator=generator).to(torch.bfloat16),
            torch.zeros(0, 7),
        ),
        torch.randn(4, 3, generator=generator).t().requires_grad_(True),  # not contiguous
    ]


def exchange(rank: int, world_size: int) -> Any:
    transport = StageTransport(rank, [0, 1])
    if rank == 0:
        counts = []
        for output in outputs():
            transport.send_activations(output)
            counts.append(len(transport.pending))
        transport.wait_sends()
        return counts
    return [transport.recv_activations()[0] for _ in outputs()]


def test_activations_arrive_as_sent_with_one_frame_per_unchanged_description() -> None:
    counts, received = run_distributed(exchange, 2)
    for sent, got in zip(outputs(), received):
        sent_tensors = sent if isinstance(sent, tuple) else (sent,)
        got_tensors = got if isinstance(got, tuple) else (got,)
        assert isinstance(got, tuple) == isinstance(sent, tuple)
        for expected, actual in zip(sent_tensors, got_tensors, strict=True):
            assert actual.dtype == expected.dtype and actual.shape == expected.shape
            assert actual.requires_grad == expected.requires_grad and actual.is_leaf
            torch.testing.assert_close(actual, expected.detach(), rtol=0, atol=0)
    # a header frame before the first output and wherever the description changed (shape,
    # requires_grad, tuple); a repeated description costs one frame
    assert counts == [2, 3, 5, 7, 9, 11]
