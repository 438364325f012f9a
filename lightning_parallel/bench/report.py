"""Show a benchmark result: a rich table in the terminal, the JSON file and a PNG plot.

The plot has three panels: validation accuracy against training wall time per strategy (the
target accuracy as a dashed line), bytes per step and host (wire and reported side by side),
and samples per second.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from lightning_parallel.cluster.units import format_memory_size

__all__: list[str] = []


def _number(value: Any, digits: int = 2, scale: float = 1.0) -> str:
    if value is None:
        return "-"
    return f"{value / scale:.{digits}f}"


def setting(config: dict[str, Any]) -> str:
    """One line that says what a run measured: model, data, hosts, device, link, length, seed."""
    latency = config["latency"] + (
        "" if config.get("latency_emulated", True) else " (not emulated)"
    )
    steps = f"{config['max_steps']} steps" if config.get("max_steps") else f"{config['epochs']} ep"
    link = (
        "loopback (unshaped)"
        if config.get("network") == "local"
        else f"{config['bandwidth']}, latency {latency}"
    )
    device = ", CUDA" if config.get("accelerator") == "cuda" else ""
    return (
        f"{config['model']} on {config['data']}, {config['hosts']} hosts x "
        f"{config.get('procs_per_host', 1)} procs{device}, {link}, "
        f"{steps}, seed {config['seed']}"
        + (f", straggler {config['straggler']}" if config.get("straggler") else "")
        + (
            f", memory {format_memory_size(config['memory_per_host'])} per host"
            if config.get("memory_per_host")
            else ""
        )
        + (", the C library's malloc defaults" if config.get("malloc") == "system" else "")
    )


def table(result: dict[str, Any]) -> Table:
    """The comparison table of ``result`` (a BENCH.md object)."""
    config = result["config"]
    grid = Table(title=escape(setting(config)))
    columns = [
        ("spec", "left"),
        ("world", "right"),
        ("steps", "right"),
        ("step s (p10-p90)", "right"),
        ("samples/s", "right"),
        ("wire MB/step", "right"),
        ("reported MB/step", "right"),
        ("wire/rep", "right"),
        ("val acc", "right"),
        (f"to {config.get('target_acc', 0):.2f} s", "right"),
        ("wall s", "right"),
        ("peak RSS MB", "right"),
    ]
    for header, justify in columns:
        grid.add_column(header, justify=justify, no_wrap=True)  # type: ignore[arg-type]
    for run in result["runs"]:
        if not run["ok"]:
            first = str(run["error"]).strip().splitlines()
            status, reason = "FAILED", (first[0] if first else "")[:60]
            if run.get("refused"):
                status = "REFUSED"
            killed = run["extra"].get("out_of_memory")
            if killed:
                size = format_memory_size(killed[0]["limit_bytes"])
                status, reason = "OOM", f"host {killed[0]['host']} over its {size} cap"
            grid.add_row(
                escape(run["spec"]), str(run["world_size"]), f"[red]{status}[/red]",
                f"[red]{escape(reason)}[/red]", *["-"] * 8,
            )  # fmt: skip
            continue
        step = run["step_time_s"]
        wire, reported = run["wire_bytes_per_step"], run["reported_bytes_per_step"]
        agreement = f"{wire / reported:.3f}" if wire and reported else "-"
        grid.add_row(
            escape(run["spec"]),
            str(run["world_size"]),
            str(run["steps"]),
            f"{step['median']:.3f} ({step['p10']:.3f}-{step['p90']:.3f})",
            _number(run["samples_per_s"], 1),
            _number(wire, 2, 1e6),
            _number(reported, 2, 1e6),
            agreement,
            _number(run["val_acc"], 3),
            _number(run["time_to_target_s"], 1),
            _number(run["wall_s"], 1),
            _number(run["peak_rss_mb"], 0),
        )
    return grid


def print_table(result: dict[str, Any], console: Console | None = None) -> None:
    """Print the table, then the full error of every failed run."""
    console = console or Console(width=None if sys.stdout.isatty() else 200)
    console.print(table(result))
    for run in result["runs"]:
        if not run["ok"]:
            verb = "refused" if run.get("refused") else "failed"
            console.print(f"[red]{escape(run['spec'])} {verb}:[/red] {escape(str(run['error']))}")
            if run["extra"].get("log"):
                console.print(f"  log: {run['extra']['log']}", markup=False)
    if not result["config"].get("latency_emulated", True):
        console.print(
            "[yellow]latency was not emulated: this kernel has no netem qdisc; links were "
            "shaped to the bandwidth only[/yellow]"
        )


def write_json(result: dict[str, Any], path: Path) -> None:
    """Write the BENCH.md JSON object."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")


def plot(result: dict[str, Any], path: Path) -> None:
    """Save the three-panel PNG: accuracy vs wall time, bytes per step, samples/s."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as error:
        raise ModuleNotFoundError(
            "bench --plot draws with matplotlib: pip install 'lightning-parallel[bench]'"
        ) from error

    runs = [run for run in result["runs"] if run["ok"]]
    config = result["config"]
    figure, (accuracy, traffic, speed) = plt.subplots(
        1, 3, figsize=(16, 4.8), gridspec_kw={"width_ratios": [1.4, 1, 1]}
    )
    for run in runs:
        history = run.get("val_history") or []
        accuracy.plot(
            [0.0] + [row[0] for row in history],
            [None] + [row[2] for row in history],
            marker="o",
            label=run["spec"],
        )
    accuracy.axhline(config.get("target_acc", 0.9), color="grey", linestyle="--", linewidth=1)
    accuracy.set(xlabel="training wall time (s)", ylabel="validation accuracy")
    accuracy.set_title("accuracy against wall time")
    if runs:
        accuracy.legend(fontsize=8)
    names = [run["spec"] for run in runs]
    positions = list(range(len(runs)))
    width = 0.4
    traffic.bar(
        [p - width / 2 for p in positions],
        [(run["wire_bytes_per_step"] or 0) / 1e6 for run in runs],
        width,
        label="wire (interface counter)",
    )
    traffic.bar(
        [p + width / 2 for p in positions],
        [(run["reported_bytes_per_step"] or 0) / 1e6 for run in runs],
        width,
        label="reported (library)",
    )
    traffic.set_xticks(positions, names, rotation=20, ha="right", fontsize=8)
    traffic.set(ylabel="MB sent per step and host")
    traffic.set_title("bytes per step")
    traffic.legend(fontsize=8)
    speed.bar(positions, [run["samples_per_s"] for run in runs], color="tab:green")
    speed.set_xticks(positions, names, rotation=20, ha="right", fontsize=8)
    speed.set(ylabel="samples / s (all processes)")
    speed.set_title("throughput")
    figure.suptitle(setting(config), fontsize=11)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    plt.close(figure)
