"""What every rank of a benchmark run did after the injected faults (``bench --fault``).

:func:`fault_outcome` turns the cluster's record of every process (:class:`ProcessEnd`: exit
code, when it ended, whether it hung) and every rank's own result into the ``extra`` keys of
the run's JSON (``faults``, ``ranks``, ``hung``, ``orphans``, ``survivors_within_bar``), and
:func:`fault_error` into the lines the table prints under a failed run: the fault, then each
survivor's end with the library's diagnosis first. A survivor that finished its run without the
lost rank ``went_on``; one that ended did so within the bar if it ended within ``timeout + 30``
s of the first fault (:func:`spec_timeout_s`: the SPEC's ``timeout``, else torch's 30 minutes).
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from lightning_parallel.bench.specs import parse_spec
from lightning_parallel.cluster.faults import ProcessEnd, parse_fault
from lightning_parallel.cluster.launcher import ClusterRun

__all__: list[str] = []


def spec_timeout_s(spec: str) -> float:
    """The collective timeout a SPEC runs with, in seconds (``timeout=N``, else torch's 1800)."""
    value = parse_spec(spec).options.get("timeout")
    if isinstance(value, timedelta):
        return value.total_seconds()
    return float(value) if isinstance(value, (int, float)) else 1800.0


def _rank_outcome(
    end: ProcessEnd, first_fault: float | None, record: dict[str, Any] | None
) -> dict[str, Any]:
    error = None
    if record is not None and not record.get("ok"):
        error = record.get("error")
    elif end.exit_code not in (0, None):
        error = end.last_line or None
    went_on = end.exit_code == 0 and record is not None and bool(record.get("ok"))
    return {
        "rank": end.rank,
        "host": end.host,
        "faulted": end.faulted,
        "exit_code": end.exit_code,
        "end_s": end.end_s,
        "after_fault_s": end.after_fault(first_fault),
        "hung": end.hung,
        # finished its run without the faulted rank (a strategy that goes on)
        "went_on": went_on and not end.faulted,
        "out_of_memory": end.out_of_memory,
        "error": error,
    }


def fault_outcome(
    result: ClusterRun, records: list[dict[str, Any]], timeout_s: float
) -> dict[str, Any]:
    """What every rank did after the faults: the ``extra`` keys of a run with ``--fault``.

    ``survivors_within_bar``: every process no fault targeted either ended within
    ``timeout_s + 30`` s of the first fault or went on and finished its run; none hung, none
    orphaned.
    """
    by_rank = {int(r["rank"]): r for r in records}
    first = result.first_fault_s
    ranks = [_rank_outcome(end, first, by_rank.get(end.rank)) for end in result.ends]
    survivors = [r for r in ranks if not r["faulted"]]
    within = all(
        not r["hung"]
        and (
            r["went_on"]
            or (r["after_fault_s"] is not None and r["after_fault_s"] <= timeout_s + 30)
        )
        for r in survivors
    )
    return {
        "faults": [
            {"fault": str(f.fault), "applied_s": f.applied_s, "note": f.note or None}
            for f in result.faults
        ],
        "timeout_s": timeout_s,
        "ranks": ranks,
        "hung": [r["rank"] for r in survivors if r["hung"]],
        "orphans": len(result.orphans),
        "survivors_within_bar": within and not result.orphans,
    }


def _diagnosis_first(error: str) -> str:
    """The library's diagnosis line first, then the first line of the raw error."""
    lines = [line.strip() for line in error.strip().splitlines() if line.strip()]
    ours = [line for line in lines if line.startswith("[lightning_parallel]")]
    rest = [line for line in lines if not line.startswith("[lightning_parallel]")]
    return " | ".join(ours + [line[:200] for line in rest[:1]])


def fault_error(outcome: dict[str, Any]) -> str:
    lines = []
    for fault in outcome["faults"]:
        when = "not applied" if fault["applied_s"] is None else f"at {fault['applied_s']:.1f} s"
        lines.append(f"{parse_fault(fault['fault']).describe()} {when} ({fault['fault']})")
    for rank in outcome["ranks"]:
        if rank["faulted"]:
            continue
        if rank["hung"]:
            lines.append(f"rank {rank['rank']}: HUNG, killed")
            continue
        after = rank["after_fault_s"]
        timing = "" if after is None else f" {after:.1f} s after the fault"
        error = _diagnosis_first(rank["error"] or "")
        status = "finished" if rank["exit_code"] == 0 else f"ended (exit {rank['exit_code']})"
        if rank.get("out_of_memory"):
            status = "ran out of memory (killed by the kernel under its host's cap)"
        lines.append(f"rank {rank['rank']}: {status}{timing}" + (f": {error}" if error else ""))
    return "\n".join(lines)
