"""Predict ``parameter_server``: asynchronous workers and one server shard (the default).

The shard runs on rank 0's host, in a thread of rank 0's process, and applies every worker's
gradient with the user's optimizer. An exchange's work (``apply_s``) is what the profile
measured of one in-process exchange with the real shard
(:func:`~lightning_parallel.plan.measure.parameter_server_exchange_seconds`: the gradients
flattened, applied, the version's snapshot, the weights copied back), else the optimizer's
step alone. Per step:

- the worker on the server's host hands its request over in-process: its step is the local
  step plus the shard's work for its own gradient, and the shard's work for the other workers'
  gradients takes the same core (``W − 1`` remote workers, each at its own rate);
- a remote worker sends its gradient (``P`` bytes) and waits for the fresh weights (``P``
  bytes back): its step is the local step, the two transfers, and the shard's work on its
  gradient.

The server's uplink carries every remote worker's pull, so the remote workers together pull
at most one model at a time: a remote step is at least ``(W − K)`` pulls long (``K`` workers
on the server's host). A straggler (``straggler_factor``) slows only its own steps.

The workers do not wait for each other, so each runs at its own rate: steps of rank ``r`` are
a share ``rate_r / Σ rate`` of all steps, and the bench's median is taken over that mix. The
bench counts bytes per step of rank 0 and averages its hosts: all hosts together send the
remote workers' pushes and the server's replies, ``P`` each. In the steady state that is
``2P`` for each remote step; for a run of a given length the counts come from the run
simulated exchange by exchange (:mod:`~lightning_parallel.plan.parameter_server_run`): a
remote exchange on a slow link can outlast the fast worker's whole run, and the end of each
epoch adds replies (measured: 20 steps of ``vgg_mini`` at 100 Mbit/s, 2 gradients and 3
replies, where the rates alone gave 1.2 of each). The same simulation gives the run's samples
per second: each worker's trained batches over its own clock, the waits at the epochs' drains
for a slow remote exchange included.

The gradient arrives on the server's host while its worker computes. Where that host has no
core to spare, the threads that read it wait for the computation's time slice: the link
probe's ``busy_receive`` (:func:`~lightning_parallel.plan.link_probe.busy_receive_extra`) is
added to every push. Traced on ``gpt`` at 1 Gbit/s (2 hosts of one core), the gradient's
receipt took 2.7 to 10.5 ms, median 5.1, where the same bytes between idle hosts take 2.75;
the probe measured 2.0 to 3.9 ms of extra on these hosts at 1 Gbit/s and 100 Mbit/s.

On the bench's shaped hosts each direction of a remote worker's link idles between its
exchanges, so each vector passes the token bucket's burst at once: ``gpt`` at 10 Mbit/s
exchanged in 0.845 s where the two vectors' bytes take 0.919 s at the link's rate, and without
the burst the simulated run held 11 remote gradients where the traced one held 14 (13 with
it).
"""

from __future__ import annotations

from typing import Any

from lightning_parallel.plan.memory import (
    EXTRA_PARAMETER_COPIES,
    model_state_bytes,
    peak_rss_mb,
)
from lightning_parallel.plan.network import Cluster, send
from lightning_parallel.plan.parameter_server_run import WorkerTimes, simulate_run
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
    straggler = float(options.get("straggler_factor", 1.0))
    near = cluster.processes_per_host  # workers on the server's host: no inter-host link
    remote = cluster.world - near
    push = send(cluster, profile.parameter_bytes)
    pull = send(cluster, profile.parameter_bytes)
    exchange = profile.hook_s("parameter_server")
    apply_s = profile.optimizer_s if exchange is None else exchange
    local = profile.step_s - profile.optimizer_s  # the worker's own optimizer does not run
    # a shaper's token bucket refilled while its direction idled passes its burst at once: a
    # worker's uplink idles while it waits for its reply and computes, the server's while the
    # remote workers compute and push (gpt at 10 Mbit/s: 0.845 s an exchange where the
    # vectors' bytes take 0.919 s at the link's rate)
    push_s = _after_burst(cluster, push.seconds, pull.seconds + local)
    # the gradient arrives on the server's host while its worker computes: the receiving
    # threads wait for a time slice where the host has no core to spare (the probe's figure)
    push_s += cluster.inter.busy_receive if cluster.hosts > 1 else 0.0
    pull_s = _after_burst(cluster, pull.seconds, local + push.seconds - (remote - 1) * pull.seconds)
    # a remote worker: its step, the two transfers, the shard's work on its gradient; the
    # server's uplink carries every remote worker's pull: at most one pull at a time
    remote_step = max(
        local + push_s + pull_s + apply_s,
        remote * (pull.seconds - cluster.inter.latency),
    )
    slow_step = max(remote_step, local * straggler + push_s + pull_s + apply_s)
    stragglers = 1 if straggler > 1.0 and remote > 0 else 0
    rate_others = (
        (remote - stragglers) / remote_step
        + stragglers / slow_step
        + (near - 1) / (local + apply_s)
    )
    # the shard's thread shares the server worker's core: its work for the others' gradients
    # slows that worker's steps
    busy = min(0.9, apply_s * rate_others)
    server_step = (local + apply_s) / (1.0 - busy)
    rate_server = 1.0 / server_step
    shares = [
        (server_step, rate_server),
        (local + apply_s, (near - 1) / (local + apply_s)),
        (remote_step, (remote - stragglers) / remote_step),
        (slow_step, stragglers / slow_step),
    ]
    total = sum(rate for _, rate in shares)
    steps = [(seconds, rate / total) for seconds, rate in shares if rate > 0]
    samples_per_s = profile.batch_size * total
    # the bench counts bytes per step of rank 0 (the server's worker)
    remote_rate = total - rate_server - (near - 1) / (local + apply_s)
    pushes = replies = remote_rate / rate_server
    if run.steps:
        # the run exchange by exchange (plan.parameter_server_run): the server's host's workers
        # answered in-process, the remote ones over the link, each remote step as long as the
        # steady law above says

        def over_link(compute: float, whole: float) -> WorkerTimes:
            reply = max(apply_s + pull_s, whole - compute - push_s)
            latency = cluster.inter.latency
            # an epoch's BEGIN finds the server's uplink idle: its reply passes a full burst
            begin = _after_burst(cluster, pull.seconds, float("inf"))
            return WorkerTimes(compute, push_s, reply, latency, begin)

        workers = [
            WorkerTimes(server_step),
            *[WorkerTimes(local + apply_s)] * (near - 1),
            *[over_link(local * straggler, slow_step)] * stragglers,
            *[over_link(local, remote_step)] * (remote - stragglers),
        ]
        counts = simulate_run(workers, run.epoch_steps, run.steps * cluster.world)
        rank0 = max(1, counts.steps[0])
        pushes = sum(counts.pushes[near:]) / rank0
        replies = sum(counts.replies[near:]) / rank0
        # the rate over the run: a worker that waits for a slow remote one at each epoch's
        # drain trains fewer samples a second than its steady steps say (measured: vgg16 at
        # 10 Mbit/s, 401 samples/s where the steady rates gave 878)
        samples_per_s = counts.samples_per_s(profile.batch_size, run.warmup_steps) or samples_per_s
    hosts = cluster.hosts
    wire = (pull.wire_bytes * replies + push.wire_bytes * pushes) / hosts if hosts > 1 else 0.0
    payload = (
        (pull.payload_bytes * replies + push.payload_bytes * pushes) / hosts if hosts > 1 else 0.0
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
        samples_per_s=samples_per_s,
        detail={
            "server_worker_step_s": server_step,
            "remote_worker_step_s": remote_step,
            "straggler_step_s": slow_step if stragglers else None,
            "state_bytes": model_state_bytes(profile),
            "remote_pushes_per_step": pushes,
            "remote_replies_per_step": replies,
            **({"note": note} if note else {}),
        },
    )


def _after_burst(cluster: Cluster, seconds: float, idle_s: float) -> float:
    """A transfer's ``seconds`` less what the link's token bucket, refilled for ``idle_s``,
    lets through at once; never less than the link's latency."""
    credit = cluster.inter.burst_seconds(idle_s) if cluster.hosts > 1 else 0.0
    return max(cluster.inter.latency, seconds - credit)
