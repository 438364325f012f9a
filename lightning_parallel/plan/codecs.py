"""Time the gradient codecs and communication hooks a plan predicts, in one process.

Two ways of doing the same low-rank arithmetic cost very different time on a CPU, so each
codec is timed the way its implementation does it:

1. **torch's PowerSGD hook** (``ddp_powersgd``): its cost is more than its matrix products:
   per bucket it copies the uncompressed tensors into one buffer, keeps error feedback and
   warm-start factors per tensor, and orthogonalizes each ``P`` (Gram-Schmidt for rank <= 2),
   a Python loop over the bucket's tensors. :func:`comm_hook_seconds` measures the whole of it:
   the hook registered on torch's ``DistributedDataParallel`` in a world of one process (its
   allreduces then move nothing) against the same wrapper without it, step for step, on a
   few samples (the hook's work does not depend on the batch). On ``resnet18`` (61 small
   tensors) it measured 10-20 ms a step (4 and 32 samples, the machine idle), several times
   the products alone.
2. **Hylo's low-rank route**
   (:mod:`~lightning_parallel.compression.exchange_low_rank`): ``M = g + e`` and ``P = M Q``
   block of rows by block of rows, ``P = orthonormalize(P)``, ``Q = (P^T M)^T`` (not the
   transposed read ``M^T P``), then ``P Q^T`` and the residual per block.
   :func:`blocked_low_rank_seconds` times that order; on ``vgg_mini``'s 4096 x 2048 layer at
   rank 8 it took 51 ms where the plain order (:func:`low_rank_seconds`) took 203 ms (one
   timing each, the machine shared with a bench).

Each timing is the median of ``repeats`` runs after one warm-up.
"""

from __future__ import annotations

import copy
import statistics
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from lightning_parallel.compression.low_rank import matrix_shape, orthonormalize, row_blocks
from lightning_parallel.pipeline.microbatch import batch_size, split_microbatches
from lightning_parallel.pipeline.patching import patched
from lightning_parallel.pipeline.profile import clock
from lightning_parallel.plan.profile import BLOCKED, PLAIN, ParameterShape, codec_key

__all__: list[str] = []


def low_rank_seconds(
    shape: Sequence[int], rank: int, repeats: int = 3, device: torch.device | None = None
) -> float:
    """One low-rank round trip of a gradient of ``shape`` at ``rank`` in the plain order of
    the products (torch's PowerSGD): ``M = g + e``, ``P = M Q``, orthonormalize ``P``,
    ``Q = M^T P``, ``P Q^T`` and the residual ``M - P Q^T``."""
    rows, cols = matrix_shape(tuple(shape))
    r = max(1, min(rank, rows, cols))
    grad, error = torch.randn(rows, cols, device=device), torch.zeros(rows, cols, device=device)
    q = torch.randn(cols, r, device=device)
    samples = []
    for index in range(repeats + 1):
        start = clock()
        matrix = grad + error
        p = torch.linalg.qr(matrix @ q).Q
        q = matrix.T @ p
        error = matrix - p @ q.T
        if index:
            samples.append(clock() - start)
    return float(statistics.median(samples))


def blocked_low_rank_seconds(
    shape: Sequence[int], rank: int, repeats: int = 3, device: torch.device | None = None
) -> float:
    """One low-rank round trip in Hylo's order (see the module docstring): the residual
    storage is compensated and projected block of rows by block of rows, ``Q = (P^T M)^T``,
    and the estimate and residual written back per block."""
    rows, cols = matrix_shape(tuple(shape))
    r = max(1, min(rank, rows, cols))
    gradient = torch.randn(rows, cols, device=device)
    residual = torch.zeros(rows, cols, device=device)
    estimate = torch.empty(rows, cols, device=device)
    q = torch.randn(cols, r, device=device)
    blocks = row_blocks(rows, cols, gradient.element_size(), gradient.device)
    samples = []
    for index in range(repeats + 1):
        start = clock()
        q_t = q.t().contiguous()
        p_t = torch.empty(r, rows, device=device)
        for block in blocks:
            part = residual[block]
            part.add_(gradient[block])
            torch.mm(q_t, part.t(), out=p_t[:, block])
        p = orthonormalize(p_t.t())
        q = (p.t() @ residual).t()
        q_t = q.t().contiguous()
        for block in blocks:
            torch.mm(p[block], q_t, out=estimate[block])
            residual[block].sub_(estimate[block])
        if index:
            samples.append(clock() - start)
    return float(statistics.median(samples))


def codec_timings(
    parameters: Sequence[ParameterShape],
    ranks: Sequence[int] = (2, 8),
    device: torch.device | None = None,
) -> dict[str, float]:
    """Every distinct matrix shape among ``parameters`` (two or more dimensions) at each of
    ``ranks`` (PowerSGD's default 2, Hylo's 8), in both orders (keys:
    :func:`~lightning_parallel.plan.profile.codec_key`), on ``device`` (default: the CPU)."""
    timers = {PLAIN: low_rank_seconds, BLOCKED: blocked_low_rank_seconds}
    timings: dict[str, float] = {}
    for parameter in parameters:
        if len(parameter.shape) < 2:
            continue
        for rank in ranks:
            for order, timer in timers.items():
                key = codec_key(parameter.shape, rank, order)
                if key not in timings:
                    timings[key] = timer(parameter.shape, rank, device=device)
    return timings


class _TrainingStep(nn.Module):
    """``training_step(batch, 0)``'s loss as a forward, for torch's DDP wrapper."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, batch: Any) -> torch.Tensor:
        from lightning_parallel.plan.measure import loss_of

        return loss_of(self.module.training_step(batch, 0))  # type: ignore[operator]


def comm_hook_seconds(
    module: nn.Module,
    batch: Any,
    hook: Callable[..., Any],
    state: Any,
    *,
    samples: int = 4,
    warmup: int = 3,
    repeats: int = 5,
) -> float | None:
    """Seconds a DDP communication ``hook`` adds to a forward and backward: the fastest of
    ``repeats`` steps with it minus the fastest of as many without, each on a copy of
    ``module`` wrapped in torch's ``DistributedDataParallel`` in the default process group, on
    the batch's first ``samples`` samples, after ``warmup`` steps of each (PowerSGD compresses
    from its third step). The two fastest, not the median of the differences: another
    process's burst delays one step of a pair and counts as the hook's (the sleeping test
    model, profiled during a loaded test run: 0.666 s a step predicted, 0.621 s measured, the
    hook adding 7 ms to ``ddp``'s). ``None`` without a process group or where DDP cannot wrap
    the module."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    pieces = max(1, batch_size(batch) // max(1, samples))
    small = split_microbatches(batch, pieces)[0]
    plain = DistributedDataParallel(_TrainingStep(copy.deepcopy(module)))
    hooked = DistributedDataParallel(_TrainingStep(copy.deepcopy(module)))
    hooked.register_comm_hook(state, hook)

    def step(wrapped: DistributedDataParallel) -> float:
        inner = wrapped.module.module
        with (
            patched(inner, "log", lambda *a, **k: None),
            patched(inner, "log_dict", lambda *a, **k: None),
        ):
            start = clock()
            wrapped(small).backward()
            seconds = clock() - start
        wrapped.zero_grad(set_to_none=True)
        return seconds

    try:
        for _ in range(warmup):
            step(plain), step(hooked)
        pairs = [(step(hooked), step(plain)) for _ in range(repeats)]
    except RuntimeError:  # unused parameters, or a module DDP cannot run
        return None
    return max(0.0, min(pair[0] for pair in pairs) - min(pair[1] for pair in pairs))
