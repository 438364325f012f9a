"""Predict ``spectrain``: the no-flush pipeline with weight prediction.

The stages and the split are the pipelines' (:mod:`~lightning_parallel.plan.pipelines`: the
partitioner's own split, the bytes over a cut, tied weights).

**SpecTrain** (one micro-batch a step, never flushed): stages work on different batches at
once, each busy ``busy_k`` a step (weight prediction ``w_k``, forward, backward, optimizer
step, the trainer's time). A stage's weights are ``N−k−1`` updates stale and it predicts them
before each forward; the last stage's never are. The trainer's SIGTERM flag is read a batch
late (:class:`~lightning_parallel.strategies.base.LateSigtermFlag`), so no rank waits for the
others at a batch and each stage runs at its own pace: stage ``k``'s step is ``busy_k`` and
the crossing of its activation ``a_{k−1}``, which starts only once the stage has posted its
receive, after its update (a gloo send starts once its receiver has posted the receive),
behind whatever of its own gradient ``g_{k−1}`` is still on the connection then (the
receiver's notice queues behind it). A step lasts ``max_k (busy_k + a_{k−1} + late g)``, or the
cut's transfer where the link is slower (tied tensors' exchanges add to it). With the flag
broadcast blocking, as Lightning has it, every stage waited for the last stage's step at every
batch: timm's ViT-Tiny on 2 hosts at 100 Mbit/s stepped in 0.077 s, and 0.051 s without. An
activation that fits the token bucket the link refilled while it idled (the bench's simulated
hosts) delays the next stage by the latency alone: ``gpt`` at 10 Mbit/s, 16 kB of token ids a
step, waited 1.4 ms for them where their bytes take 13 ms at the link's rate. With
``W / p > 1`` pipelines every unit's gradients are all-reduced among the stage's replicas
before its update, inside ``busy_k``.
On the sleeping test model of 4 layers: 0.171 s measured, where the slowest stage alone would
say 0.142 s; of 2 layers (0.15/0.3 s): 0.611 s measured, 0.610 s predicted.
"""

from __future__ import annotations

import itertools
from typing import Any

from lightning_parallel.pipeline.noflush.mirror import mirror_width
from lightning_parallel.pipeline.partition import PartitionError, partition, plan_for
from lightning_parallel.plan.network import Cluster, all_reduce, broadcast, send, step_flag
from lightning_parallel.plan.pipelines import (
    _link_probe,
    _pipeline_cluster,
    _replica_cluster,
    _stage_peak_mb,
    _stage_setup,
    _tied_across_stages,
    _validation_traffic,
)
from lightning_parallel.plan.prediction import STEADY, Prediction, RunLength, Traffic, refused
from lightning_parallel.plan.profile import StepProfile

__all__: list[str] = []


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
    setup = _stage_setup(spec, "spectrain", profile, cluster, stages, micro)
    if isinstance(setup, Prediction):
        return setup
    layers, link, crosses_hosts, seconds_per_byte = setup
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
    # the trainer's SIGTERM flag is read a batch late (no barrier): each stage runs at its own
    # pace, and a stage's step is its work and the wait for its activation, which crosses only
    # once the stage has posted its receive, after its update
    # an activation that fits the token bucket a link refilled while it idled passes at once
    # (the simulated hosts' shaper; no bucket on a real link): it delays the next stage by the
    # link's latency alone.
    # A gloo send starts only once its receiver has posted the receive, and the receiver's
    # notice travels on the connection the pair shares, behind what the receiver is sending:
    # stage k posts the receive of step n's activation after its send of step n−1's gradient,
    # which stage k−1 takes after its forward of step n. So the activation crosses after the
    # gradient (``resnet18``'s cut at 1 Gbit/s, 1 MB each way, measured on a timeline:
    # gradient 7.1 ms, then activation 6.5 ms; 13.6 ms from the forward's end to its arrival)
    # the gradient leaves at the backward's end and the notice after the stage's update and
    # trainer time, so only what of the gradient outlasts those delays the activation
    idle = max(busy) - transfer_s
    credit = link.burst_seconds(idle) if crosses_hosts else 0.0
    message = link.point_latency  # each message's latency, its bytes through the bucket
    after_backward = [profile.optimizer_s * s + profile.overhead_s for s in share]
    inbound = [0.0]
    for k in range(1, stages):
        activation, gradient = crossing[k - 1]
        late = 0.0 if gradient is None else message + max(0.0, gradient - credit)
        behind = max(0.0, late - after_backward[k])
        inbound.append(micro * (behind + message + max(0.0, activation - credit)))
    step = max(max(work + wait for work, wait in zip(busy, inbound)), transfer_s)
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
