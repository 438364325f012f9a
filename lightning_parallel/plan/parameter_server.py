"""Predict ``parameter_server``: asynchronous workers and one server shard (the default).

The shard runs on rank 0's host, in a thread of rank 0's process, and applies every worker's
gradient with the user's optimizer (``optimizer_s`` of the profile a gradient). Per step:

- the worker on the server's host hands its request over in-process: its step is the local
  step plus the shard's work for its own gradient, and the shard's work for the other workers'
  gradients takes the same core (``W − 1`` remote workers, each at its own rate);
- a remote worker sends its gradient (``P`` bytes) and waits for the fresh weights (``P``
  bytes back): its step is the local step, the two transfers, and the shard's work on its
  gradient.

The workers do not wait for each other, so each runs at its own rate: steps of rank ``r`` are
a share ``rate_r / Σ rate`` of all steps, and the bench's median is taken over that mix. The
bench counts bytes per step of rank 0: a remote host sends ``P·rate_remote/rate_0`` and the
server's host ``(W − 1)·P·rate_remote/rate_0`` per rank-0 step. The rates are solved by a few
rounds of fixed-point iteration (the server's core is shared).
"""

from __future__ import annotations

from typing import Any

from lightning_parallel.plan.memory import (
    EXTRA_PARAMETER_COPIES,
    model_state_bytes,
    peak_rss_mb,
)
from lightning_parallel.plan.network import Cluster, send
from lightning_parallel.plan.prediction import (
    STEADY,
    Prediction,
    RunLength,
    mean_of_steps,
    median_of_steps,
)
from lightning_parallel.plan.profile import StepProfile

__all__: list[str] = []


def predict_parameter_server(
    spec: str,
    profile: StepProfile,
    cluster: Cluster,
    options: dict[str, Any],
    run: RunLength = STEADY,
) -> Prediction:
    """``parameter_server`` with one shard (see the module docstring)."""
    shards = int(options.get("shards", 1) or 1)
    # more shards spread the server over hosts: not modelled yet
    note = f"shards={shards} predicted as one shard" if shards != 1 else ""
    world = cluster.world
    remote = world - 1
    push = send(cluster, profile.parameter_bytes)
    pull = send(cluster, profile.parameter_bytes)
    apply_s = profile.optimizer_s
    local = profile.step_s - profile.optimizer_s  # the worker's own optimizer does not run
    remote_step = local + push.seconds + pull.seconds + apply_s
    server_step = local + apply_s
    for _ in range(20):
        # the shard's work for the remote workers' gradients, per step of rank 0
        ratio = server_step / remote_step
        server_step = local + apply_s * (1.0 + remote * ratio)
    rate_server, rate_remote = 1.0 / server_step, 1.0 / remote_step
    total = rate_server + remote * rate_remote
    steps = [(server_step, rate_server / total), (remote_step, remote * rate_remote / total)]
    per_rank0_step = rate_remote / rate_server
    remote_wire = push.wire_bytes * per_rank0_step
    server_wire = remote * pull.wire_bytes * per_rank0_step
    hosts = cluster.hosts
    wire = (server_wire + (hosts - 1) * remote_wire) / hosts if hosts > 1 else 0.0
    payload = (
        (remote * pull.payload_bytes + (hosts - 1) * push.payload_bytes) * per_rank0_step / hosts
        if hosts > 1
        else 0.0
    )
    mean = mean_of_steps(steps)
    extra = EXTRA_PARAMETER_COPIES["parameter_server"] * profile.parameter_bytes
    return Prediction(
        spec=spec,
        family="parameter_server",
        step_s=median_of_steps(steps),
        mean_step_s=mean,
        compute_s=local + apply_s,
        exposed_comm_s=max(0.0, mean - local - apply_s),
        bubble_s=0.0,
        wire_bytes_per_step=wire,
        payload_bytes_per_step=payload,
        peak_rss_mb=peak_rss_mb(profile, extra),
        samples_per_s=profile.batch_size * (rate_server + remote * rate_remote),
        detail={
            "server_worker_step_s": server_step,
            "remote_worker_step_s": remote_step,
            "state_bytes": model_state_bytes(profile),
            **({"note": note} if note else {}),
        },
    )
