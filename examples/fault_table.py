"""The fault table: every strategy family under kill, freeze and link faults, on 2 simulated hosts.

For each family (a SPEC and the rank the faults target) and each fault kind, one benchmark run
(:func:`lightning_parallel.bench.run_benchmark`) trains ``mlp`` on digits with
``timeout=TIMEOUT`` and injects ``KIND:TARGET@AT``; the table gives, for every surviving rank,
the seconds from the fault to its exit (or ``went on``: it finished the run without the lost
rank, as the parameter server does without a worker), whether every survivor is within
``timeout + 30`` s, hangs and orphaned processes. Runs that end on the fault are given 100,000
steps; the parameter server's, which go on, 3,000 (a minute of training), so that they end.
Needs root (network namespaces)::

    python examples/fault_table.py --json fault_table.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from lightning_parallel.bench import BenchConfig, run_benchmark

# (family, SPEC without timeout, rank the faults target: link faults cut that rank's host,
# max_steps)
FAMILIES = [
    ("ddp-based + Hylo", "hylo", 1, 100_000),
    ("model averaging", "model_averaging:period=4", 1, 100_000),
    ("parameter server: worker", "parameter_server", 1, 3_000),
    ("parameter server: server host", "parameter_server", 0, 3_000),
    ("gropipe", "gropipe:stages=2", 1, 100_000),
    ("spectrain", "spectrain:stages=2", 1, 100_000),
]
KINDS = ("kill", "freeze", "link")


def _row(family: str, kind: str, run: dict[str, Any]) -> dict[str, Any]:
    extra = run["extra"]
    survivors = [r for r in extra.get("ranks", []) if not r["faulted"]]
    return {
        "family": family,
        "spec": run["spec"],
        "fault": ", ".join(f["fault"] for f in extra.get("faults", [])),
        "kind": kind,
        "after_fault_s": [r["after_fault_s"] for r in survivors],
        "went_on": [r["went_on"] for r in survivors],
        "exit_codes": [r["exit_code"] for r in survivors],
        "hung": len(extra.get("hung", [])),
        "orphans": extra.get("orphans"),
        "within_bar": extra.get("survivors_within_bar"),
        "ok": run["ok"],
        "error": run["error"],
    }


def _survivors(row: dict[str, Any]) -> str:
    """Each survivor: seconds from the fault to its exit, or that it went on and finished."""
    return ", ".join(
        "went on" if went_on else ("-" if after is None else f"{after:.1f}")
        for after, went_on in zip(row["after_fault_s"], row["went_on"])
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--timeout", type=int, default=20, help="collective timeout (s)")
    parser.add_argument("--at", type=float, default=25.0, help="seconds after start")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--family", action="append", default=None, help="only these SPECs")
    parser.add_argument("--kind", action="append", default=None, choices=KINDS)
    args = parser.parse_args()
    rows = []
    for family, spec, target, max_steps in FAMILIES:
        if args.family and spec not in args.family:
            continue
        for kind in args.kind or KINDS:
            fault = f"{kind}:{target}@{args.at:g}"
            config = BenchConfig(
                hosts=2, model="mlp", data="digits", max_steps=max_steps, faults=[fault]
            )
            config.timeout = args.timeout + args.at + 600.0
            timed = spec + ("," if ":" in spec else ":") + f"timeout={args.timeout}"
            result = run_benchmark([timed], config)
            row = _row(family, kind, result["runs"][0])
            rows.append(row)
            after = _survivors(row)
            print(
                f"{family:32s} {fault:12s} survivors (s from fault to exit): {after}; "
                f"hung {row['hung']}, "
                f"orphans {row['orphans']}, within timeout+30: {row['within_bar']}",
                flush=True,
            )
    print()
    print(
        f"| family | fault | survivors: s from fault to exit | within {args.timeout}+30 s "
        "| hangs | orphans |"
    )
    print("| --- | --- | --- | --- | --- | --- |")
    for row in rows:
        after = _survivors(row)
        print(
            f"| {row['family']} | `{row['fault']}` | {after} | "
            f"{'yes' if row['within_bar'] else 'NO'} | {row['hung']} | {row['orphans']} |"
        )
    if args.json is not None:
        args.json.write_text(json.dumps({"timeout_s": args.timeout, "rows": rows}, indent=1))
    return 0 if all(row["within_bar"] for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
