"""Predict the pipelines: ``gropipe`` (flushing, micro-batches) and ``spectrain`` (no flush).

Both take the layer profile of the chain the pipeline splits (at the micro-batch size they
run) and the partitioner's own split (:func:`~lightning_parallel.pipeline.partition.partition`,
with the link's measured seconds per byte, as the strategies call it), so the stages are the
ones training will use. ``W / p`` pipelines of ``p`` stages train side by side; a pipeline's
stages sit on one host when it has ``p`` processes (the intra-host link between them), else on
``p`` hosts.

**GroPipe** (``m`` micro-batches, 1F1B or GPipe; the split chosen with the transfers charged,
as the strategy chooses it): the step's schedule is replayed operation by operation
(:mod:`~lightning_parallel.plan.pipeline_timing`): each stage's forward and backward of a
micro-batch, a message between stages sent once its receive is posted, at the link's
point-to-point latency (:attr:`~lightning_parallel.plan.network.Link.point_latency`) and
through the shaper's token bucket where there is one, and the deferred weight gradients after
a stage's last backward. The step then adds each stage's optimizer step on its share of the
parameters (the slowest), the trainer's time, and the end-of-step summary (a small all-reduce
in the pipeline). The closed form it replaces (``Σ t_k + Σ x_j + (m − 1)·max(t_k, x_j)`` and
a collective's latency for each of the ``2(m + p − 2)`` crossings) predicted ``vgg_mini`` at
100 Mbit/s 0.121 s a step where it took 0.090 s (docs/choosing.md). Across pipelines each
stage's gradients are all-reduced among its ``W/p`` replicas when its last backward ends; a
stage ``k`` ends ``k`` micro-batch slots before stage 0, so that much of its all-reduce is
hidden.

**SpecTrain** (one micro-batch a step, never flushed): stages work on different batches at
once, each busy ``busy_k`` a step (weight prediction ``w_k``, forward, backward, optimizer
step, the trainer's time). A stage's weights are ``N−k−1`` updates stale and it predicts them
before each forward; the last stage's never are. Stage ``k`` starts its step once the step's
activation has come through stages ``0..k−1``: ``lag_k = Σ_{j<k} (w_j + f_j + g_j + a_j)``,
where the activation's crossing ``a_j`` waits for the previous step's gradient ``g_j`` on the
same connection (a gloo send starts once its receiver has posted the receive, and the
receiver's notice queues behind the gradient it is sending). Every rank joins the trainer's
flag broadcast before a batch, so a step lasts ``max_k (lag_k + busy_k)``, or the cut's
transfer where the link is slower (tied tensors' exchanges add to it). An
activation that fits the token bucket the link refilled while it idled (the bench's simulated
hosts) delays the next stage by the latency alone: ``gpt`` at 10 Mbit/s, 16 kB of token ids a
step, waited 1.4 ms for them where their bytes take 13 ms at the link's rate. With
``W / p > 1`` pipelines every unit's gradients are all-reduced among the stage's replicas
before its update, inside ``busy_k``.
On the sleeping test model of 4 layers: 0.171 s measured, where the slowest stage alone would
say 0.142 s; of 2 layers (0.15/0.3 s): 0.611 s measured, 0.610 s predicted.

**Bytes over a cut**: the activations forward, and back only the gradients of its
floating-point tensors (:attr:`~lightning_parallel.pipeline.profile.LayerCost.backward_bytes`):
a cut after a layer that passes token ids on (``gpt``'s first) carries nothing back.

**Tied weights** (a language model's head that reuses its embedding, in the first and the
last stage): every stage using the tensor keeps a copy (:mod:`~lightning_parallel.pipeline.tied`).
GroPipe sums the copies' gradients over those stages once a step, blocking; SpecTrain sums
them and broadcasts the owner's value at every update, asynchronously. On transformers' GPT-2
(4 layers, width 256, a 4.2 MB tied embedding) on 2 hosts that is 4.2 MB a step a host for
GroPipe and 6.3 MB for SpecTrain, which the plan had left out (1.1-1.3 MB predicted against
5.6 and 7.8 MB measured).
"""

from __future__ import annotations

import bisect
import itertools
from dataclasses import replace
from typing import Any

from lightning_parallel.pipeline.link import PROBE_BYTES
from lightning_parallel.pipeline.noflush.mirror import mirror_width
from lightning_parallel.pipeline.partition import (
    PartitionError,
    partition,
    plan_for,
)
from lightning_parallel.pipeline.schedule import get_schedule
from lightning_parallel.pipeline.summary import summary_width
from lightning_parallel.plan.memory import peak_rss_mb
from lightning_parallel.plan.network import (
    Cluster,
    Link,
    all_reduce,
    broadcast,
    send,
    step_flag,
)
from lightning_parallel.plan.pipeline_timing import CutLink, StageTimes, flushing_step_seconds
from lightning_parallel.plan.prediction import STEADY, Prediction, RunLength, Traffic, refused
from lightning_parallel.plan.profile import StepProfile

__all__: list[str] = []

PROBE_REPEATS = 2  # measure_link_seconds_per_byte's default


def _stage_link(cluster: Cluster, stages: int) -> tuple[Link, bool]:
    """The link between a pipeline's stages, and whether it is the hosts' link."""
    if cluster.processes_per_host >= stages:
        return cluster.intra, False
    return cluster.inter, True


def _pipeline_cluster(cluster: Cluster, stages: int) -> Cluster:
    """The pipeline's stages as a cluster of their own (for its small collectives)."""
    if cluster.processes_per_host >= stages:
        return replace(cluster, hosts=1, processes_per_host=stages)
    return replace(cluster, hosts=stages, processes_per_host=1)


def _replica_cluster(cluster: Cluster, groups: int) -> Cluster:
    """A stage's replicas across the pipelines (one per pipeline)."""
    hosts = max(1, min(groups, cluster.hosts))
    return replace(cluster, hosts=hosts, processes_per_host=max(1, groups // hosts))


def _link_probe(traffic: Traffic, cluster: Cluster, stages: int, run: RunLength) -> None:
    """The link measurement before partitioning (:mod:`~lightning_parallel.pipeline.link`):
    every stage but the last sends ``repeats`` probes of ``PROBE_BYTES`` to the next, once per
    run; hosts' mean."""
    if not run.steps or cluster.processes_per_host >= stages:
        return
    senders = cluster.world // stages * (stages - 1)
    probe = send(cluster, PROBE_BYTES)
    traffic.payload_bytes += (
        run.per_step(PROBE_REPEATS * senders * probe.payload_bytes) / cluster.hosts
    )
    traffic.wire_bytes += run.per_step(PROBE_REPEATS * senders * probe.wire_bytes) / cluster.hosts


def _validation_traffic(
    traffic: Traffic,
    cluster: Cluster,
    run: RunLength,
    groups: int,
    batch_size: int,
    micro: int,
    cut_bytes: list[float],
) -> None:
    """The validations inside the run (each epoch's end): every validation batch's ``micro``
    micro-batches go forward over every cut, nothing comes back; each of the ``groups``
    pipelines validates its share of the set; hosts' mean. Measured before this was counted:
    ``vgg_mini`` at 1 Gbit/s, 60 steps with one validation, GroPipe's and SpecTrain's bytes 8%
    and 10% above the prediction."""
    validations = run.validations_over(groups, batch_size)
    batches = run.validation_batches(groups, batch_size)
    if not validations or not batches:
        return
    crossings = validations * groups * batches * micro
    for nbytes in cut_bytes:
        traffic.add(
            send(cluster, nbytes), times=run.per_step(crossings) / cluster.hosts, waited=False
        )


def _tied_across_stages(layers: Any, edges: list[int]) -> list[tuple[int, int]]:
    """``(bytes, holders)`` of each tied tensor (:attr:`LayerProfile.tied`) whose uses fall in
    ``holders >= 2`` stages of the split at ``edges``: every such stage keeps a copy
    (:mod:`~lightning_parallel.pipeline.tied`)."""
    found = []
    for nbytes, where in layers.tied:
        holders = {bisect.bisect_right(edges, index) - 1 for index in where}
        if len(holders) > 1:
            found.append((nbytes, len(holders)))
    return found


def _check(
    spec: str, family: str, profile: StepProfile, cluster: Cluster, stages: int
) -> str | None:
    if profile.pipeline_error:
        return f"the model cannot be split: {profile.pipeline_error}"
    if cluster.world % stages:
        return f"{cluster.world} processes are not a multiple of stages={stages}"
    return None


def _base_bytes(profile: StepProfile) -> float:
    """The one-process peak without the model's state and activations (and DDP's buckets)."""
    assert profile.peak_rss_bytes is not None
    state = 3.0 * profile.parameter_bytes + profile.optimizer_state_bytes
    return profile.peak_rss_bytes - state - profile.activation_bytes


def _stage_times(layers: Any, micro: int) -> StageTimes:
    """A stage's forward and backward of one micro-batch, its deferred weight gradients
    apart (computed once, after its last backward, for all ``micro`` micro-batches)."""
    deferred = sum(c.deferred_seconds or 0.0 for c in layers)
    return StageTimes(
        forward=sum(c.forward_seconds for c in layers),
        backward=sum(c.backward_seconds for c in layers) - deferred,
        deferred=micro * deferred,
    )


def _stage_peak_mb(
    profile: StepProfile, stage_parameters: list[float], stage_activations: list[float]
) -> float | None:
    if profile.peak_rss_bytes is None:
        return None
    optimizer_per_byte = profile.optimizer_state_bytes / max(1.0, profile.parameter_bytes)
    peaks = [
        2.0 * params + optimizer_per_byte * params + activations
        for params, activations in zip(stage_parameters, stage_activations)
    ]
    return peak_rss_mb(profile, _base_bytes(profile) - profile.peak_rss_bytes + max(peaks))


def predict_gropipe(
    spec: str,
    profile: StepProfile,
    cluster: Cluster,
    options: dict[str, Any],
    run: RunLength = STEADY,
) -> Prediction:
    """``gropipe`` with its options (see the module docstring)."""
    stages = int(options.get("stages", 2))
    micro = int(options.get("micro_batches", 4))
    schedule = str(options.get("schedule", "1f1b"))
    reason = _check(spec, "gropipe", profile, cluster, stages)
    layers = profile.layers_at(max(1, profile.batch_size // micro))
    if reason or layers is None:
        return refused(spec, "gropipe", reason or "no layer profile")
    link, crosses_hosts = _stage_link(cluster, stages)
    probe = send(_pipeline_cluster(cluster, stages), 2**20)
    seconds_per_byte = (probe.seconds - link.latency) / 2**20
    try:
        plan = partition(
            layers.model_profile(), stages, micro, schedule=schedule,
            link_seconds_per_byte=seconds_per_byte,
        )  # fmt: skip
    except PartitionError as error:
        return refused(spec, "gropipe", str(error))
    # the split is chosen as the strategy chooses it (compute and the cuts' transfers); the
    # step is then replayed operation by operation (plan.pipeline_timing): sends run beside
    # the compute, a small activation passes in the shaper's burst
    work = plan_for(layers.model_profile(), plan.boundaries, micro, schedule)
    edges = [0, *plan.boundaries, len(layers.layers)]
    times = [_stage_times(layers.layers[a:b], micro) for a, b in itertools.pairwise(edges)]
    slot = max(t.forward + t.backward for t in times)
    pipeline = _pipeline_cluster(cluster, stages)
    ends = flushing_step_seconds(
        get_schedule(schedule).table(stages, micro),
        times,
        [float(layers.layers[b - 1].output_bytes) for b in plan.boundaries],
        [float(layers.layers[b - 1].backward_bytes) for b in plan.boundaries],
        CutLink(
            seconds_per_byte,
            link.point_latency,
            link.burst_bytes if crosses_hosts else 0.0,
        ),
    )
    fill = max(ends)
    stage_params = [
        float(sum(c.parameter_bytes for c in layers.layers[a:b]))
        for a, b in itertools.pairwise(edges)
    ]
    share = [p / max(1.0, sum(stage_params)) for p in stage_params]
    optimizer = max(profile.optimizer_s * s for s in share)
    # the step's summary (pipeline.summary): float64 slots, waited for; its bytes pass in the
    # shaper's burst
    summary = all_reduce(pipeline, 8.0 * summary_width(stages), element_bytes=8)
    credit = link.burst_seconds(slot) if crosses_hosts else 0.0
    summary_s = max(summary.messages * link.latency, summary.seconds - credit)
    # the trainer's SIGTERM flag before every batch: a later stage waits for its activation
    # longer than for rank 0's flag, so only its bytes count
    traffic = Traffic().add(summary).add(step_flag(cluster), waited=False)
    groups = cluster.world // stages
    exposed_sync = 0.0
    if groups > 1:
        replicas = _replica_cluster(cluster, groups)
        for k, params in enumerate(stage_params):
            transfer = all_reduce(replicas, params)
            traffic.add(transfer, times=1.0 / stages, waited=False)
            exposed_sync = max(exposed_sync, transfer.seconds - k * slot)
    cut_bytes = [float(layers.layers[b - 1].output_bytes) for b in plan.boundaries]
    back_bytes = [float(layers.layers[b - 1].backward_bytes) for b in plan.boundaries]
    if crosses_hosts:
        # stage k sends activations forward over its output cut and gradients back over its
        # input cut (none over integer tensors), one of each per micro-batch; hosts' mean
        sent = [
            micro * ((cut_bytes[k] if k < stages - 1 else 0.0) + (back_bytes[k - 1] if k else 0.0))
            for k in range(stages)
        ]
        for nbytes in sent:
            if nbytes:  # a last stage behind an integer cut sends nothing
                traffic.add(send(cluster, nbytes / micro), times=micro / stages, waited=False)
        _validation_traffic(traffic, cluster, run, groups, profile.batch_size, micro, cut_bytes)
    # a tied tensor's gradient is summed over the stages holding it once a step, after the
    # stages' own gradients (blocking); hosts' mean: each holder sends its share
    tied_s = 0.0
    for nbytes, holders in _tied_across_stages(layers, edges):
        transfer = all_reduce(_pipeline_cluster(cluster, holders), nbytes)
        traffic.add(transfer, times=holders / stages, waited=False)
        tied_s += transfer.seconds
    _link_probe(traffic, cluster, stages, run)
    compute = fill + optimizer + profile.overhead_s
    step = compute + summary_s + exposed_sync + tied_s
    busy = micro * sum(work.stage_seconds) / stages
    activations = [
        float(sum(c.activation_bytes for c in layers.layers[a:b])) * min(micro, stages - k)
        for k, (a, b) in enumerate(itertools.pairwise(edges))
    ]
    return Prediction(
        spec=spec,
        family="gropipe",
        step_s=step,
        mean_step_s=step,
        compute_s=busy + optimizer + profile.overhead_s,
        exposed_comm_s=summary_s + exposed_sync + tied_s,
        bubble_s=fill - busy,
        wire_bytes_per_step=traffic.wire_bytes,
        payload_bytes_per_step=traffic.payload_bytes,
        peak_rss_mb=_stage_peak_mb(profile, stage_params, activations),
        samples_per_s=groups * profile.batch_size / step,
        detail={
            "stages": stages,
            "micro_batches": micro,
            "boundaries": list(plan.boundaries),
            "stage_seconds": list(work.stage_seconds),
            "cut_bytes": cut_bytes,
        },
    )


def _prediction_seconds(
    layers: Any, edges: list[int], share: list[float], optimizer_s: float, options: dict[str, Any]
) -> list[float]:
    """Each stage's weight prediction before a forward: a stage ``k`` of ``N`` runs on weights
    ``N−k−1`` updates stale and predicts them (``v2``, ``v1``, ``auto``); the last stage's are
    never stale. Measured per layer
    (:attr:`~lightning_parallel.pipeline.profile.LayerCost.pass_seconds`); a profile without it:
    the optimizer step's time on the stage's share of the parameters. On ``vgg_mini`` at
    1 Gbit/s, 50 MB of weights on the last stage: its update took 9.3 ms and its forward what
    the profile says, where a prediction too would have added 9.7 ms. Approximations:
    ``"auto"`` is counted as predicting (the strategy picks ``"none"`` for other optimizers
    than Adam's with more than 2 stages), and ``v1``'s extra horizons (before the backward,
    and on the last stage with 3 stages or more) are not counted. Each layer's measure holds
    its own error meter, where a stage keeps one: a little more than the stage's."""
    if str(options.get("prediction", "auto")) not in ("auto", "v1", "v2"):
        return [0.0] * len(share)
    seconds = []
    for k, (a, b) in enumerate(itertools.pairwise(edges)):
        passes = [c.pass_seconds for c in layers[a:b]]
        if k == len(share) - 1:
            seconds.append(0.0)
        elif all(p is not None for p in passes):
            seconds.append(float(sum(p for p in passes if p is not None)))
        else:
            seconds.append(optimizer_s * share[k])
    return seconds


def predict_spectrain(
    spec: str,
    profile: StepProfile,
    cluster: Cluster,
    options: dict[str, Any],
    run: RunLength = STEADY,
) -> Prediction:
    """``spectrain`` with its options (see the module docstring)."""
    stages = int(options.get("stages", 2))
    micro = int(options.get("micro_batches", 1))
    reason = _check(spec, "spectrain", profile, cluster, stages)
    layers = profile.layers_at(max(1, profile.batch_size // micro))
    if reason or layers is None:
        return refused(spec, "spectrain", reason or "no layer profile")
    link, crosses_hosts = _stage_link(cluster, stages)
    probe = send(_pipeline_cluster(cluster, stages), 2**20)
    seconds_per_byte = (probe.seconds - link.latency) / 2**20
    try:
        plan = partition(
            layers.model_profile(), stages, 1, schedule="1f1b",
            link_seconds_per_byte=seconds_per_byte, flushing=False,
        )  # fmt: skip
    except PartitionError as error:
        return refused(spec, "spectrain", str(error))
    # the stages' own work on the split chosen (the cut's transfers are counted apart)
    plan = plan_for(layers.model_profile(), plan.boundaries, 1, "1f1b")
    edges = [0, *plan.boundaries, len(layers.layers)]
    stage_params = [
        float(sum(c.parameter_bytes for c in layers.layers[a:b]))
        for a, b in itertools.pairwise(edges)
    ]
    share = [p / max(1.0, sum(stage_params)) for p in stage_params]
    # the step's telemetry all-reduce (pipeline.noflush.mirror: float64 slots, completed a
    # step later) and the trainer's SIGTERM flag (a later stage waits for its activation
    # longer): bytes only
    mirror = all_reduce(
        _pipeline_cluster(cluster, stages), 8.0 * mirror_width(stages), element_bytes=8
    )
    traffic = Traffic().add(mirror, waited=False).add(step_flag(cluster), waited=False)
    # with several pipelines, each unit's gradients are averaged among the stage's replicas
    # (one blocking all-reduce after every backward) before the update
    groups = cluster.world // stages
    sync = [0.0] * stages
    if groups > 1:
        replicas = _replica_cluster(cluster, groups)
        for k, params in enumerate(stage_params):
            transfer = all_reduce(replicas, params)
            traffic.add(transfer, times=micro / stages, waited=False)
            sync[k] = transfer.seconds
    predict = _prediction_seconds(layers.layers, edges, share, profile.optimizer_s, options)
    busy = [
        micro * (t + before + profile.optimizer_s * s + reduce) + profile.overhead_s
        for t, before, s, reduce in zip(plan.stage_seconds, predict, share, sync)
    ]
    cut_bytes = [float(layers.layers[b - 1].output_bytes) for b in plan.boundaries]
    back_bytes = [float(layers.layers[b - 1].backward_bytes) for b in plan.boundaries]
    transfer_s = 0.0
    pipeline = _pipeline_cluster(cluster, stages)
    # per cut: the activation's and the gradient's bytes' time (None: no gradient comes back)
    crossing: list[tuple[float, float | None]] = []
    for nbytes, back in zip(cut_bytes, back_bytes):
        transfer = send(pipeline, nbytes)
        returned = send(pipeline, back) if back else None
        crossing.append(
            (
                transfer.seconds - link.latency,
                returned.seconds - link.latency if returned else None,
            )
        )
        transfer_s = max(transfer_s, micro * transfer.seconds)
        if crosses_hosts:
            # one activation forward and one gradient back (none over integer tensors) per
            # micro-batch, on two hosts
            traffic.add(transfer, times=micro / stages, waited=False)
            if returned is not None:
                traffic.add(returned, times=micro / stages, waited=False)
    if crosses_hosts:
        _validation_traffic(traffic, cluster, run, groups, profile.batch_size, micro, cut_bytes)
    # a tied tensor at every update: its gradient summed over the holders and the owner's value
    # broadcast to the copies, both asynchronous, due some updates later (no wait), on the
    # links the cut's transfers use: the owner's link carries both beside its activations
    for nbytes, holders in _tied_across_stages(layers, edges):
        holding = _pipeline_cluster(cluster, holders)
        summed, sent = all_reduce(holding, nbytes), broadcast(holding, nbytes)
        traffic.add(summed, times=micro * holders / stages, waited=False)
        traffic.add(sent, times=micro / stages, waited=False)
        transfer_s += micro * (summed.seconds + sent.seconds)
    _link_probe(traffic, cluster, stages, run)
    # stage k starts a step once the step's activation has come through stages 0..k-1, and
    # every rank joins the trainer's flag broadcast before the next batch (a gloo send waits
    # for its receiver: a barrier): a step lasts the longest of lag_k + busy_k
    forward = [
        micro * (sum(c.forward_seconds for c in layers.layers[a:b]) + before)
        for (a, b), before in zip(itertools.pairwise(edges), predict)
    ]
    # an activation that fits the token bucket a link refilled while it idled passes at once
    # (the simulated hosts' shaper; no bucket on a real link): it delays the next stage by the
    # link's latency alone.
    # A gloo send starts only once its receiver has posted the receive, and the receiver's
    # notice travels on the connection the pair shares, behind what the receiver is sending:
    # stage k posts the receive of step n's activation after its send of step n−1's gradient,
    # which stage k−1 takes after its forward of step n. So the activation crosses after the
    # gradient (``resnet18``'s cut at 1 Gbit/s, 1 MB each way, measured on a timeline:
    # gradient 7.1 ms, then activation 6.5 ms; 13.6 ms from the forward's end to its arrival)
    idle = max(busy) - transfer_s
    credit = link.burst_seconds(idle) if crosses_hosts else 0.0
    lag = [0.0]
    message = link.point_latency  # each message's latency, its bytes through the bucket
    for k in range(1, stages):
        activation, gradient = crossing[k - 1]
        behind = 0.0 if gradient is None else message + max(0.0, gradient - credit)
        lag.append(lag[-1] + forward[k - 1] + behind + message + max(0.0, activation - credit))
    step = max(max(start + work for start, work in zip(lag, busy)), transfer_s)
    activations = [
        float(sum(c.activation_bytes for c in layers.layers[a:b])) * (stages - k)
        for k, (a, b) in enumerate(itertools.pairwise(edges))
    ]
    return Prediction(
        spec=spec,
        family="spectrain",
        step_s=step,
        mean_step_s=step,
        compute_s=max(busy),
        exposed_comm_s=max(0.0, transfer_s - max(busy)),
        bubble_s=0.0,
        wire_bytes_per_step=traffic.wire_bytes,
        payload_bytes_per_step=traffic.payload_bytes,
        peak_rss_mb=_stage_peak_mb(profile, stage_params, activations),
        samples_per_s=groups * profile.batch_size / step,
        detail={
            "stages": stages,
            "boundaries": list(plan.boundaries),
            "stage_busy_s": busy,
            "transfer_s": transfer_s,
            "cut_bytes": cut_bytes,
        },
    )
