"""Predict ``hylo``: Hylo's layer-wise compression over DDP's buckets
(:mod:`~lightning_parallel.plan.data_parallel` gives the buckets and the step's frame).

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
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from lightning_parallel.compression.calibration import CALIBRATION_STEPS
from lightning_parallel.compression.kernel_topk import KernelTopK
from lightning_parallel.compression.policy import ERROR_BUDGET, KERNEL, LOW_RANK, HyloPolicy
from lightning_parallel.compression.trials import error_key
from lightning_parallel.plan.data_parallel import (
    _broadcasts_buffers,
    _factor_bytes,
    _finish,
    _with_first_steps,
    parameter_buckets,
)
from lightning_parallel.plan.memory import EXTRA_PARAMETER_COPIES
from lightning_parallel.plan.network import Cluster, Transfer, all_reduce
from lightning_parallel.plan.prediction import STEADY, Prediction, RunLength, Traffic
from lightning_parallel.plan.profile import BLOCKED, ParameterShape, StepProfile

__all__: list[str] = []


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
