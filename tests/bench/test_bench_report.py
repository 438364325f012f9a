import io
import json

import pytest
from rich.console import Console

from lightning_parallel.bench.report import plot, print_table, setting, write_json
from lightning_parallel.bench.runner import BenchConfig
from lightning_parallel.bench.summary import summarize

BENCH_RUN_KEYS = {
    "spec", "strategy", "world_size", "ok", "error", "steps", "samples", "step_time_s",
    "samples_per_s", "wire_bytes_per_step", "reported_bytes_per_step", "val_acc", "val_loss",
    "time_to_target_s", "wall_s", "peak_rss_mb", "extra",
}  # fmt: skip


def _record(rank, node_rank, local_rank, step_seconds, tx_bytes):
    return {
        "ok": True, "rank": rank, "node_rank": node_rank, "local_rank": local_rank,
        "world_size": 4, "strategy_class": "DDPStrategy", "data_parallel": True, "steps": 10,
        "samples": 10 * 8, "batch_size": 8, "step_seconds": step_seconds,
        "validations": [
            {"wall_s": 2.0, "step": 5.0, "val_acc": 0.6, "val_loss": 1.0},
            {"wall_s": 4.0, "step": 10.0, "val_acc": 0.95, "val_loss": 0.2},
        ],
        "train_seconds": 5.0 + rank, "interface": "x", "tx_bytes": tx_bytes,
        "reported_bytes": 1000.0, "reported_steps": 10, "comm_seconds": 1.0,
        "dense_allreduce_bytes": 1000.0 / 10, "parameters": 100, "gauges": {},
        "hook_calls": None, "straggler_delay_s": 0.0, "torch_threads": 1,
        "peak_rss_mb": 100.0 + rank,
    }  # fmt: skip


def test_summary_follows_the_contract_and_counts_per_host():
    # 2 hosts x 2 processes; only local rank 0 reads the host's interface counter
    steps = [1.0] * 2 + [0.5] * 8  # two warm-up steps, then 0.5 s
    records = [
        _record(0, 0, 0, steps, 4400),
        _record(1, 0, 1, steps, None),
        _record(2, 1, 0, steps, 4000),
        _record(3, 1, 1, steps, None),
    ]
    config = BenchConfig(hosts=2, procs_per_host=2, max_steps=10, target_acc=0.9, warmup_steps=2)
    run = summarize("ddp", "ddp", records, config)
    assert set(run) >= BENCH_RUN_KEYS
    assert run["ok"] and run["world_size"] == 4 and run["steps"] == 10
    assert run["step_time_s"] == {"median": 0.5, "p10": 0.5, "p90": 0.5}
    assert run["samples_per_s"] == pytest.approx(4 * 8 / 0.5)
    assert run["wire_bytes_per_step"] == pytest.approx((440 + 400) / 2)
    assert run["reported_bytes_per_step"] == pytest.approx(2 * 1000 / 10)  # 2 processes per host
    assert run["extra"]["compression_ratio"] == pytest.approx(1.0)
    assert run["time_to_target_s"] == 4.0 and run["val_acc"] == 0.95
    assert run["wall_s"] == 8.0 and run["peak_rss_mb"] == 103.0
    assert run["extra"]["warmup_steps_excluded"] == 2


def test_a_rank_s_samples_per_second_counts_only_the_batches_it_trained():
    # a parameter-server worker on a slow link: 6 steps of which the last is a batch whose
    # grant went to the faster worker (no samples, no time); its steady window after 5
    # warm-up steps holds only that one: it trained nothing there, not 8 samples in 1 ms
    fast = _record(0, 0, 0, [0.2] * 10, 1000)
    slow = _record(1, 1, 0, [4.0] * 5 + [0.001], 1000)
    fast["step_samples"] = [8] * 10
    slow["samples"], slow["step_samples"] = 5 * 8, [8] * 5 + [0]
    config = BenchConfig(hosts=2, max_steps=10, warmup_steps=5)
    run = summarize("parameter_server", "parameter_server", [fast, slow], config)
    assert [rank["samples_per_s"] for rank in run["extra"]["per_rank"]] == [
        pytest.approx(8 / 0.2),
        0.0,
    ]
    assert run["samples_per_s"] == pytest.approx(8 / 0.2)


def test_table_json_and_plot(tmp_path):
    records = [_record(r, r, 0, [0.3] * 10, 1000) for r in range(2)]
    config = BenchConfig(hosts=2, max_steps=10)
    ok = summarize("ddp", "ddp", records, config)
    failed = dict(ok, spec="bad[/x]", ok=False, error="boom [/tag]\nmore", extra={})
    result = {"config": {"hosts": 2, "bandwidth": "1gbit", "latency": "1ms", "model": "m",
                         "data": "d", "max_steps": 10, "seed": 0, "straggler": None,
                         "target_acc": 0.9, "latency_emulated": False},
              "runs": [ok, failed]}  # fmt: skip
    buffer = io.StringIO()
    print_table(result, Console(file=buffer, width=220))
    text = buffer.getvalue()
    assert "ddp" in text and "FAILED" in text and "boom [/tag]" in text
    assert "not emulated" in text
    write_json(result, tmp_path / "out.json")
    assert json.loads((tmp_path / "out.json").read_text())["runs"][0]["spec"] == "ddp"
    plot(result, tmp_path / "out.png")
    assert (tmp_path / "out.png").read_bytes()[:4] == b"\x89PNG"


def test_the_setting_line_names_the_device_and_the_link():
    config = {"hosts": 2, "bandwidth": "unshaped", "latency": "0", "model": "vgg_mini",
              "data": "digits", "max_steps": 400, "seed": 0, "network": "local",
              "accelerator": "cuda"}  # fmt: skip
    assert setting(config) == (
        "vgg_mini on digits, 2 hosts x 1 procs, CUDA, loopback (unshaped), 400 steps, seed 0"
    )
    shaped = dict(config, network="netns", bandwidth="100mbit", latency="5ms", accelerator="cpu")
    assert setting(shaped).endswith("1 procs, 100mbit, latency 5ms, 400 steps, seed 0")
    # ranks that ran on the C library's own malloc settings are named (held is the default)
    system = dict(shaped, malloc="system")
    assert setting(system).endswith("seed 0, the C library's malloc defaults")
    assert setting(dict(shaped, malloc="held")) == setting(shaped)


def test_config_errors_name_the_fix():
    with pytest.raises(ValueError, match="exactly one of max_steps and epochs"):
        BenchConfig(max_steps=10, epochs=2).validate()
    with pytest.raises(ValueError, match="straggler rank 4 does not exist"):
        BenchConfig(hosts=2, procs_per_host=2, straggler="4:2").validate()
    with pytest.raises(ValueError, match="bandwidth"):
        BenchConfig(bandwidth="fast").validate()


def test_per_rank_carries_each_ranks_bytes_and_peak_rss():
    records = [_record(r, r, 0, [0.3] * 10, 1000) for r in range(2)]
    records[1].update(param_bytes=400, grad_bytes=400, optimizer_bytes=800)
    records[0].update(param_bytes=200, grad_bytes=200, optimizer_bytes=0)
    run = summarize("x", "x", records[::-1], BenchConfig(hosts=2, max_steps=10))
    keys = ("rank", "param_bytes", "grad_bytes", "optimizer_bytes", "peak_rss_mb")
    assert [tuple(rank[k] for k in keys) for rank in run["extra"]["per_rank"]] == [
        (0, 200, 200, 0, 100.0),
        (1, 400, 400, 800, 101.0),
    ]


def test_an_out_of_memory_run_shows_host_and_size(tmp_path):
    config = BenchConfig(hosts=2, max_steps=10, memory_per_host=700 * 10**6)
    error = (
        "host 1 ran out of memory: its 700 MB cap (--memory-per-host) was reached and the kernel "
        "killed rank 1; the run was stopped"
    )
    oom = {"host": 1, "rank": 1, "label": "host 1", "limit_bytes": 700 * 10**6, "kills": 1}
    run = {"spec": "ddp", "world_size": 2, "ok": False, "error": error,
           "extra": {"out_of_memory": [oom]}}  # fmt: skip
    result = {"config": {"hosts": 2, "bandwidth": "1gbit", "latency": "0", "model": "m",
                         "data": "d", "max_steps": 10, "seed": 0, "straggler": None,
                         "memory_per_host": config.memory_per_host}, "runs": [run]}  # fmt: skip
    buffer = io.StringIO()
    print_table(result, Console(file=buffer, width=250))
    text = buffer.getvalue()
    assert "memory 700 MB per host" in text  # the title
    assert "OOM" in text and "host 1 over its 700 MB cap" in text  # the row
    assert error in text  # the full error under the table
    with pytest.raises(ValueError, match="memory_per_host must be at least 1 MiB"):
        BenchConfig(memory_per_host=1000).validate()
