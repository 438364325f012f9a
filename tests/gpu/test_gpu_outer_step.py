"""DiLoCo's capped outer step on CUDA equals the CPU's (``pytest -m gpu``).

On CUDA, torch's SGD defaults to its foreach path, which writes ``g + μ·buf`` into ``.grad``
while it steps; the cap must measure ``g`` itself (the pseudo-gradient), not what the optimizer
left in ``.grad``. The test runs the default DiLoCo outer optimizer (Nesterov, lr 0.7, μ 0.5)
with the default cap for several rounds of pseudo-gradients that turn, on the CPU (single-tensor
path) and on CUDA (foreach, which torch's own selection function picks there), and asks for the same global models and the same count of
capped rounds. It runs in a spawned process, so that the pytest process never initialises CUDA.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from helpers.distributed import run_distributed

from lightning_parallel.averaging.outer_optimizer import (
    OuterOptimizerAverager,
    diloco_outer_optimizer,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA is not available"),
]

ROUNDS = 6


def _rounds(device: torch.device) -> dict[str, Any]:
    """Six outer rounds on ``device``: the global models after each, and the capped count."""
    generator = torch.Generator().manual_seed(0)
    shapes = [(64, 32), (32,), (10, 64)]
    averager = OuterOptimizerAverager(diloco_outer_optimizer(), step_cap=1.0)
    start = [torch.randn(shape, generator=generator).to(device) for shape in shapes]
    averager.reset(start, world_size=2)
    history = []
    for index in range(ROUNDS):
        # the workers' progress turns every other round, so the momentum bends the step
        sign = 1.0 if index % 2 == 0 else -0.5
        progress = [sign * torch.randn(shape, generator=generator).to(device) for shape in shapes]
        mean = [base + moved for base, moved in zip(start, progress, strict=True)]
        start = [tensor.clone() for tensor in averager.update(start, mean)]
        history.append([tensor.cpu() for tensor in start])
    assert averager.optimizer is not None
    group = averager.optimizer.param_groups[0]
    foreach = group.get("foreach")
    if foreach is None and device.type == "cuda":  # torch's default: foreach on CUDA tensors
        from torch.optim.optimizer import _default_to_fused_or_foreach

        _, foreach = _default_to_fused_or_foreach(group["params"], False, False)
    return {"history": history, "capped": averager.capped_rounds, "foreach": bool(foreach)}


def _run(rank: int, world_size: int) -> dict[str, Any]:
    return {"cpu": _rounds(torch.device("cpu")), "cuda": _rounds(torch.device("cuda", 0))}


def test_gpu_capped_outer_step_equals_the_cpu_result() -> None:
    result = run_distributed(_run, 1, start_method="spawn", init_group=False, timeout=300.0)[0]
    cpu, cuda = result["cpu"], result["cuda"]
    assert cuda["foreach"], "the CUDA run did not take torch's foreach path"
    assert cpu["capped"] == cuda["capped"] > 0
    for on_cpu, on_cuda in zip(cpu["history"], cuda["history"], strict=True):
        for a, b in zip(on_cpu, on_cuda, strict=True):
            torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
