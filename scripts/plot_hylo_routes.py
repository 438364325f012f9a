"""Plot the codec Hylo's cost model kept for each layer, from a ``bench --json`` result.

Usage::

    python scripts/plot_hylo_routes.py out.json routes.png [--spec hylo]

One horizontal bar per layer that sent at least ``--min-bytes`` (default 1 KiB: biases and
norms left out), by name: the bytes it sent in the run's last reported step, on a log scale,
coloured by its route (the hook's ``hylo/<layer>/route`` gauge,
an index into ``lightning_parallel.compression.policy.ROUTES``).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from lightning_parallel.compression.policy import ROUTES

COLOURS = {
    "dense": "#9e9e9e",
    "kernel": "#1f77b4",
    "two_bit": "#ff7f0e",
    "low_rank": "#2ca02c",
    "gather": "#9467bd",
}


def layer_routes(run: dict) -> list[tuple[str, str, float]]:
    """``(layer, route, bytes per step)`` of every layer a run's gauges name, in order."""
    gauges = run["extra"]["gauges"]
    rows = []
    for key, value in gauges.items():
        if key.startswith("hylo/") and key.endswith("/route"):
            name = key[len("hylo/") : -len("/route")]
            rows.append((name, ROUTES[int(value)], gauges.get(f"hylo/{name}/bytes", 0.0)))
    return rows


def main(argv: list[str] | None = None) -> None:
    """Draw the plot (``argv``: the command line's arguments)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("result", type=Path)
    parser.add_argument("output", type=Path)
    parser.add_argument("--spec", default="hylo", help="the run to plot (its spec)")
    parser.add_argument("--min-bytes", type=float, default=1024.0, help="smaller layers left out")
    args = parser.parse_args(argv)
    result = json.loads(args.result.read_text())
    run = next(run for run in result["runs"] if run["spec"] == args.spec)
    rows = [row for row in layer_routes(run) if row[2] >= args.min_bytes]
    if not rows:
        raise SystemExit(f"{args.spec} reported no per-layer routes (per_layer_telemetry off?)")

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(8, 0.28 * len(rows) + 1.2))
    names = [row[0] for row in rows]
    axes.barh(names, [row[2] for row in rows], color=[COLOURS[row[1]] for row in rows])
    axes.invert_yaxis()
    axes.set_xscale("log")
    axes.set_xlabel("bytes sent per step (one rank)")
    config = result["config"]
    axes.set_title(f"Hylo's codec per layer: {config['model']}, {config['bandwidth']}")
    used = sorted({row[1] for row in rows}, key=ROUTES.index)
    handles = [plt.Rectangle((0, 0), 1, 1, color=COLOURS[route]) for route in used]
    axes.legend(handles, used, fontsize=8, loc="lower right")
    figure.tight_layout()
    figure.savefig(args.output, dpi=110)
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
