"""Summarise ``lightning-parallel bench --fault`` runs against runs without the fault.

Run the bench once without a fault and once per fault, for each seed, with ``--log-dir`` on the
fault runs (the workers' logs are read for the line that names the lost rank), then:

    python examples/fault_runs_table.py --clean none_s0.json none_s1.json \\
        --faulted kill_s0.json freeze_s0.json kill_s1.json freeze_s1.json

prints one Markdown row per (spec, fault): how many runs had every survivor finish
(``went_on``), how many had every survivor log the loss (``was lost`` in each survivor's lines
of the run's log), the survivors' final validation accuracy (mean and range over the seeds), the
same spec's accuracy without the fault over the same seeds, the difference in points, and for
runs that ended instead: the seconds from the fault to the survivors' last exit and whether
that is within the bench's bar (``extra.survivors_within_bar``: ``timeout + 30`` s).
``--per-seed`` adds a table of each seed's final accuracy with and without the fault, and the
median of the differences.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def _runs(files: Sequence[Path]) -> list[tuple[int, dict[str, Any]]]:
    """``(seed, run)`` for every run of every file."""
    found = []
    for file in files:
        document = json.loads(Path(file).read_text())
        seed = int(document["config"]["seed"])
        found.extend((seed, run) for run in document["runs"])
    return found


def _spread(values: list[float], digits: int = 3) -> str:
    if not values:
        return "—"
    mean = statistics.fmean(values)
    if len(values) == 1:
        return f"{mean:.{digits}f}"
    return f"{mean:.{digits}f} ({min(values):.{digits}f}–{max(values):.{digits}f})"


def _logged_loss(run: dict[str, Any]) -> bool:
    """Whether every survivor's lines of the run's log name the lost rank."""
    extra = run.get("extra") or {}
    path = extra.get("log")
    if not path or not Path(path).is_file():
        return False
    text = Path(path).read_text(errors="replace")
    survivors = [r["rank"] for r in extra.get("ranks", []) if not r["faulted"]]
    return bool(survivors) and all(
        re.search(rf"rank {rank}: replica rank \d+ was lost", text) for rank in survivors
    )


def table(clean: Sequence[Path], faulted: Sequence[Path]) -> str:
    """The Markdown table for the runs without and with faults."""
    without: dict[tuple[str, int], float] = {}
    for seed, run in _runs(clean):
        if run.get("val_acc") is not None:
            without[(_base(run["spec"]), seed)] = float(run["val_acc"])
    rows: dict[tuple[str, str], list[tuple[int, dict[str, Any]]]] = defaultdict(list)
    for seed, run in _runs(faulted):
        faults = (run.get("extra") or {}).get("faults") or []
        rows[(run["spec"], " ".join(f["fault"] for f in faults))].append((seed, run))
    lines = [
        "| spec | fault | survivors finished | logged the loss | val acc | without the fault "
        "| Δ points | ended: s after the fault | within timeout + 30 s |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for (spec, fault), runs in rows.items():
        went_on = [
            all(r["went_on"] for r in run["extra"]["ranks"] if not r["faulted"]) for _, run in runs
        ]
        logged = [_logged_loss(run) for _, run in runs]
        accuracy = [float(run["val_acc"]) for _, run in runs if all(went_on) and run["val_acc"]]
        reference = [without.get((_base(spec), seed)) for seed, _ in runs]
        known = [value for value in reference if value is not None]
        delta = (
            f"{100 * (statistics.fmean(accuracy) - statistics.fmean(known)):+.1f}"
            if accuracy and len(known) == len(accuracy)
            else "—"
        )
        ended = [
            max(r["after_fault_s"] or 0.0 for r in run["extra"]["ranks"] if not r["faulted"])
            for _, run in runs
            if not all(r["went_on"] for r in run["extra"]["ranks"] if not r["faulted"])
        ]
        within = all(run["extra"].get("survivors_within_bar") for _, run in runs)
        lines.append(
            f"| `{spec}` | `{fault}` | {sum(went_on)}/{len(runs)} | {sum(logged)}/{len(runs)} "
            f"| {_spread(accuracy) if all(went_on) else '—'} | {_spread(known)} | "
            f"{delta if all(went_on) else '—'} | {_spread(ended, 1)} | "
            f"{'yes' if within else 'no'} |"
        )
    return "\n".join(lines)


def per_seed(clean: Sequence[Path], faulted: Sequence[Path]) -> str:
    """Each seed's final accuracy with the fault and without it, for the runs that went on."""
    without = {(_base(run["spec"]), seed): run.get("val_acc") for seed, run in _runs(clean)}
    rows: dict[tuple[str, str], dict[int, tuple[float, float | None]]] = defaultdict(dict)
    for seed, run in _runs(faulted):
        survivors = [r for r in run["extra"]["ranks"] if not r["faulted"]]
        if run.get("val_acc") is None or not all(r["went_on"] for r in survivors):
            continue
        fault = " ".join(f["fault"] for f in run["extra"].get("faults") or [])
        reference = without.get((_base(run["spec"]), seed))
        rows[(run["spec"], fault)][seed] = (float(run["val_acc"]), reference)
    seeds = sorted({seed for row in rows.values() for seed in row})
    lines = [
        "| spec | fault | " + " | ".join(f"seed {s}" for s in seeds) + " | median Δ points |",
        "| --- | --- | " + " | ".join("---" for _ in seeds) + " | --- |",
    ]
    for (spec, fault), row in rows.items():
        cells = []
        for seed in seeds:
            acc, ref = row.get(seed, (None, None))
            cells.append(
                "—" if acc is None else f"{acc:.3f}" + ("" if ref is None else f" / {ref:.3f}")
            )
        deltas = [100 * (acc - ref) for acc, ref in row.values() if ref is not None]
        median = f"{statistics.median(deltas):+.1f}" if deltas else "—"
        lines.append(f"| `{spec}` | `{fault}` | " + " | ".join(cells) + f" | {median} |")
    return "\n".join(lines)


def _base(spec: str) -> str:
    """The spec without the options that only say what a fault does."""
    name, _, options = spec.partition(":")
    kept = [
        item
        for item in filter(None, options.split(","))
        if item.split("=")[0] not in ("worker_loss", "heartbeat_timeout", "timeout")
    ]
    return name + (":" + ",".join(kept) if kept else "")


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clean", type=Path, nargs="+", required=True, help="runs without faults")
    parser.add_argument("--faulted", type=Path, nargs="+", required=True, help="runs with faults")
    parser.add_argument("--per-seed", action="store_true", help="each seed: with / without")
    args = parser.parse_args(argv)
    print(table(args.clean, args.faulted))
    if args.per_seed:
        print()
        print(per_seed(args.clean, args.faulted))


if __name__ == "__main__":
    main()
