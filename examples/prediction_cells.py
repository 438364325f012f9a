"""Issue 43's check of the plan: ``bench --predict`` on 14 (model, link) cells, 8 strategies each,
and the bar's figures from what the runs wrote.

Each cell is one ``lightning-parallel bench --predict --hosts 2`` run of ``ddp``,
``ddp_powersgd``, ``hylo``, ``model_averaging``, ``diloco``, ``parameter_server``, ``gropipe``
and ``spectrain``, its JSON kept as ``OUT/cell_NAME.json``. The summary compares, run by run,
the prediction the bench printed (``extra.predicted_*``) with what it measured:

- the step: ``|predicted − measured| / measured`` of the median step; the median and the 90th
  percentile (nearest rank) over every run;
- the fastest strategy of a cell by the cluster's samples per second (a pipeline's samples
  counted once, not on each of its stages): right, or its measured rate within 5% of the best;
- peak memory per rank within 15% of the bench's peak RSS, bytes per step per host within 5%
  of the interface counter.

Needs root (network namespaces), about an hour on this 2-core machine; run it on an idle
machine::

    python examples/prediction_cells.py run --out cells          # every cell
    python examples/prediction_cells.py run --out cells --only gpt_10mbit
    python examples/prediction_cells.py summary --out cells [--rows]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

SPECS = (
    "ddp", "ddp_powersgd", "hylo", "model_averaging", "diloco", "parameter_server",
    "gropipe", "spectrain",
)  # fmt: skip
PIPELINES = ("gropipe", "spectrain")
IMAGES = ("--data", "user_models.Images")
TOKENS = ("--data", "user_models.Tokens")
#: name, model, bench arguments beyond the model, link, steps
CELLS: tuple[tuple[str, str, tuple[str, ...], str, int], ...] = (
    ("vgg_mini_1gbit", "vgg_mini", (), "1gbit", 60),
    ("vgg_mini_100mbit", "vgg_mini", (), "100mbit", 40),
    ("resnet18_1gbit", "resnet18", (), "1gbit", 80),
    ("resnet18_100mbit", "resnet18", (), "100mbit", 80),
    ("resnet18_10mbit", "resnet18", (), "10mbit", 60),
    ("gpt_1gbit", "gpt", (), "1gbit", 300),
    ("gpt_100mbit", "gpt", (), "100mbit", 300),
    ("gpt_10mbit", "gpt", (), "10mbit", 200),
    ("vgg16_1gbit", "vgg16", (), "1gbit", 150),
    ("vgg16_100mbit", "vgg16", (), "100mbit", 120),
    ("vgg16_10mbit", "vgg16", (), "10mbit", 60),
    ("tv_resnet18_100mbit", "user_models.Vision:name=resnet18", IMAGES, "100mbit", 50),
    (
        "timm_vit_100mbit",
        "user_models.Vision:library=timm,name=vit_tiny_patch16_224",
        IMAGES,
        "100mbit",
        100,
    ),
    ("hf_gpt2_100mbit", "user_models.Text:name=gpt2", TOKENS, "100mbit", 30),
)
USER_MODELS = Path(__file__).resolve().parent  # user_models.py, a user's file


def run_cells(out: Path, only: list[str]) -> None:
    """Run every cell (or those named in ``only``), one bench after the other."""
    out.mkdir(parents=True, exist_ok=True)
    environment = dict(os.environ)
    environment["PYTHONPATH"] = os.pathsep.join(
        filter(None, [str(USER_MODELS), environment.get("PYTHONPATH", "")])
    )
    for name, model, extra, link, steps in CELLS:
        if only and name not in only:
            continue
        command = [
            sys.executable, "-m", "lightning_parallel.cli", "bench", "--predict", "--hosts", "2",
            "--model", model, *extra, "--bandwidth", link, "--max-steps", str(steps),
            "--json", str(out / f"cell_{name}.json"),
        ]  # fmt: skip
        for spec in SPECS:
            command += ["-s", spec]
        print(" ".join(command), flush=True)
        with (out / f"cell_{name}.log").open("w") as log:
            subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, env=environment)


def _rows(out: Path) -> list[dict[str, Any]]:
    rows = []
    for name, *_ in CELLS:
        path = out / f"cell_{name}.json"
        if not path.exists():
            continue
        for run in json.loads(path.read_text())["runs"]:
            extra = run.get("extra", {})
            if not run.get("ok") or extra.get("predicted_step_s") is None:
                continue
            rows.append(
                {
                    "cell": name,
                    "spec": run["spec"],
                    "step": (extra["predicted_step_s"], run["step_time_s"]["median"]),
                    "bytes": (extra["predicted_wire_bytes_per_step"], run["wire_bytes_per_step"]),
                    "peak": (extra["predicted_peak_rss_mb"], run["peak_rss_mb"]),
                    "rate": (
                        extra["predicted_samples_per_s"],
                        run["samples_per_s"] / (2 if run["spec"] in PIPELINES else 1),
                    ),
                    "cut": (extra.get("predicted_boundaries"), extra.get("boundaries")),
                }
            )
    return rows


def _error(pair: tuple[float, float]) -> float:
    predicted, measured = pair
    return (predicted - measured) / measured if measured else math.nan


def nearest_rank(values: list[float], q: float) -> float:
    """The ``q`` quantile by nearest rank."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


def summary(out: Path, rows_too: bool) -> None:
    """Print the bar's figures (and every run with ``rows_too``)."""
    rows = _rows(out)
    if not rows:
        sys.exit(f"no cell_*.json with predictions under {out}")
    errors = [abs(_error(r["step"])) for r in rows]
    print(f"{len(rows)} runs in {len({r['cell'] for r in rows})} cells")
    median, p90 = statistics.median(errors), nearest_rank(errors, 0.9)
    print(f"median |step error| {median:.1%}, p90 {p90:.1%}")
    print(f"signed median {statistics.median(_error(r['step']) for r in rows):+.1%}")
    memory = sum(abs(_error(r["peak"])) <= 0.15 for r in rows)
    on_wire = sum(abs(_error(r["bytes"])) <= 0.05 for r in rows)
    print(f"memory within 15%: {memory} of {len(rows)}; bytes within 5%: {on_wire} of {len(rows)}")
    for spec in SPECS:
        family = [abs(_error(r["step"])) for r in rows if r["spec"] == spec]
        if family:
            print(f"  {spec:<18} median {statistics.median(family):6.1%}  max {max(family):6.1%}")
    print(
        "\n| cell | predicted fastest | measured fastest | measured rate of the predicted, "
        "over the best | right or within 5% |\n| --- | --- | --- | --- | --- |"
    )
    good = cells = 0
    for name, *_ in CELLS:
        cell = [r for r in rows if r["cell"] == name]
        if not cell:
            continue
        predicted = max(cell, key=lambda r: r["rate"][0])
        measured = max(cell, key=lambda r: r["rate"][1])
        ratio = predicted["rate"][1] / measured["rate"][1]
        cells, good = cells + 1, good + (ratio >= 0.95)
        verdict = "yes" if ratio >= 0.95 else "no"
        named = f"`{predicted['spec']}` | `{measured['spec']}`"
        print(f"| {name} | {named} | {ratio:.2f} | {verdict} |")
    print(f"\nfastest right or within 5%: {good} of {cells}")
    if rows_too:
        print(
            "\n| run | spec | step s predicted / measured | error | MB/step/host predicted / "
            "measured | peak MB predicted / measured |\n| --- | --- | --- | --- | --- | --- |"
        )
        for r in rows:
            (ps, ms), (pb, mb), (pp, mp) = r["step"], r["bytes"], r["peak"]
            cut = ""
            if r["cut"][0] is not None and r["cut"][0] != r["cut"][1]:
                cut = f" (cut at {r['cut'][1]}, the plan's at {r['cut'][0]})"
            print(
                f"| {r['cell']} | `{r['spec']}` | {ps:.3f} / {ms:.3f} | {_error(r['step']):+.1%} | "
                f"{pb / 1e6:.3f} / {mb / 1e6:.3f} ({_error(r['bytes']):+.1%}){cut} | "
                f"{pp:.0f} / {mp:.0f} ({_error(r['peak']):+.1%}) |"
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("command", choices=["run", "summary"])
    parser.add_argument("--out", type=Path, default=Path("cells"))
    parser.add_argument("--only", action="append", default=[], help="a cell's name (repeat)")
    parser.add_argument("--rows", action="store_true", help="with summary: every run's row")
    args = parser.parse_args()
    if args.command == "run":
        run_cells(args.out, args.only)
    else:
        summary(args.out, args.rows)


if __name__ == "__main__":
    main()
