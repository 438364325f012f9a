"""Summarise ``lightning-parallel bench --json`` files of several seeds: means, spread, ratios.

Run the bench once per seed, then:

    python examples/seeds_table.py out/s0.json out/s1.json out/s2.json \\
        --baseline diloco:period=16 --wire-plot wire.png

prints one Markdown row per spec: wire and reported MB per step, the largest averaging round
(``extra.peak_round_bytes``), median step, time to the bench's target and final validation
accuracy, each as the mean over the files with its range (min–max), and the ratios of the
means to the ``--baseline`` spec's. ``--wire-plot`` draws the bytes the first host sent in
training so far, per spec, against steps and seconds, from the first file (the bench's
``extra.wire_trace``).
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def _values(runs: Sequence[dict[str, Any]], key: str) -> list[float]:
    found = []
    for run in runs:
        value: Any = run
        for part in key.split("."):
            value = value.get(part) if isinstance(value, dict) else None
        if isinstance(value, (int, float)):
            found.append(float(value))
    return found


def _cell(values: list[float], scale: float = 1.0, digits: int = 2) -> str:
    if not values:
        return "—"
    scaled = [v / scale for v in values]
    mean = statistics.fmean(scaled)
    if len(scaled) == 1:
        return f"{mean:.{digits}f}"
    return f"{mean:.{digits}f} ({min(scaled):.{digits}f}–{max(scaled):.{digits}f})"


COLUMNS = (  # header, key, scale, digits
    ("wire MB/step", "wire_bytes_per_step", 1e6, 2),
    ("reported MB/step", "reported_bytes_per_step", 1e6, 2),
    ("largest round MB", "extra.peak_round_bytes", 1e6, 2),
    ("median step s", "step_time_s.median", 1.0, 3),
    ("to target s", "time_to_target_s", 1.0, 1),
    ("val acc", "val_acc", 1.0, 3),
)


def table(files: Sequence[Path], baseline: str | None) -> str:
    """The Markdown table (and the ratio lines) for the bench JSON ``files``."""
    documents = [json.loads(Path(file).read_text()) for file in files]
    specs: list[str] = []
    for document in documents:
        specs += [run["spec"] for run in document["runs"] if run["spec"] not in specs]
    runs = {
        spec: [run for d in documents for run in d["runs"] if run["spec"] == spec and run["ok"]]
        for spec in specs
    }
    reached = {
        spec: sum(run["time_to_target_s"] is not None for run in runs[spec]) for spec in specs
    }
    lines = [
        "| spec | runs | " + " | ".join(header for header, *_ in COLUMNS) + " |",
        "| --- | --- | " + " | ".join("---" for _ in COLUMNS) + " |",
    ]
    for spec in specs:
        cells = [_cell(_values(runs[spec], key), scale, n) for _, key, scale, n in COLUMNS]
        cells[4] += f" ({reached[spec]}/{len(runs[spec])} reached)"
        lines.append(f"| `{spec}` | {len(runs[spec])} | " + " | ".join(cells) + " |")
    if baseline in runs:
        lines.append("")
        for spec in specs:
            if spec == baseline:
                continue
            ratios = []
            for header, key, *_ in COLUMNS[:5]:
                ours, theirs = _values(runs[spec], key), _values(runs[baseline], key)
                if ours and theirs and statistics.fmean(theirs) > 0:
                    ratio = statistics.fmean(ours) / statistics.fmean(theirs)
                    ratios.append(f"{header} {ratio:.2f}x")
            accuracy = _values(runs[spec], "val_acc"), _values(runs[baseline], "val_acc")
            if all(accuracy):
                points = 100 * (statistics.fmean(accuracy[0]) - statistics.fmean(accuracy[1]))
                ratios.append(f"val acc {points:+.1f} points")
            lines.append(f"- `{spec}` against `{baseline}` (means): " + ", ".join(ratios))
    return "\n".join(lines)


def wire_plot(file: Path, target: Path, specs: Sequence[str] = ()) -> None:
    """Megabytes the first host sent so far, after every step and against time, one line per
    spec (``specs``: only those; needs matplotlib): a round is a stair, as high as the bytes
    it sent."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    document = json.loads(Path(file).read_text())
    figure, (by_step, by_time) = plt.subplots(1, 2, figsize=(11, 4))
    for run in document["runs"]:
        trace = (run.get("extra") or {}).get("wire_trace") or []
        if not trace or (specs and run["spec"] not in specs):
            continue
        sent = [0.0] + [point[1] / 1e6 for point in trace]
        by_step.step(range(len(sent)), sent, where="post", label=run["spec"], linewidth=1)
        by_time.plot([0.0] + [point[0] for point in trace], sent, label=run["spec"], linewidth=1)
    config = document["config"]
    by_step.set_xlabel("training step")
    by_time.set_xlabel("seconds of training")
    for axis in (by_step, by_time):
        axis.set_ylabel("MB sent by host 0 so far")
        axis.grid(alpha=0.3)
    by_step.legend(fontsize=7)
    figure.suptitle(
        f"{config['model']} on {config['data']}, {config['hosts']} hosts at "
        f"{config['bandwidth']}, seed {config['seed']}: bytes on the wire"
    )
    figure.tight_layout()
    figure.savefig(target, dpi=110)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="+", type=Path, help="bench --json files, one per seed")
    parser.add_argument("--baseline", help="the spec the ratios are taken against")
    parser.add_argument("--wire-plot", type=Path, help="PNG of bytes on the wire over time")
    parser.add_argument(
        "--plot-spec", action="append", default=[], help="draw only this spec (repeatable)"
    )
    args = parser.parse_args(argv)
    print(table(args.files, args.baseline))
    if args.wire_plot is not None:
        wire_plot(args.files[0], args.wire_plot, args.plot_spec)
        print(f"wrote {args.wire_plot}")


if __name__ == "__main__":
    main()
