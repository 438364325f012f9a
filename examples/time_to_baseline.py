"""Time each spec took to reach the baseline's final accuracy, seed by seed, as a ratio.

Run the bench once per seed with the baseline among the specs, then:

    python examples/time_to_baseline.py s0.json s1.json s2.json --baseline ddp

For each seed the target is the baseline's final validation accuracy, and the baseline's own
time is the training wall time at its first validation that reached it (its last one at the
latest). Each spec's time is read the same way from its validations (``val_history``: training
wall time, step, accuracy, loss), so both stand on the validation points the bench recorded.
Prints one Markdown row per spec: for each seed the seconds to the target with the ratio to the
baseline's (``never`` if the spec did not reach it, with the best accuracy it did reach and
when, so that a run one validation sample short reads as such), the largest ratio, and the wire
bytes per step against the baseline's (the kernel's counters; the reported bytes where there are
none).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def time_to(run: dict[str, Any], target: float) -> float | None:
    """Training wall time at the first validation whose accuracy reached ``target``."""
    for seconds, _step, accuracy, *_ in run.get("val_history") or []:
        if accuracy >= target:
            return float(seconds)
    return None


def best(run: dict[str, Any]) -> tuple[float, float] | None:
    """The highest validation accuracy and the training wall time it was first reached at."""
    history = run.get("val_history") or []
    points = [(float(accuracy), float(seconds)) for seconds, _step, accuracy, *_ in history]
    if not points:
        return None
    top = max(accuracy for accuracy, _ in points)
    return top, min(seconds for accuracy, seconds in points if accuracy == top)


def _bytes_per_step(run: dict[str, Any]) -> float | None:
    value = run.get("wire_bytes_per_step") or run.get("reported_bytes_per_step")
    return float(value) if value else None


def table(documents: Sequence[dict[str, Any]], baseline: str) -> list[str]:
    """The Markdown rows: header, rule, then one row per spec in the files' order."""
    seeds = [int(document["config"]["seed"]) for document in documents]
    specs: list[str] = []
    for document in documents:
        specs += [run["spec"] for run in document["runs"] if run["spec"] not in specs]
    header = ["spec", *(f"seed {seed}" for seed in seeds), "largest ratio", "bytes vs baseline"]
    rows = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    for spec in specs:
        cells, ratios, byte_ratios = [], [], []
        for document in documents:
            runs = {run["spec"]: run for run in document["runs"] if run.get("ok")}
            base, run = runs.get(baseline), runs.get(spec)
            if base is None or run is None:
                cells.append("—")
                continue
            sent, base_sent = _bytes_per_step(run), _bytes_per_step(base)
            if sent is not None and base_sent:
                byte_ratios.append(sent / base_sent)
            target = float(base["val_acc"])
            base_s, seconds = time_to(base, target), time_to(run, target)
            if seconds is None or not base_s:
                short, reached = "", best(run)
                if reached is not None and base_s:
                    accuracy, at = reached
                    short = f"; best {accuracy:.3f} at {at:.1f} s, {at / base_s:.2f}x"
                cells.append(f"never (to {target:.3f}{short})")
                ratios.append(float("inf"))
                continue
            ratios.append(seconds / base_s)
            cells.append(f"{seconds:.1f} s ({ratios[-1]:.2f}x, to {target:.3f})")
        largest = (
            "—" if not ratios else "never" if max(ratios) == float("inf") else f"{max(ratios):.2f}x"
        )
        spread = f"{min(byte_ratios):.3f}x–{max(byte_ratios):.3f}x" if byte_ratios else "—"
        rows.append("| " + " | ".join([f"`{spec}`", *cells, largest, spread]) + " |")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("files", nargs="+", type=Path, help="bench --json files, one per seed")
    parser.add_argument("--baseline", default="ddp", help="the spec whose accuracy is the target")
    args = parser.parse_args()
    documents = [json.loads(path.read_text()) for path in args.files]
    print("\n".join(table(documents, args.baseline)))


if __name__ == "__main__":
    main()
