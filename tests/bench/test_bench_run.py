"""A short benchmark on 2 simulated hosts: the JSON contract of BENCH.md, end to end."""

import json

import pytest

from lightning_parallel.bench.command import main as bench_main
from lightning_parallel.cluster import netns_unavailable_reason

REASON = netns_unavailable_reason()
pytestmark = [
    pytest.mark.netns,
    pytest.mark.slow,
    pytest.mark.skipif(REASON is not None, reason=REASON or ""),
]

CONFIG_KEYS = {"hosts", "bandwidth", "latency", "model", "data", "max_steps", "seed", "straggler",
               "torch", "lightning", "cores"}  # fmt: skip
RUN_KEYS = {"spec", "strategy", "world_size", "ok", "error", "steps", "samples", "step_time_s",
            "samples_per_s", "wire_bytes_per_step", "reported_bytes_per_step", "val_acc",
            "val_loss", "time_to_target_s", "wall_s", "peak_rss_mb", "extra"}  # fmt: skip


def test_two_host_bench_writes_the_contract(tmp_path):
    out, png = tmp_path / "out.json", tmp_path / "out.png"
    code = bench_main(
        ["-s", "ddp", "-s", "ddp_fp16", "-s", "no_such_strategy", "--hosts", "2",
         "--bandwidth", "1gbit", "--latency", "0", "--model", "convnet", "--data", "digits",
         "--max-steps", "8", "--warmup-steps", "2", "--target-acc", "0.05",
         "--json", str(out), "--plot", str(png)]
    )  # fmt: skip
    assert code == 1  # one run failed, the others went on
    result = json.loads(out.read_text())
    assert set(result["config"]) >= CONFIG_KEYS and result["config"]["hosts"] == 2
    ddp, fp16, bad = result["runs"]
    for run in result["runs"]:
        assert set(run) >= RUN_KEYS
        assert {"compression_ratio", "bubble_fraction", "staleness_mean"} <= set(run["extra"])
    assert not bad["ok"] and "unknown strategy" in bad["error"]
    for run in (ddp, fp16):
        assert run["ok"] and run["world_size"] == 2 and run["steps"] == 8
        assert run["samples"] == 8 * 2 * 32
        assert 0 < run["step_time_s"]["p10"] <= run["step_time_s"]["median"]
        assert run["step_time_s"]["median"] <= run["step_time_s"]["p90"]
        assert run["time_to_target_s"] is not None and run["time_to_target_s"] > 0
        assert run["extra"]["torch_threads"] == 1
        # the kernel's counter and the library's telemetry agree
        assert run["wire_bytes_per_step"] == pytest.approx(run["reported_bytes_per_step"], rel=0.1)
    assert fp16["extra"]["comm_hook_calls"] >= 8
    assert 0.45 <= fp16["wire_bytes_per_step"] / ddp["wire_bytes_per_step"] <= 0.6
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_a_run_whose_worker_crashes_is_recorded(tmp_path):
    out = tmp_path / "out.json"
    code = bench_main(
        ["-s", "ddp", "--hosts", "2", "--latency", "0", "--model", "mlp:no_such_argument=1",
         "--max-steps", "2", "--json", str(out), "--timeout", "120"]
    )  # fmt: skip
    assert code == 1
    (run,) = json.loads(out.read_text())["runs"]
    assert not run["ok"] and "no_such_argument" in run["error"]
    assert "exited with code 1" in run["error"]
