"""Predict synchronous data parallelism: ``ddp``, ``ddp_fp16``, ``ddp_powersgd``, ``hylo``.

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

**Hylo** (defaults: rank-8 factors for convolution and fully-connected weights of at least
8,192 values, everything else dense; its codec work timed in its own order of the products,
:func:`~lightning_parallel.plan.codecs.blocked_low_rank_seconds`): every low-rank layer's
``P`` of a DDP bucket fused into one
allreduce, the ``Q`` into a second, the bucket's dense layers into one; its cost model keeps a
layer dense where the dense bytes cost less link time than its factors and their codec work,
and so does the prediction. Where a layer has a second candidate (a fully-connected layer's
2-bit codes), the hook keeps the factors only while their error ``|p − C(p)| / |p|``, measured
on the run's first gradients, is within its budget (0.9). The profile tries every candidate on
its own first gradients the same way
(:func:`~lightning_parallel.compression.trials.first_trial_errors`), and where it puts the
factors over the budget and another candidate within it, the prediction sends that one (the
fewest bytes within the budget). On transformers' GPT-2 (4 layers of 256) the run sent the
token embedding and two of the eight MLP projections as codes; the profile put the embedding
at 0.938 and one of those projections at 0.911, the other at 0.867 (the MLP projections are
0.86 to 0.91 there: a coin flip on the gradient). Bytes −18.9% against the prediction that
took the factors everywhere, −2.6% with the profile's trial.

Hylo's first ``warmup_steps`` steps (0 by default) allreduce the gradients uncompressed, and
the ``CALIBRATION_STEPS`` after them (:mod:`~lightning_parallel.compression.calibration`) send
every layer by the policy's first candidate (kernel top-k for a convolution of 65,536 values
or more, the fewer bytes for a fully-connected layer) while the cost model measures: in a run
of ``steps`` they count in proportion. On torchvision's ResNet-18 (2 hosts) such a step sends
3.41 MB where a steady one sends 1.21: over 50 steps the bytes per step are 7% above the
steady state's (the interface counter: 3.46 MB for each of the first two steps, 1.26 after).

Hylo's rounds are DDP's buckets' (the hook exchanges each bucket in its own rounds; on 8
hosts a round of a few kB costs about 10 kB of framing a host), one after the other after
backward: the buckets' overlap with backward (the hook's thread) is not modelled. Against the
one fused set of rounds this replaced, the set C Hylo runs planned again from their profiles:
median step error 4.8% to 3.1%, the two worst +10.5% and +8.7% to +17.2% and +16.9%
(torchvision's ResNet-18 and ``vgg_mini`` at 100 Mbit/s); bytes within 1.3% on every run
but GPT-2's, where they were within 3.2% but for two runs at −7.2% and −19.4%.

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

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from lightning_parallel.compression.calibration import CALIBRATION_STEPS
from lightning_parallel.compression.kernel_topk import KernelTopK
from lightning_parallel.compression.low_rank import matrix_shape
from lightning_parallel.compression.policy import ERROR_BUDGET, KERNEL, LOW_RANK, HyloPolicy
from lightning_parallel.compression.trials import error_key
from lightning_parallel.plan.memory import EXTRA_PARAMETER_COPIES, peak_rss_mb
from lightning_parallel.plan.network import (
    Cluster,
    Transfer,
    all_reduce,
    broadcast_mean,
    step_flag,
)
from lightning_parallel.plan.prediction import STEADY, Prediction, RunLength, Traffic
from lightning_parallel.plan.profile import BLOCKED, ParameterShape, StepProfile

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


#: a parameter's route in Hylo's exchange and the bytes it sends that way (``None``: dense)
RouteOf = Callable[[ParameterShape], "tuple[str, float] | None"]


def _chosen(
    names: set[str], rank: int, coded: dict[str, tuple[str, float]] | None = None
) -> RouteOf:
    """The parameters ``names`` as rank-``rank`` factors, those in ``coded`` by their route and
    bytes there, the others dense."""
    routes = coded or {}

    def route(parameter: ParameterShape) -> tuple[str, float] | None:
        if parameter.name in routes:
            return routes[parameter.name]
        return (LOW_RANK, _factor_bytes([parameter], rank)) if parameter.name in names else None

    return route


#: Hylo's options that decide which candidates a layer has, beside its rank
_POLICY_OPTIONS = ("fc_bits", "min_compress_numel", "conv_low_rank", "codec")


def _within_budget_instead(
    profile: StepProfile, policy: HyloPolicy, parameter: ParameterShape
) -> tuple[str, float] | None:
    """The route and bytes a layer takes where the profile's first trial put its low-rank
    factors over ``policy``'s error budget and another candidate within it (the fewest bytes
    among those; the least error where none is within); ``None`` where the factors are within
    the budget, or where the profile has no trial of them at this rank."""
    errors = profile.codec_errors.get(parameter.name, {})
    candidates = policy.candidates(parameter.name, parameter.shape)
    low_rank = next((c for c in candidates if c.route == LOW_RANK), None)
    if low_rank is None or errors.get(error_key(low_rank), 0.0) <= policy.error_budget:
        return None
    tried = [c for c in candidates if error_key(c) in errors]
    within = [c for c in tried if errors[error_key(c)] <= policy.error_budget]
    if not within:
        within = [min(tried, key=lambda c: errors[error_key(c)])]
    best = min(within, key=lambda c: c.codec.wire_nbytes(parameter.shape))
    if best.route == LOW_RANK:
        return None
    return best.route, float(best.codec.wire_nbytes(parameter.shape))


def _first_candidates(policy: HyloPolicy) -> RouteOf:
    """Each parameter by the policy's first candidate: Hylo's plan before the cost model has
    decided (its calibration steps)."""

    def route(parameter: ParameterShape) -> tuple[str, float] | None:
        plan = policy.assign(parameter.name, parameter.shape)
        if not plan.compressed:
            return None
        return plan.route, float(plan.codec.wire_nbytes(parameter.shape))

    return route


def _hylo_rounds(profile: StepProfile, cluster: Cluster, route_of: RouteOf) -> list[Transfer]:
    """Hylo's allreduces of one step, bucket by bucket (the hook exchanges each of DDP's
    buckets): the kernels' norms, then the dense layers with the selected kernels; the
    low-rank ``P``, then ``Q``; 2-bit codes as one allreduce of theirs (a reduce-scatter and an
    allgather move the same bytes)."""
    rounds = []
    for bucket in parameter_buckets(profile.parameters):
        sent = {"norms": 0.0, "dense": 0.0, "p": 0.0, "q": 0.0, "codes": 0.0}
        for parameter in bucket:
            routed = route_of(parameter)
            if routed is None:
                sent["dense"] += parameter.nbytes
                continue
            route, wire = routed
            if route == KERNEL:
                norms = 2.0 * KernelTopK.kernel_layout(parameter.shape)[0]  # a bfloat16 each
                sent["norms"] += norms
                sent["dense"] += wire - norms
            elif route == LOW_RANK:
                sent["p"] += wire / 2
                sent["q"] += wire / 2
            else:
                sent["codes"] += wire
        rounds += [all_reduce(cluster, nbytes) for nbytes in sent.values() if nbytes > 0]
    return rounds


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


HYLO_RANK = 8
HYLO_LOW_RANK_MIN_NUMEL = 8192


def predict_hylo(
    spec: str,
    profile: StepProfile,
    cluster: Cluster,
    options: dict[str, Any],
    run: RunLength = STEADY,
) -> Prediction:
    """``hylo`` at its defaults (low-rank factors, error feedback): see the module docstring."""
    rank = int(options.get("rank") or HYLO_RANK)
    least = int(options.get("low_rank_min_numel", HYLO_LOW_RANK_MIN_NUMEL))
    seconds_per_byte = 8.0 / cluster.inter.bandwidth
    # the candidates the run's policy offers (a run without 2-bit codes keeps its factors)
    policy = HyloPolicy(
        rank=rank,
        low_rank_min_numel=least,
        error_budget=float(options.get("error_budget", ERROR_BUDGET)),
        **{key: options[key] for key in _POLICY_OPTIONS if key in options},
    )
    low_rank: list[ParameterShape] = []
    coded: dict[str, tuple[str, float]] = {}
    work = 0.0
    for parameter in profile.parameters:
        if len(parameter.shape) < 2 or parameter.numel < least:
            continue
        instead = _within_budget_instead(profile, policy, parameter)
        if instead is not None:
            coded[parameter.name] = instead
            continue
        factors = _factor_bytes([parameter], rank)
        codec = profile.low_rank_s(parameter.shape, rank, BLOCKED)
        saved = all_reduce(cluster, parameter.nbytes).payload_bytes * seconds_per_byte
        spent = all_reduce(cluster, factors).payload_bytes * seconds_per_byte + codec
        if spent < saved:
            low_rank.append(parameter)
            work += codec
    chosen = {p.name for p in low_rank}
    traffic = Traffic()
    rounds = _hylo_rounds(profile, cluster, _chosen(chosen, rank, coded))
    for transfer in rounds:
        traffic.add(transfer, waited=False)
    end = profile.backward_s + work + sum(t.seconds for t in rounds)
    warmup = int(options.get("warmup_steps", 0))
    calibration = CALIBRATION_STEPS if options.get("cost_model", True) else 0
    _with_first_steps(
        traffic,
        run,
        [
            (warmup, Traffic().add(all_reduce(cluster, profile.parameter_bytes))),
            (
                calibration,
                Traffic().add_all(_hylo_rounds(profile, cluster, _first_candidates(policy))),
            ),
        ],
    )
    extra = EXTRA_PARAMETER_COPIES["hylo"] * profile.parameter_bytes
    detail = {
        "low_rank_layers": len(low_rank), "rank": rank, "codec_s": work,
        "over_budget_layers": sorted(coded),
    }  # fmt: skip
    return _finish(
        spec, profile, cluster, traffic, end, "hylo", extra, work, detail,
        buffers=_broadcasts_buffers(options),
    )  # fmt: skip
