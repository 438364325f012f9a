"""Every registered strategy on resnet18, gpt and recommender, through the benchmark.

For each model, one ``lightning-parallel bench -s all`` run (every strategy name of this
package, Lightning's ``ddp`` and the pipeline peers) on 2 simulated hosts for a dozen steps,
each model on the data of its kind at its default size. Prints a markdown table of model by
strategy: ``fits`` with the validation accuracy, ``refused`` with the reason, or ``FAILED``
with the error; exits 1 if any run failed without refusing. Needs root (network namespaces)::

    python examples/bench_matrix.py --out matrix
    python examples/bench_matrix.py --models gpt --steps 4 --out matrix
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

MODELS = ("resnet18", "gpt", "recommender")


def bench(model: str, steps: int, out: Path) -> dict[str, Any]:
    """Run the benchmark of every strategy on ``model``; its BENCH.md object."""
    path = out / f"{model}.json"
    command = [
        sys.executable, "-m", "lightning_parallel.cli", "bench", "-s", "all",
        "--model", model, "--hosts", "2", "--max-steps", str(steps), "--warmup-steps", "2",
        "--log-dir", str(out / f"{model}-logs"), "--json", str(path),
    ]  # fmt: skip
    subprocess.run(command, check=False)
    return json.loads(path.read_text())


def cell(run: dict[str, Any]) -> str:
    """One table cell: fits (accuracy), refused: reason, or FAILED: error."""
    if run["ok"]:
        return f"fits (val acc {run['val_acc']:.2f})"
    first = (str(run["error"]).strip().splitlines() or [""])[0].replace("|", "/")
    return f"{'refused' if run.get('refused') else 'FAILED'}: {first[:160]}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS))
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--out", type=Path, default=Path("bench-matrix"))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    results = {model: bench(model, args.steps, args.out) for model in args.models}
    specs = [run["spec"] for run in next(iter(results.values()))["runs"]]
    print("| strategy | " + " | ".join(args.models) + " |")
    print("| --- |" + " --- |" * len(args.models))
    failed = 0
    for index, spec in enumerate(specs):
        cells = []
        for model in args.models:
            run = results[model]["runs"][index]
            failed += not run["ok"] and not run.get("refused")
            cells.append(cell(run))
        print(f"| `{spec}` | " + " | ".join(cells) + " |")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
