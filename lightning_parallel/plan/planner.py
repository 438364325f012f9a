"""Predict every strategy asked for from one profile, rank them, and scale the cluster.

:func:`predict` looks each strategy name up in :data:`PREDICTORS` (one predictor per family,
each module's docstring gives its law) and calls it with the strategy's options: the
registered defaults merged with the SPEC's, as the caller resolves them. :func:`ranked` sorts
the predictions by the cluster's samples per second (a pipeline of ``p`` stages trains
``W/p`` batches a step, a data-parallel step ``W``: step times alone do not compare them).
:func:`scaling` predicts the same strategies on the same hosts' links for other numbers of
hosts, for the plot of step time against workers.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

from lightning_parallel.plan.averaging import predict_averaging
from lightning_parallel.plan.data_parallel import predict_ddp, predict_powersgd
from lightning_parallel.plan.hylo import predict_hylo
from lightning_parallel.plan.network import Cluster
from lightning_parallel.plan.parameter_server import predict_parameter_server
from lightning_parallel.plan.pipelines import predict_gropipe
from lightning_parallel.plan.prediction import STEADY, Prediction, RunLength, refused
from lightning_parallel.plan.profile import StepProfile
from lightning_parallel.plan.spectrain import predict_spectrain

__all__: list[str] = []

Predictor = Callable[[str, StepProfile, Cluster, dict[str, Any], RunLength], Prediction]

PREDICTORS: dict[str, Predictor] = {
    "ddp": predict_ddp,
    "ddp_fp16": predict_ddp,
    "ddp_powersgd": predict_powersgd,
    "hylo": predict_hylo,
    "model_averaging": predict_averaging,
    "local_sgd": predict_averaging,
    "bmuf": predict_averaging,
    "easgd": predict_averaging,
    "diloco": predict_averaging,
    "parameter_server": predict_parameter_server,
    "async_ps": predict_parameter_server,
    "gropipe": predict_gropipe,
    "spectrain": predict_spectrain,
}

DEFAULT_SPECS = (
    "ddp",
    "ddp_powersgd",
    "hylo",
    "model_averaging",
    "diloco",
    "parameter_server",
    "gropipe",
    "spectrain",
)
"""The strategies a plan predicts when none is named."""


def predict(
    profile: StepProfile,
    cluster: Cluster,
    strategies: Sequence[tuple[str, str, dict[str, Any]]],
    run: RunLength = STEADY,
    straggler: float = 1.0,
) -> list[Prediction]:
    """One prediction per ``(spec text, strategy name, options)``; a name without a predictor
    gives a prediction that says so (never an error: the other strategies are still planned).
    ``run``: the run whose bytes per step are predicted (default: the steady state).
    ``straggler``: one worker computes this many times slower; it paces every synchronous
    strategy (each step, or each averaging step through the per-step loss all-reduce, waits
    for it) and only itself on the parameter server.

    Without a straggler the synchronous strategies still wait, every step, for the slowest of
    their replicas: their compute is the median of the slowest of ``W`` steps drawn from the
    profile's (:meth:`~lightning_parallel.plan.profile.StepProfile.slowest_replica_factor`);
    a straggler slower than that paces them instead. The parameter server's workers wait for
    no one."""
    out = []
    pace = max(straggler, profile.slowest_replica_factor(cluster.world))
    slowed = profile.scaled(pace) if pace != 1.0 else profile
    for text, name, options in strategies:
        predictor = PREDICTORS.get(name)
        if predictor is None:
            out.append(refused(text, name, f"no predictor for {name!r} yet"))
            continue
        if cluster.world < 2:
            out.append(refused(text, name, "a cluster of one process has nothing to plan"))
            continue
        if predictor is predict_parameter_server:
            options = {**options, "straggler_factor": straggler}
            out.append(predictor(text, profile, cluster, options, run))
        else:
            out.append(predictor(text, slowed, cluster, options, run))
    return out


def ranked(predictions: Sequence[Prediction]) -> list[Prediction]:
    """Fastest first (most samples per second); refusals last."""
    return sorted(
        predictions,
        key=lambda p: (
            p.refused is not None,
            -p.samples_per_s if math.isfinite(p.samples_per_s) else 0.0,
        ),
    )


def scaling(
    profile: StepProfile,
    cluster: Cluster,
    strategies: Sequence[tuple[str, str, dict[str, Any]]],
    hosts: Sequence[int],
    straggler: float = 1.0,
) -> dict[str, list[tuple[int, float, float]]]:
    """For each spec: ``(workers, median step s, samples/s)`` on ``cluster``'s links with each
    number of ``hosts`` (refused points left out)."""
    curves: dict[str, list[tuple[int, float, float]]] = {text: [] for text, _, _ in strategies}
    for count in hosts:
        sized = replace(cluster, hosts=count)
        for prediction in predict(profile, sized, strategies, straggler=straggler):
            if prediction.refused is None:
                curves[prediction.spec].append(
                    (sized.world, prediction.step_s, prediction.samples_per_s)
                )
    return curves


def table(predictions: Sequence[Prediction]) -> str:
    """A text table, one line per prediction, in the order given."""
    header = (
        f"{'spec':<40} {'step s':>8} {'mean s':>8} {'compute':>8} {'comm':>8} {'bubble':>7} "
        f"{'MB/step/host':>12} {'peak MB':>8} {'samples/s':>10}"
    )
    lines = [header, "-" * len(header)]
    for p in predictions:
        if p.refused is not None:
            lines.append(f"{p.spec:<40} refused: {p.refused}")
            continue
        peak = "-" if p.peak_rss_mb is None else f"{p.peak_rss_mb:.0f}"
        lines.append(
            f"{p.spec:<40} {p.step_s:>8.3f} {p.mean_step_s:>8.3f} {p.compute_s:>8.3f} "
            f"{p.exposed_comm_s:>8.3f} {p.bubble_s:>7.3f} "
            f"{p.wire_bytes_per_step / 2**20:>12.3f} {peak:>8} {p.samples_per_s:>10.1f}"
        )
    return "\n".join(lines)
