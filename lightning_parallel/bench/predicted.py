"""``bench --predict``: the plan's prediction beside each measured run.

Before any run starts (the machine otherwise idle), ``lightning-parallel plan`` profiles the
bench's model in a process of its own, with the bench's batch size, seed, cluster and SPECs,
and its predictions go into each run's ``extra`` (BENCH.md's ``extra`` takes more keys):

- ``predicted_step_s``: the median step the plan predicts (against ``step_time_s.median``);
- ``predicted_mean_step_s``: the mean step;
- ``predicted_peak_rss_mb``: the largest process's peak memory (against ``peak_rss_mb``);
- ``predicted_wire_bytes_per_step``: bytes per step per host at the interface (against
  ``wire_bytes_per_step``);
- ``predicted_samples_per_s``: samples per second of the whole cluster (against
  ``samples_per_s``; what the plan ranks by);
- ``predicted_refused``: why the plan expects the strategy to refuse, else null;
- ``predicted_boundaries``: a pipeline's cut as the plan expects the partition to choose it
  (against ``extra.boundaries``, the cut the run took: where they differ, so do the bytes).

Before the runs, too, the links are measured on the bench's own hosts
(:func:`~lightning_parallel.bench.links.probe_hosts`): the prediction takes their latency (what
a collective costs beyond its bytes, gloo's own time included, which ``tc`` does not set) and,
on ``--network local``, loopback's bandwidth; the JSON keeps the measurement as
``plan_links``. ``--network local`` has no shaped link and the bench counts no bytes there;
without a measurement the plan takes loopback as :data:`LOOPBACK`.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from lightning_parallel.bench.runner import BenchConfig

__all__: list[str] = []

LOOPBACK = ("20gbit", "0.02ms")
"""Bandwidth and latency the plan takes for ``--network local``'s loopback."""


def plan_argv(specs: list[str], config: BenchConfig, output: Path) -> list[str]:
    """The ``plan`` command line for the bench's settings."""
    bandwidth, latency = (
        LOOPBACK if config.network == "local" else (config.bandwidth, config.latency)
    )
    argv = [
        sys.executable, "-m", "lightning_parallel.bench.plan",
        "--model", config.model, "--data", config.data,
        "--batch-size", str(config.batch_size), "--seed", str(config.seed),
        "--hosts", str(config.hosts), "--procs-per-host", str(config.procs_per_host),
        "--bandwidth", bandwidth, "--latency", latency,
        "--scale", str(config.hosts), "--json", str(output),
        "--accelerator", config.accelerator, "--malloc", config.malloc,
    ]  # fmt: skip
    for spec in specs:
        argv += ["-s", spec]
    return argv


def take_profile(specs: list[str], config: BenchConfig) -> dict[str, Any]:
    """Profile the bench's model in a process of its own (before any run: the machine idle);
    the profile's JSON record.

    Raises:
        RuntimeError: the plan failed (its output is in the message).
    """
    with tempfile.TemporaryDirectory(prefix="lp-plan-") as directory:
        output = Path(directory) / "profile.json"
        argv = plan_argv(specs, config, Path(directory) / "plan.json")
        done = subprocess.run(
            [*argv, "--profile-json", str(output)], capture_output=True, text=True, check=False
        )
        if done.returncode != 0 or not output.exists():
            raise RuntimeError(f"bench --predict: the plan failed:\n{done.stdout}{done.stderr}")
        return dict(json.loads(output.read_text()))


def predict_runs(
    profile: dict[str, Any],
    specs: list[str],
    config: BenchConfig,
    latency_emulated: bool,
    links: dict[str, Any] | None = None,
) -> dict[str, dict[str, Any]]:
    """The plan's prediction for each SPEC, by SPEC text, on the cluster the runs had.

    With ``links`` (the probe's measurement on the bench's hosts,
    :func:`~lightning_parallel.bench.links.probe_hosts`) the links' latencies are the measured
    ones, and so is loopback's bandwidth; a shaped link keeps its configured rate. Without,
    the configured link, whose latency counts only where it was emulated (this kernel has no
    netem qdisc). The simulated hosts' token bucket lets its burst through at once after the
    link idled."""
    from lightning_parallel.bench.links import busy_receive_text, link_texts, message_latency_text
    from lightning_parallel.bench.plan import predictions_for
    from lightning_parallel.cluster.network import token_bucket_burst_bytes
    from lightning_parallel.cluster.units import parse_bandwidth

    local = config.network == "local"
    bandwidth, latency = LOOPBACK if local else (config.bandwidth, config.latency)
    if not latency_emulated:
        latency = "0"
    intra: tuple[str, str] | None = None
    message: str | None = None
    busy: str | None = None
    if links is not None:
        message, busy = message_latency_text(links), busy_receive_text(links)
        inter = link_texts(links, "inter")
        if inter is not None:
            bandwidth, latency = (inter[0] if local else bandwidth), inter[1]
        intra = link_texts(links, "intra")
    burst = 0.0
    if not local:
        burst = float(token_bucket_burst_bytes(parse_bandwidth(bandwidth)))
    record = predictions_for(
        profile, specs, hosts=config.hosts, processes_per_host=config.procs_per_host,
        bandwidth=bandwidth, latency=latency, steps=run_steps(profile, config),
        burst_bytes=burst, message_latency=message, busy_receive=busy,
        warmup_steps=config.warmup_steps,
        intra_bandwidth=intra[0] if intra else None, intra_latency=intra[1] if intra else None,
    )  # fmt: skip
    return {p["spec"]: p for p in record}


def run_steps(profile: dict[str, Any], config: BenchConfig) -> int | None:
    """The runs' length in steps: ``--max-steps``, or ``--epochs`` of the profile's data split
    over the ranks."""
    if config.max_steps is not None:
        return config.max_steps
    samples = profile.get("notes", {}).get("train_samples")
    if not samples or not config.epochs:
        return None
    per_rank = -(-samples // config.world_size)
    if profile.get("notes", {}).get("drop_last"):
        return config.epochs * (per_rank // config.batch_size)
    return config.epochs * -(-per_rank // config.batch_size)


def attach(result: dict[str, Any], predictions: dict[str, dict[str, Any]]) -> None:
    """Put each run's prediction in its ``extra``."""
    for run in result["runs"]:
        predicted = predictions.get(run["spec"])
        if predicted is None:
            continue
        run["extra"].update(
            {
                "predicted_step_s": predicted["step_s"],
                "predicted_mean_step_s": predicted["mean_step_s"],
                "predicted_peak_rss_mb": predicted["peak_rss_mb"],
                "predicted_wire_bytes_per_step": predicted["wire_bytes_per_step"],
                "predicted_samples_per_s": predicted["samples_per_s"],
                "predicted_refused": predicted["refused"],
                # a pipeline's cut as the plan expects the partition to choose it
                "predicted_boundaries": (predicted.get("detail") or {}).get("boundaries"),
            }
        )


def _ratio(predicted: float | None, measured: float | None) -> str:
    if not predicted or not measured or predicted != predicted:  # none, zero or NaN
        return "-"
    return f"{(predicted - measured) / measured:+.0%}"


def comparison(result: dict[str, Any]) -> str:
    """Predicted beside measured, one line per run with a prediction."""
    lines = [
        f"{'spec':<40} {'step s pred/meas':>18} {'err':>6} {'MB/step pred/meas':>19} "
        f"{'err':>6} {'peak MB pred/meas':>18} {'err':>6}"
    ]
    for run in result["runs"]:
        extra = run["extra"]
        if "predicted_step_s" not in extra:
            continue
        step = (run.get("step_time_s") or {}).get("median")
        wire = run.get("wire_bytes_per_step")
        peak = run.get("peak_rss_mb")
        p_step, p_wire = extra["predicted_step_s"], extra["predicted_wire_bytes_per_step"]
        p_peak = extra["predicted_peak_rss_mb"]
        lines.append(
            f"{run['spec']:<40} "
            f"{_num(p_step, 3):>8}/{_num(step, 3):<9} {_ratio(p_step, step):>6} "
            f"{_num(p_wire and p_wire / 1e6, 3):>9}/{_num(wire and wire / 1e6, 3):<9} "
            f"{_ratio(p_wire, wire):>6} "
            f"{_num(p_peak, 0):>8}/{_num(peak, 0):<9} {_ratio(p_peak, peak):>6}" + _cut_note(extra)
        )
    return "\n".join(lines)


def _cut_note(extra: dict[str, Any]) -> str:
    """A note where a pipeline's run took another cut than the plan expected (its bytes then
    differ for that reason, not the laws')."""
    taken, expected = extra.get("boundaries"), extra.get("predicted_boundaries")
    if taken is None or expected is None or list(taken) == list(expected):
        return ""
    return f"  (cut at {list(taken)}, the plan's at {list(expected)})"


def _num(value: float | None, digits: int) -> str:
    if value is None or value != value:
        return "-"
    return f"{value:.{digits}f}"
