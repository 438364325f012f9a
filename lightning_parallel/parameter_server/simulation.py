"""Deterministic simulation: the real server, simulated workers, seeded compute times.

Real asynchronous runs depend on the machine's timing, so their staleness sequence cannot be
repeated. :func:`simulate` drives the same :class:`ShardServer` (same policies, same
optimizer) with workers whose compute times come from a seeded generator, in simulated time:

1. every worker begins: it reads the weights and starts computing;
2. the worker whose computation ends first (ties: lowest rank) computes its gradient on the
   weights it read and sends it; the replies due wake the workers they answer, each of which
   reads its weights and starts its next computation, of duration speed × (1 + jitter·u),
   u ~ U[0, 1) from ``random.Random(seed)``;
3. after ``gradients`` gradients in all, every worker drains.

The same arguments give the same staleness sequence, bit for bit; tests use it to check the
policies' invariants over many schedules in milliseconds.

Example::

    result = simulate(UpdatePolicy(max_staleness=2), workers=4, gradients=200, seed=7)
    assert max(result.staleness) <= 2
"""

from __future__ import annotations

import heapq
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor
from torch.optim import SGD, Optimizer

from lightning_parallel.parameter_server.policies import UpdatePolicy
from lightning_parallel.parameter_server.protocol import (
    Reply,
    ReplyKind,
    Request,
    RequestFlag,
    RequestKind,
)
from lightning_parallel.parameter_server.server import ShardServer, WorkerStatus

__all__: list[str] = []

GradientFunction = Callable[[Tensor, int, int], Tensor]


@dataclass
class SimulationResult:
    """What a simulated run produced.

    Attributes:
        workers: worker of each gradient, in the order the server consumed them.
        staleness: staleness of each gradient, same order.
        groups: gradients per update, in order.
        weights: the server's final weights.
        version: the server's final version (number of updates).
        finish_time: simulated time when the last worker drained.
    """

    workers: list[int]
    staleness: list[int]
    groups: list[int]
    weights: Tensor
    version: int
    finish_time: float


def quadratic_gradients(dimension: int, workers: int, seed: int) -> GradientFunction:
    """Gradient of ½‖w − c_k‖² for worker k, centres c_k drawn from ``seed``."""
    generator = torch.Generator().manual_seed(seed)
    centres = torch.randn(workers, dimension, generator=generator, dtype=torch.float64)

    def gradient(weights: Tensor, worker: int, step: int) -> Tensor:
        return weights - centres[worker]

    return gradient


def simulate(
    policy: UpdatePolicy,
    *,
    workers: int = 3,
    gradients: int = 60,
    seed: int = 0,
    speeds: Sequence[float] | None = None,
    jitter: float = 0.5,
    dimension: int = 4,
    gradient_function: GradientFunction | None = None,
    make_optimizer: Callable[[list[Tensor]], Optimizer] | None = None,
    initial: Tensor | None = None,
) -> SimulationResult:
    """Run ``workers`` simulated workers against one server shard; see the module docstring.

    Args:
        policy: the server's update rules.
        workers: number of workers (ranks 0 .. workers-1).
        gradients: gradients computed in all before the workers drain.
        seed: seed of the compute times.
        speeds: mean compute time of each worker (default 1.0 each; 3.0 = three times slower).
        jitter: relative spread of compute times (0: every step takes exactly its speed).
        dimension: size of the weight vector (when ``initial`` is not given).
        gradient_function: ``(weights read, worker, step) -> gradient`` (default: a quadratic
            per worker, :func:`quadratic_gradients`).
        make_optimizer: the server's optimizer (default plain SGD, learning rate 0.1).
        initial: initial weights (default zeros, float64).
    """
    if workers < 1 or gradients < 0:
        raise ValueError("need workers >= 1 and gradients >= 0")
    speeds = list(speeds) if speeds is not None else [1.0] * workers
    if len(speeds) != workers or min(speeds) <= 0:
        raise ValueError(f"speeds needs {workers} positive values, got {speeds}")
    weights = (
        initial.clone() if initial is not None else torch.zeros(dimension, dtype=torch.float64)
    )
    gradient_function = gradient_function or quadratic_gradients(weights.numel(), workers, seed)
    make_optimizer = make_optimizer or (lambda params: SGD(params, lr=0.1))
    server = ShardServer([weights], make_optimizer, policy, range(workers))
    server.statistics.keep_trace = True
    rng = random.Random(seed)
    clock = 0.0
    queue: list[tuple[float, int]] = []
    read: dict[int, Tensor] = {}
    read_version: dict[int, int] = {}
    steps = [0] * workers
    remaining = gradients

    def wake(replies: list[Reply]) -> None:
        nonlocal remaining
        for reply in replies:
            if reply.kind == ReplyKind.ABORT:
                raise RuntimeError(f"simulated run aborted: {reply.reason}")
            read[reply.worker] = reply.weights.clone()
            read_version[reply.worker] = reply.version
            if remaining > 0:
                remaining -= 1
                duration = speeds[reply.worker] * (1.0 + jitter * rng.random())
                heapq.heappush(queue, (clock + duration, reply.worker))
            elif server.status(reply.worker) != WorkerStatus.IDLE:
                wake(
                    server.handle(Request(RequestKind.STEP, reply.worker, flags=RequestFlag.DRAIN))
                )

    for worker in range(workers):
        wake(server.handle(Request(RequestKind.BEGIN, worker)))
    while queue:
        clock, worker = heapq.heappop(queue)
        gradient = gradient_function(read[worker], worker, steps[worker]).reshape(-1)
        steps[worker] += 1
        request = Request(
            RequestKind.STEP,
            worker,
            read_version[worker],
            RequestFlag.HAS_GRADIENT,
            gradient=gradient.to(server.weights.dtype),
        )
        wake(server.handle(request))
    trace = server.statistics.trace
    return SimulationResult(
        workers=[worker for worker, _ in trace],
        staleness=[staleness for _, staleness in trace],
        groups=list(server.statistics.groups),
        weights=server.weights.clone(),
        version=server.version,
        finish_time=clock,
    )
