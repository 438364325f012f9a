"""Predict synchronous data parallelism: ``ddp``, ``ddp_fp16``, ``ddp_powersgd``; ``hylo``
builds on these buckets in :mod:`~lightning_parallel.plan.hylo`.

**DDP's buckets.** DDP puts the gradients in buckets in reverse registration order (the first
bucket 1 MiB, the others 25 MiB), and allreduces a bucket as soon as backward has produced all
its gradients, one allreduce after another on the link. With per-layer backward times (the
layer profile, scaled to the measured backward), backward is replayed layer by layer from the
last: a layer's gradients join the open bucket when its backward ends, a full bucket is queued,
the last one when backward ends, and the step ends when the last allreduce does:
``step = forward + max(backward, last allreduce's end) + optimizer + trainer``. Without a
layer profile every gradient is taken as ready at the end of backward (no overlap: an upper
bound).

**fp16.** Half the gradient bytes; the casts are not timed.

**PowerSGD** (torch's hook, rank ``r``, matrices worth compressing: ``n m / ((n + m) r) > 2``):
per bucket three allreduces in a row (the uncompressed tensors, then every ``P = M Q``, then
every ``Q = M^T P``) and the hook's work on the core before them: what the hook measured
adding to a step in the profile's world of one process
(:func:`~lightning_parallel.plan.codecs.comm_hook_seconds`), else the low-rank products alone
(:func:`~lightning_parallel.plan.codecs.codec_timings`), shared among the buckets. On gloo the
strategy finishes each bucket's allreduces inside its hook call (``serialize_buckets``: gloo
matches collectives by their order), so backward waits for them: nothing overlaps and the
step is ``compute + work + every allreduce``; on an accelerator (NCCL) the buckets overlap
backward as DDP's do.

**Buffers.** DDP broadcasts rank 0's buffers (BatchNorm's running statistics) before every
training forward (``broadcast_buffers``, on by default; a SPEC's ``broadcast_buffers=False``
turns it off): one binomial broadcast of the profile's ``buffer_bytes``, waited for, in every
DDP-based prediction.

**The trainer's flag.** Before every training batch Lightning broadcasts rank 0's SIGTERM
flag (:func:`~lightning_parallel.plan.network.step_flag`, 8 bytes): its latency is waited for
and its bytes counted, in every family but the parameter server's.

**A shaper's burst.** Where the link is shaped by a token bucket (the simulated hosts), the
bucket refills while the link idles during the compute, and its burst passes at once: the
exposed communication is less by ``min(burst, idle · b) / b`` (at 10 Mbit/s 56 ms a step).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from lightning_parallel.compression.low_rank import matrix_shape
from lightning_parallel.plan.memory import EXTRA_PARAMETER_COPIES, peak_rss_mb
from lightning_parallel.plan.network import (
    Cluster,
    Transfer,
    all_reduce,
    broadcast_mean,
    step_flag,
)
from lightning_parallel.plan.prediction import STEADY, Prediction, RunLength, Traffic
from lightning_parallel.plan.profile import ParameterShape, StepProfile

__all__: list[str] = []

FIRST_BUCKET_BYTES = 1 * 2**20
BUCKET_BYTES = 25 * 2**20


@dataclass(frozen=True)
class Ready:
    """Gradient bytes that become ready at ``seconds`` into backward."""

    seconds: float
    nbytes: float


def ready_times(profile: StepProfile) -> list[Ready]:
    """When each layer's gradients are ready during backward, last layer first (see the module
    docstring); bytes outside the layer chain are ready at once (a head or loss module)."""
    total = float(profile.parameter_bytes)
    layers = profile.layers_at(profile.batch_size)
    if layers is None or not layers.layers:
        return [Ready(profile.backward_s, total)]
    measured = sum(cost.backward_seconds for cost in layers.layers)
    scale = profile.backward_s / measured if measured > 0 else 0.0
    own = [float(cost.parameter_bytes) for cost in layers.layers]
    # a tied tensor is in the bytes of every layer using it, but is one gradient, complete
    # when backward has passed its first use: the other layers' counts lose it
    for tied_bytes, where in layers.tied:
        for index in sorted(where)[1:]:
            own[index] = max(0.0, own[index] - tied_bytes)
    ready = [Ready(0.0, max(0.0, total - sum(own)))]
    elapsed = 0.0
    for cost, nbytes in zip(reversed(layers.layers), reversed(own)):
        elapsed += cost.backward_seconds * scale
        ready.append(Ready(elapsed, nbytes))
    return ready


def _bucket_spans(sizes: Sequence[float]) -> list[tuple[int, int, bool]]:
    """DDP's buckets over items of ``sizes`` bytes in the order given: ``(start, end, full)``
    index spans, the first closed once it holds 1 MiB, the others at 25 MiB, then what is left
    (``full`` false) if it holds any bytes."""
    spans: list[tuple[int, int, bool]] = []
    start, filled, cap = 0, 0.0, float(FIRST_BUCKET_BYTES)
    for index, size in enumerate(sizes):
        filled += size
        if filled >= cap:
            spans.append((start, index + 1, True))
            start, filled, cap = index + 1, 0.0, float(BUCKET_BYTES)
    if filled > 0:
        spans.append((start, len(sizes), False))
    return spans


def buckets(ready: Sequence[Ready], factor: float = 1.0) -> list[Ready]:
    """DDP's buckets: when each is full (or backward ends) and its bytes, times ``factor``."""
    end = max((r.seconds for r in ready), default=0.0)
    return [
        Ready(
            ready[stop - 1].seconds if full else end, sum(r.nbytes for r in ready[a:stop]) * factor
        )
        for a, stop, full in _bucket_spans([r.nbytes for r in ready])
    ]


def _chain(
    bucket_list: Sequence[Ready], transfer_of: Any, traffic: Traffic, extra_s: float = 0.0
) -> float:
    """Queue each bucket's transfers on the link in order; the end of the last (seconds into
    backward). ``transfer_of(bucket)`` gives the bucket's transfers, ``extra_s`` the work per
    bucket on the core before them."""
    link_free = 0.0
    for bucket in bucket_list:
        start = max(link_free, bucket.seconds) + extra_s
        for transfer in transfer_of(bucket):
            traffic.add(transfer, waited=False)
            start += transfer.seconds
        link_free = start
    return link_free


def _finish(
    spec: str,
    profile: StepProfile,
    cluster: Cluster,
    traffic: Traffic,
    comm_end: float,
    family: str,
    extra_bytes: float,
    work_s: float = 0.0,
    detail: dict[str, Any] | None = None,
    buffers: bool = True,
) -> Prediction:
    backward_end = profile.backward_s + work_s
    # a shaper's token bucket refilled while the link idled (the compute) passes its burst
    # at once
    credit = cluster.inter.burst_seconds(profile.step_s) if cluster.hosts > 1 else 0.0
    exposed = max(0.0, comm_end - backward_end - credit)
    if buffers and profile.buffer_bytes:
        # DDP's broadcast of rank 0's buffers before every training forward: nothing to hide
        # it behind
        sync = broadcast_mean(cluster, profile.buffer_bytes)
        traffic.add(sync)
        exposed += sync.seconds
    # the trainer's SIGTERM flag before every batch: rank 1 waits for rank 0's message
    flag = step_flag(cluster)
    traffic.add(flag)
    exposed += flag.seconds
    step = profile.step_s + work_s + exposed
    return Prediction(
        spec=spec,
        family=family,
        step_s=step,
        mean_step_s=step,
        compute_s=profile.step_s + work_s,
        exposed_comm_s=exposed,
        bubble_s=0.0,
        wire_bytes_per_step=traffic.wire_bytes,
        payload_bytes_per_step=traffic.payload_bytes,
        peak_rss_mb=peak_rss_mb(profile, extra_bytes),
        samples_per_s=cluster.world * profile.batch_size / step,
        detail=detail or {},
    )


def _broadcasts_buffers(options: dict[str, Any]) -> bool:
    """Whether DDP broadcasts the buffers (``broadcast_buffers``, a DDP keyword the strategies
    pass on; on by default)."""
    return bool(options.get("broadcast_buffers", True))


def predict_ddp(
    spec: str,
    profile: StepProfile,
    cluster: Cluster,
    options: dict[str, Any],
    run: RunLength = STEADY,
) -> Prediction:
    """``ddp`` (and ``ddp_fp16`` with ``compression_ratio=2``): see the module docstring."""
    factor = 1.0 / float(options.get("compression_ratio", 1.0) or 1.0)
    traffic = Traffic()
    bucket_list = buckets(ready_times(profile), factor)
    end = _chain(bucket_list, lambda b: [all_reduce(cluster, b.nbytes)], traffic)
    detail = {"buckets": len(bucket_list)}
    return _finish(
        spec, profile, cluster, traffic, end, "ddp", 0.0, detail=detail,
        buffers=_broadcasts_buffers(options),
    )  # fmt: skip


def predict_powersgd(
    spec: str,
    profile: StepProfile,
    cluster: Cluster,
    options: dict[str, Any],
    run: RunLength = STEADY,
) -> Prediction:
    """``ddp_powersgd``: see the module docstring."""
    rank = int(options.get("matrix_approximation_rank", options.get("rank", 2)))
    least = float(options.get("min_compression_rate", 2.0))
    compressed = [p for p in profile.parameters if len(p.shape) >= 2 and _worth(p, rank, least)]
    factor_bytes = _factor_bytes(compressed, rank)
    dense_bytes = profile.parameter_bytes - sum(p.nbytes for p in compressed)
    work = _powersgd_work(profile, compressed, rank)
    # the compressed share of every bucket, in proportion to its bytes
    share = (factor_bytes + dense_bytes) / max(1.0, profile.parameter_bytes)
    bucket_list = buckets(ready_times(profile), share)
    count = max(1, len(bucket_list))
    traffic = Traffic()
    p_share = 0.5 * factor_bytes / max(1.0, factor_bytes + dense_bytes)
    dense_share = dense_bytes / max(1.0, factor_bytes + dense_bytes)

    def transfers(bucket: Any) -> list[Transfer]:
        return [
            all_reduce(cluster, bucket.nbytes * dense_share),
            all_reduce(cluster, bucket.nbytes * p_share),
            all_reduce(cluster, bucket.nbytes * p_share),
        ]

    serialized = options.get("serialize_buckets")
    if serialized is None:  # gloo unless the profile was carried to an accelerator
        serialized = "accelerator_flops_per_second" not in profile.notes
    if serialized:
        ready_at_end = [Ready(profile.backward_s, bucket.nbytes) for bucket in bucket_list]
        end = _chain(ready_at_end, transfers, traffic, extra_s=work / count)
    else:
        end = _chain(bucket_list, transfers, traffic, extra_s=work / count)
    # the first start_powerSGD_iter steps allreduce the gradients uncompressed
    start = int(options.get("start_powerSGD_iter", 2))
    dense = Traffic().add(all_reduce(cluster, profile.parameter_bytes))
    _with_first_steps(traffic, run, [(start, dense)])
    extra = EXTRA_PARAMETER_COPIES["ddp_powersgd"] * profile.parameter_bytes
    detail = {
        "rank": rank, "compressed_layers": len(compressed), "codec_s": work,
        "serialized": bool(serialized),
    }  # fmt: skip
    return _finish(
        spec, profile, cluster, traffic, end, "ddp_powersgd", extra, work, detail,
        buffers=_broadcasts_buffers(options),
    )  # fmt: skip


def _with_first_steps(
    traffic: Traffic, run: RunLength, first: Sequence[tuple[int, Traffic]]
) -> None:
    """Blend a steady step's ``traffic`` (its bytes) with the run's first steps, in place:
    ``first`` gives, in order, how many steps send what one such step sends; the bench divides
    the whole run's bytes by its steps. Nothing changes for the steady state
    (``run.steps`` ``None``)."""
    if not run.steps:
        return
    left = run.steps
    wire = payload = 0.0
    for count, step in first:
        taken = min(max(0, count), left)
        left -= taken
        wire += taken * step.wire_bytes
        payload += taken * step.payload_bytes
    traffic.wire_bytes = (wire + left * traffic.wire_bytes) / run.steps
    traffic.payload_bytes = (payload + left * traffic.payload_bytes) / run.steps


def parameter_buckets(parameters: Sequence[ParameterShape]) -> list[list[ParameterShape]]:
    """DDP's buckets by parameter, in reverse registration order (:func:`_bucket_spans`)."""
    ordered = list(reversed(parameters))
    return [ordered[a:stop] for a, stop, _ in _bucket_spans([p.nbytes for p in ordered])]


def _factor_bytes(parameters: Sequence[ParameterShape], rank: int) -> float:
    """Bytes of the float32 factors ``P`` and ``Q`` of every parameter at ``rank``."""
    return sum(
        4.0 * sum(matrix_shape(p.shape)) * min(rank, *matrix_shape(p.shape)) for p in parameters
    )


def _powersgd_work(profile: StepProfile, compressed: Sequence[ParameterShape], rank: int) -> float:
    """The hook's work a step: as measured at this rank; measured at another rank, scaled by
    the products' times at the two ranks; not measured, the products alone."""
    products = sum(profile.low_rank_s(p.shape, rank) for p in compressed)
    measured = profile.hook_s(f"ddp_powersgd@{rank}")
    if measured is not None:
        return measured
    for name in profile.hook_seconds:
        if name.startswith("ddp_powersgd@"):
            other = int(name.split("@")[1])
            at_other = sum(profile.low_rank_s(p.shape, other) for p in compressed)
            seconds = profile.hook_s(name) or 0.0
            return seconds * products / at_other if at_other > 0 else seconds
    return products


def _worth(parameter: ParameterShape, rank: int, least: float) -> bool:
    rows, cols = matrix_shape(parameter.shape)
    return rows * cols / ((rows + cols) * rank) > least
