"""Bench runs on hosts with a memory size: per-rank state bytes, and a run killed at the cap."""

import json
import re

import pytest

from lightning_parallel.bench.command import main as bench_main
from lightning_parallel.cluster import memory_unavailable_reason, netns_unavailable_reason

REASON = netns_unavailable_reason() or memory_unavailable_reason()
pytestmark = [
    pytest.mark.netns,
    pytest.mark.slow,
    pytest.mark.skipif(REASON is not None, reason=REASON or ""),
]


def test_a_ddp_run_records_each_ranks_parameter_gradient_and_optimizer_bytes(tmp_path):
    out = tmp_path / "out.json"
    code = bench_main(
        ["-s", "ddp", "--hosts", "2", "--latency", "0", "--model", "mlp", "--data", "digits",
         "--max-steps", "3", "--warmup-steps", "1", "--memory-per-host", "2GB",
         "--json", str(out)]
    )  # fmt: skip
    result = json.loads(out.read_text())
    (run,) = result["runs"]
    assert code == 0 and run["ok"], run["error"]
    assert result["config"]["memory_per_host"] == 2 * 10**9
    model_bytes = 4 * run["extra"]["parameters"]  # float32
    per_rank = run["extra"]["per_rank"]
    assert [rank["rank"] for rank in per_rank] == [0, 1]
    for rank in per_rank:
        # DDP: every rank holds the whole model and a gradient of each parameter; the demo's
        # SGD with momentum 0.9 holds one momentum buffer per parameter
        assert rank["param_bytes"] == rank["grad_bytes"] == model_bytes
        assert rank["optimizer_bytes"] == model_bytes
        assert 0 < rank["peak_rss_mb"] <= run["peak_rss_mb"]
    assert max(rank["peak_rss_mb"] for rank in per_rank) == run["peak_rss_mb"]


def test_a_run_killed_at_its_memory_size_is_recorded_as_out_of_memory(tmp_path, capsys):
    # a 1.2 GB model (mlp of width 6144) on hosts of 700 MB: the kernel kills it while it is built
    out = tmp_path / "out.json"
    code = bench_main(
        ["-s", "ddp", "--hosts", "2", "--latency", "0", "--model", "mlp:width=6144",
         "--max-steps", "2", "--memory-per-host", "700MB", "--timeout", "120",
         "--json", str(out)]
    )  # fmt: skip
    assert code == 1
    (run,) = json.loads(out.read_text())["runs"]
    assert not run["ok"] and run["steps"] is None
    first = run["error"].splitlines()[0]
    match = re.match(
        r"host (\d) ran out of memory: its 700 MB cap \(--memory-per-host\) was reached and the "
        r"kernel killed rank (\d)",
        first,
    )
    assert match and match.group(1) == match.group(2), first
    (oom,) = run["extra"]["out_of_memory"]
    assert oom["limit_bytes"] == 700 * 10**6 and oom["host"] == int(match.group(1))
    printed = capsys.readouterr().out
    assert "OOM" in printed and f"host {oom['host']} over its 700 MB cap" in printed
