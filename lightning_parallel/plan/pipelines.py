"""Predict the pipelines: ``gropipe`` (flushing, micro-batches) here, and what both pipelines
share; ``spectrain`` (no flush) in :mod:`~lightning_parallel.plan.spectrain`.

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
    send,
    step_flag,
)
from lightning_parallel.plan.pipeline_timing import CutLink, StageTimes, flushing_step_seconds
from lightning_parallel.plan.prediction import STEADY, Prediction, RunLength, Traffic, refused
from lightning_parallel.plan.profile import LayerProfile, StepProfile

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


def _stage_setup(
    spec: str, family: str, profile: StepProfile, cluster: Cluster, stages: int, micro: int
) -> tuple[LayerProfile, Link, bool, float] | Prediction:
    """What both pipelines start from: the layer profile at the micro-batch size, the link
    between the stages (and whether it is the hosts'), and its measured seconds per byte as
    the strategies' link probe gives it; or the refusal."""
    reason = _check(spec, family, profile, cluster, stages)
    layers = profile.layers_at(max(1, profile.batch_size // micro))
    if reason or layers is None:
        return refused(spec, family, reason or "no layer profile")
    link, crosses_hosts = _stage_link(cluster, stages)
    probe = send(_pipeline_cluster(cluster, stages), 2**20)
    return layers, link, crosses_hosts, (probe.seconds - link.latency) / 2**20


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
    setup = _stage_setup(spec, "gropipe", profile, cluster, stages, micro)
    if isinstance(setup, Prediction):
        return setup
    layers, link, crosses_hosts, seconds_per_byte = setup
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
