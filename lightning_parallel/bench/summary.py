"""One BENCH.md run record from the per-rank records of a finished run.

Each rank of a run writes its own record (:mod:`~lightning_parallel.bench.worker`); the run's
record pools them (``BENCH.md`` names every field):

1. step times are pooled over the ranks after the first ``warmup_steps`` steps of each (fewer
   where a rank took fewer); the median, 10th and 90th percentiles are interpolated between
   the nearest ranks;
2. ``samples_per_s`` sums, over the ranks, the samples their steady steps trained over those
   steps' time: a batch the strategy did not train (a parameter-server worker's skipped batch)
   counts no samples;
3. ``wire_bytes_per_step`` is the interface counter of each host's first process over the run's
   steps, averaged over hosts; ``reported_bytes_per_step`` sums the bytes a host's processes
   reported, averaged over hosts;
4. accuracy and loss are the last validation's; ``time_to_target_s`` the first validation at
   or above ``target_acc``;
5. ``extra.per_rank[i]`` keeps rank ``i``'s own figures, among them the parameter, gradient and
   optimizer bytes it held at train end and its peak RSS.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from lightning_parallel.bench.runner import BenchConfig

__all__: list[str] = []


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    position = (len(ordered) - 1) * q
    low, high = math.floor(position), math.ceil(position)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def failed_record(
    spec: str, name: str, world_size: int, error: str, **extra: Any
) -> dict[str, Any]:
    """The record of a run that failed or was refused: every figure ``None``, ``extra`` kept."""
    return {
        "spec": spec,
        "strategy": name,
        "world_size": world_size,
        "ok": False,
        "refused": False,
        "error": error,
        "steps": None,
        "samples": None,
        "step_time_s": None,
        "samples_per_s": None,
        "wire_bytes_per_step": None,
        "reported_bytes_per_step": None,
        "val_acc": None,
        "val_loss": None,
        "time_to_target_s": None,
        "wall_s": None,
        "peak_rss_mb": None,
        "extra": {"compression_ratio": None, "bubble_fraction": None, "staleness_mean": None}
        | extra,
    }


def _finite(value: float) -> float | None:
    return value if math.isfinite(value) else None


def summarize(
    spec: str, name: str, records: list[dict[str, Any]], config: BenchConfig
) -> dict[str, Any]:
    """One BENCH.md run record from the per-rank worker records (all ``ok``)."""
    records = sorted(records, key=lambda r: r["rank"])
    lead = records[0]
    steps = int(lead["steps"])
    warmup = min(config.warmup_steps, max(0, len(lead["step_seconds"]) - 1))
    steady = [t for r in records for t in r["step_seconds"][warmup:]]
    per_rank: list[dict[str, Any]] = []
    for record in records:
        seconds = sum(record["step_seconds"][warmup:])
        count = len(record["step_seconds"][warmup:])
        per_step = record["samples"] / max(1, len(record["step_seconds"]))
        # the samples of the steady steps themselves: a parameter-server worker's steady window
        # can hold a batch it did not train (no samples, hardly any time)
        by_step = record.get("step_samples")
        trained = sum(by_step[warmup:]) if by_step is not None else per_step * count
        per_rank.append(
            {
                "rank": record["rank"],
                "steps": len(record["step_seconds"]),
                "samples_per_s": trained / seconds if seconds > 0 else 0.0,
                "step_seconds_sum": sum(record["step_seconds"]),
                "train_seconds": record["train_seconds"],
                "param_bytes": record.get("param_bytes"),
                "grad_bytes": record.get("grad_bytes"),
                "optimizer_bytes": record.get("optimizer_bytes"),
                "peak_rss_mb": record.get("peak_rss_mb"),
            }
        )
    samples_per_s = sum(rank["samples_per_s"] for rank in per_rank)
    hosts = sorted({r["node_rank"] for r in records})
    wire = [
        r["tx_bytes"] / steps for r in records if r["local_rank"] == 0 and r["tx_bytes"] is not None
    ]
    reported = [
        sum(r["reported_bytes"] for r in records if r["node_rank"] == host) / steps
        for host in hosts
    ]
    validations = lead["validations"]
    final = validations[-1] if validations else {"val_acc": math.nan, "val_loss": math.nan}
    reached = [v["wall_s"] for v in validations if v["val_acc"] >= config.target_acc]
    gauges = lead.get("gauges", {})
    reported_per_step = sum(reported) / len(reported) if reported else 0.0
    compression = gauges.get("compression_ratio")
    if compression is None and lead.get("data_parallel") and reported_per_step > 0:
        compression = lead["dense_allreduce_bytes"] * config.procs_per_host / reported_per_step
    return {
        "spec": spec,
        "strategy": name,
        "world_size": len(records),
        "ok": True,
        "refused": False,
        "error": None,
        "steps": steps,
        "samples": sum(r["samples"] for r in records),
        "step_time_s": {
            "median": _percentile(steady, 0.5),
            "p10": _percentile(steady, 0.1),
            "p90": _percentile(steady, 0.9),
        },
        "samples_per_s": samples_per_s,
        "wire_bytes_per_step": sum(wire) / len(wire) if wire else None,
        "reported_bytes_per_step": reported_per_step,
        "val_acc": _finite(final["val_acc"]),
        "val_loss": _finite(final["val_loss"]),
        "time_to_target_s": reached[0] if reached else None,
        "wall_s": max(r["train_seconds"] for r in records),
        "peak_rss_mb": max(r["peak_rss_mb"] for r in records),
        "val_history": [
            [v["wall_s"], v["step"], _finite(v["val_acc"]), _finite(v["val_loss"])]
            for v in validations
        ],
        "extra": {
            "compression_ratio": compression,
            "bubble_fraction": gauges.get("bubble_fraction"),
            "staleness_mean": gauges.get("staleness_mean"),
            "peak_round_bytes": gauges.get("peak_round_bytes"),
            "warmup_steps_excluded": warmup,
            "wire_bytes_per_step_per_host": wire,
            # the first host's interface after every step: [seconds, bytes sent so far]
            "wire_trace": next(
                (r.get("tx_trace") for r in records if r["local_rank"] == 0 and r["tx_bytes"]),
                None,
            ),
            "reported_bytes_per_step_per_host": reported,
            "comm_seconds_per_step": sum(r["comm_seconds"] for r in records)
            / (len(records) * max(1, steps)),
            "dense_allreduce_bytes_per_process": lead["dense_allreduce_bytes"],
            "parameters": lead["parameters"],
            "strategy_class": lead["strategy_class"],
            "comm_hook_calls": lead.get("hook_calls"),
            "boundaries": lead.get("boundaries"),
            "straggler_delay_s": max(r["straggler_delay_s"] for r in records),
            "torch_threads": max(r["torch_threads"] for r in records),
            # every rank held the memory it freed (--malloc held, glibc)
            "freed_memory_held": all(r.get("freed_memory_held", False) for r in records),
            "per_rank": per_rank,
            "gauges": gauges,
        },
    }
