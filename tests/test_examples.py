import json
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.environment import user_environment

pytestmark = pytest.mark.slow  # each example runs as a user runs it, in its own processes

ROOT = Path(__file__).resolve().parent.parent


def _example(cwd, name, *args, timeout=240, env=None):
    """Run ``examples/<name>`` with ``args`` in ``cwd``; assert it exits 0; its stdout."""
    result = subprocess.run(
        [sys.executable, str(ROOT / "examples" / name), *map(str, args)],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


@pytest.mark.slow
def test_train_digits_example_runs_as_its_docstring_says(tmp_path):
    # the docstring's command with a shorter run; "ddp" re-executes the script in each rank
    stdout = _example(
        tmp_path, "train_digits.py", "--strategy", "ddp", "--devices", 2, "--max-epochs", 1
    )
    assert "val_acc=" in stdout and "bytes/step=" in stdout


@pytest.mark.slow
def test_pipeline_seeds_example_prints_the_accuracy(tmp_path):
    stdout = _example(tmp_path, "pipeline_seeds.py", "v2", 0, "--epochs", 1)
    assert "v2 seed=0 val_acc=" in stdout


@pytest.mark.slow
@pytest.mark.compat
@pytest.mark.parametrize(
    ("lightning", "flag", "value"),
    [
        ("lightning", "--strategy", "model_averaging"),
        ("pytorch_lightning", "--instance", "GroPipeStrategy"),
    ],
)
def test_any_lightning_example_fits_with_only_that_lightning_imported(
    tmp_path, lightning, flag, value
):
    # Lightning's popen launcher re-runs the script per rank, as it does for a user's script;
    # the test session's namespace override must not reach it
    result = subprocess.run(
        [
            sys.executable,
            str(ROOT / "examples" / "any_lightning.py"),
            "--lightning",
            lightning,
            flag,
            value,
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=240,
        env=user_environment(),
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"ok {lightning} {value}:" in result.stdout


@pytest.mark.slow
def test_model_matrix_example_fits_a_strategy_on_a_model(tmp_path):
    command = [sys.executable, str(ROOT / "examples" / "model_matrix.py")]
    command += ["--strategy", "hylo", "--strategy", "spectrain", "--model", "recommender"]
    result = subprocess.run(
        [*command, "--steps", "2"], cwd=tmp_path, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "| `recommender` | `hylo` | ok (train_loss" in result.stdout
    assert "| `recommender` | `spectrain` | ok (train_loss" in result.stdout


def test_third_party_models_example_fits_pipelines_and_a_data_parallel_strategy(tmp_path):
    pytest.importorskip("timm", reason="the models extra (timm) is not installed")
    command = [sys.executable, str(ROOT / "examples" / "third_party_models.py")]
    command += ["--models", "timm_convnext", "bert", "--stages", "2", "--steps", "1"]
    command += ["--strategies", "gropipe", "spectrain", "hylo"]
    result = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    table = result.stdout.split("| model | strategy |")[-1]
    for strategy in ("gropipe", "spectrain", "hylo"):
        assert f"| timm_convnext | {strategy} | 2 | ok |" in table
    for strategy in ("gropipe", "spectrain", "hylo"):  # BERT: tied weights, keyword arguments
        assert f"| bert | {strategy} | 2 | ok |" in table


def test_bench_matrix_cells_say_fit_refusal_or_failure():
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "bench_matrix", ROOT / "examples" / "bench_matrix.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.cell({"ok": True, "val_acc": 0.4567}) == "fits (val acc 0.46)"
    refused = {"ok": False, "refused": True, "error": "ValueError: feeds one input | two\nmore"}
    assert module.cell(refused) == "refused: ValueError: feeds one input / two"
    assert module.cell({"ok": False, "error": "rank 0: boom"}) == "FAILED: rank 0: boom"


def _bench_json(path, seed, runs):
    config = {
        "model": "vgg_mini",
        "data": "digits",
        "hosts": 2,
        "bandwidth": "100mbit",
        "seed": seed,
    }
    path.write_text(json.dumps({"config": config, "runs": runs}))
    return path


def _run(spec, wire, peak, to_target, acc):
    return {
        "spec": spec,
        "ok": True,
        "wire_bytes_per_step": wire,
        "reported_bytes_per_step": wire,
        "step_time_s": {"median": 0.1},
        "time_to_target_s": to_target,
        "val_acc": acc,
        "extra": {"peak_round_bytes": peak, "wire_trace": [[1.0, wire], [2.0, 2 * wire]]},
    }


def test_seeds_table_gives_means_ranges_and_ratios(tmp_path):
    files = [
        _bench_json(
            tmp_path / f"s{seed}.json",
            seed,
            [
                _run("base", 4e6, 40e6, 50.0 + seed, 0.9),
                _run("new", 1e6, 8e6, None if seed else 20.0, 0.92),
            ],
        )
        for seed in (0, 1)
    ]
    plot = tmp_path / "wire.png"
    stdout = _example(tmp_path, "seeds_table.py", *files, "--baseline", "base", "--wire-plot", plot)
    assert "| `base` | 2 | 4.00 (4.00–4.00) | 4.00 (4.00–4.00) | 40.00 (40.00–40.00) |" in stdout
    assert "50.5 (50.0–51.0) (2/2 reached)" in stdout
    assert "20.0 (1/2 reached)" in stdout  # the seed that never reached it is counted
    assert "wire MB/step 0.25x" in stdout and "largest round MB 0.20x" in stdout
    assert "val acc +2.0 points" in stdout
    assert plot.stat().st_size > 0


def test_time_to_baseline_reads_each_seeds_target_from_the_baselines_final_accuracy(tmp_path):
    def run(spec, wire, history):
        record = _run(spec, wire, 0, None, history[-1][2])
        record["val_history"] = [[*point, 0.5] for point in history]
        return record

    files = [
        _bench_json(
            tmp_path / "s0.json",
            0,
            [
                run("ddp", 4e6, [(100.0, 22, 0.5), (200.0, 44, 0.9), (300.0, 66, 0.9)]),
                run("avg", 1e6, [(10.0, 22, 0.7), (20.0, 44, 0.95)]),
            ],
        ),
        _bench_json(
            tmp_path / "s1.json",
            1,
            [
                run("ddp", 4e6, [(100.0, 22, 0.6), (200.0, 44, 0.8)]),
                run("avg", 2e6, [(10.0, 22, 0.7), (20.0, 44, 0.75)]),
            ],
        ),
    ]
    stdout = _example(tmp_path, "time_to_baseline.py", *files, "--baseline", "ddp")
    # seed 0: ddp reached its final 0.9 at 200 s (not 300 s); avg at 20 s
    assert (
        "| `avg` | 20.0 s (0.10x, to 0.900) | never (to 0.800; best 0.750 at 20.0 s, 0.10x) "
        "| never | 0.250x–0.500x |" in stdout
    )
    assert "| `ddp` | 200.0 s (1.00x, to 0.900) | 200.0 s (1.00x, to 0.800) | 1.00x |" in stdout


def _faulted(tmp_path, spec, seed, acc, went_on, after, logged):
    log = tmp_path / f"{spec}-{seed}.log"
    log.write_text("".join(f"rank {r}: replica rank 2 was lost (no heartbeat)\n" for r in logged))
    ranks = [
        {"rank": r, "faulted": False, "went_on": went_on, "after_fault_s": after} for r in (0, 1)
    ]
    ranks.append({"rank": 2, "faulted": True, "went_on": False, "after_fault_s": 0.1})
    run = _run(spec, 1e6, 8e6, None, acc)
    run["extra"].update(
        log=str(log), ranks=ranks, faults=[{"fault": "kill:2@35"}], survivors_within_bar=True
    )
    return run


def test_fault_runs_table_compares_with_the_runs_without_the_fault(tmp_path):
    clean = [_bench_json(tmp_path / f"c{s}.json", s, [_run("a:x=1", 1, 1, 1, 0.9)]) for s in (0, 1)]
    faulted = [
        _bench_json(
            tmp_path / f"f{s}.json",
            s,
            [
                _faulted(
                    tmp_path, "a:x=1,worker_loss=continue", s, 0.88 + s / 100, True, None, [0, s]
                ),
                _faulted(tmp_path, "a:x=1,timeout=30", s, None, False, 3.0 + s, []),
            ],
        )
        for s in (0, 1)
    ]
    stdout = _example(
        tmp_path, "fault_runs_table.py", "--clean", *clean, "--faulted", *faulted, "--per-seed"
    )
    assert (
        "| `a:x=1,worker_loss=continue` | `kill:2@35` | 0.880 / 0.900 | 0.890 / 0.900 | -1.5 |"
        in stdout
    )
    continued = "| `a:x=1,worker_loss=continue` | `kill:2@35` | 2/2 | 1/2 | 0.885 (0.880–0.890)"
    assert continued in stdout  # in seed 0, rank 1 did not log it
    assert "| 0.900 (0.900–0.900) | -1.5 | — | yes |" in stdout
    assert (
        "| `a:x=1,timeout=30` | `kill:2@35` | 0/2 | 0/2 | — | 0.900 (0.900–0.900) | — | 3.5"
        in stdout
    )


@pytest.mark.slow
@pytest.mark.faults
def test_lost_replica_example_goes_on_under_lightnings_own_launcher(tmp_path):
    """Lightning's popen launcher kills every rank when a child dies; with worker_loss the
    strategy's launcher lets ranks 0 and 1 finish without rank 2."""
    stdout = _example(tmp_path, "lost_replica.py", timeout=200, env=user_environment())
    assert "rank 0 finished epoch 3" in stdout and "rank 1 finished epoch 3" in stdout
    assert "rank 2 finished" not in stdout


@pytest.mark.slow
def test_averaging_seeds_example_prints_the_accuracy(tmp_path):
    stdout = _example(
        tmp_path,
        "averaging_seeds.py",
        "--model",
        "convnet",
        "--epochs",
        1,
        "algorithm=diloco",
        "period=4",
        "fragments=2",
        "sync_delay=1",
        "outer_dtype=int8",
    )
    assert "seed=0 val_acc=" in stdout


def _cell_run(spec, step, rate, nbytes=1e6, peak=500.0, predicted=None):
    """A bench run's record with the plan's prediction: ``predicted`` (step, rate, bytes,
    peak) against the measured ``step``, ``rate``, ``nbytes`` and ``peak``."""
    p_step, p_rate, p_bytes, p_peak = predicted or (step, rate, nbytes, peak)
    return {
        "spec": spec, "ok": True, "step_time_s": {"median": step}, "samples_per_s": rate,
        "wire_bytes_per_step": nbytes, "peak_rss_mb": peak,
        "extra": {
            "predicted_step_s": p_step, "predicted_samples_per_s": p_rate,
            "predicted_wire_bytes_per_step": p_bytes, "predicted_peak_rss_mb": p_peak,
        },
    }  # fmt: skip


def test_prediction_cells_summary_gives_the_bar_s_figures(tmp_path):
    """Two cells of hand-made runs: the step errors' median and 90th percentile, the memory and
    bytes counts, and the fastest strategy with a pipeline's samples counted once."""
    first = [
        _cell_run("ddp", 1.0, 100.0, predicted=(1.1, 90.0, 1e6, 500.0)),  # +10%
        _cell_run("diloco", 0.5, 200.0, predicted=(0.4, 250.0, 1.1e6, 600.0)),  # -20%, 2 misses
        # a pipeline's 300 samples/s are 150 counted once: diloco stays the fastest
        _cell_run("gropipe", 0.5, 300.0, predicted=(0.5, 240.0, 1e6, 500.0)),  # 0%
    ]
    second = [
        _cell_run("ddp", 1.0, 100.0, predicted=(1.05, 120.0, 1e6, 500.0)),  # +5%, wrong pick
        _cell_run("hylo", 1.0, 110.0, predicted=(1.0, 100.0, 1e6, 500.0)),  # 0%
    ]
    for name, runs in (("gpt_1gbit", first), ("vgg16_1gbit", second)):
        (tmp_path / f"cell_{name}.json").write_text(json.dumps({"runs": runs}))
    stdout = _example(tmp_path, "prediction_cells.py", "summary", "--out", tmp_path, "--rows")
    assert "5 runs in 2 cells" in stdout
    # errors 0, 0, 5, 10, 20 %: median 5%, nearest-rank p90 20%
    assert "median |step error| 5.0%, p90 20.0%" in stdout
    assert "memory within 15%: 4 of 5; bytes within 5%: 4 of 5" in stdout
    assert "| gpt_1gbit | `diloco` | `diloco` | 1.00 | yes |" in stdout
    assert "| vgg16_1gbit | `ddp` | `hylo` | 0.91 | no |" in stdout
    assert "fastest right or within 5%: 1 of 2" in stdout
