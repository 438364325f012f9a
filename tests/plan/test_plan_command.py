"""``lightning-parallel plan``: a user's module by class path, profiled once, planned for any
cluster, and ``bench --predict``'s figures beside the measured ones."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from lightning_parallel.bench import predicted
from lightning_parallel.bench.plan import main as plan_main
from lightning_parallel.bench.plan import predictions_for
from lightning_parallel.bench.runner import BenchConfig

TESTS = Path(__file__).parents[1]
HELPERS = "helpers.bench_modules"


@pytest.mark.slow
def test_plan_profiles_a_class_path_module_once_and_plans_other_clusters(
    tmp_path, monkeypatch, capsys
):
    monkeypatch.syspath_prepend(str(TESTS))
    environment = dict(os.environ)
    out, kept, plot = tmp_path / "plan.json", tmp_path / "profile.json", tmp_path / "plan.png"
    code = plan_main(
        ["--model", f"{HELPERS}.TinyClassifier:hidden=32", "--data", f"{HELPERS}.TinyData",
         "--batch-size", "8", "--hosts", "2", "--bandwidth", "100mbit", "--scale", "2,4,8",
         "--json", str(out), "--profile-json", str(kept), "--plot", str(plot),
         "-s", "ddp", "-s", "diloco", "-s", "gropipe", "-s", "no_such_strategy",
         # glibc's thresholds are the whole process's: the test runner's worker keeps its
         # own (a held profile: bench --predict's, in test_sleep_model_prediction.py)
         "--malloc", "system"]
    )  # fmt: skip
    assert code == 0
    # the one-process fit leaves no process group behind (a fork launcher's children would
    # inherit its world of one) and none of the variables it set (the command's own seeding
    # sets PL_GLOBAL_SEED, as Lightning's CLI does)
    assert not dist.is_initialized()
    seeded = {"PL_GLOBAL_SEED", "PL_SEED_WORKERS"}
    assert {k: v for k, v in os.environ.items() if k not in seeded} == {
        k: v for k, v in environment.items() if k not in seeded
    }
    printed = capsys.readouterr().out
    assert "fastest first" in printed and "diloco" in printed
    # timed with glibc's own thresholds: no advice to train otherwise
    assert "hold_freed_memory" not in printed
    record = json.loads(out.read_text())
    by_spec = {p["spec"]: p for p in record["predictions"]}
    assert set(by_spec) == {"ddp", "diloco", "gropipe", "no_such_strategy"}
    assert by_spec["no_such_strategy"]["refused"]
    # the registered defaults reached the predictor: DiLoCo's period of 16
    assert by_spec["diloco"]["detail"]["period"] == 16
    assert by_spec["gropipe"]["refused"] is None
    assert [point[0] for point in record["scaling"]["ddp"]] == [2, 4, 8]
    assert plot.stat().st_size > 0
    profile = json.loads(kept.read_text())
    assert profile["trainer_step_s"] > 0 and profile["peak_rss_bytes"] > 0
    # every timed step is kept (the first two are not timed), their median the trainer's step
    timed = profile["notes"]["step_seconds"]
    assert len(timed) == profile["notes"]["profile_steps"] - 2
    assert sorted(timed)[len(timed) // 2] == profile["trainer_step_s"]
    assert profile["notes"]["freed_memory_held"] is False
    # the same profile planned for another cluster, with no profiling: more bytes per host
    # on a ring of 8 hosts than of 2 (2 (W - 1) / W of the gradients)
    two = predictions_for(profile, ["ddp"], hosts=2, processes_per_host=1,
                          bandwidth="1gbit", latency="0")  # fmt: skip
    eight = predictions_for(profile, ["ddp"], hosts=8, processes_per_host=1,
                            bandwidth="1gbit", latency="0")  # fmt: skip
    assert eight[0]["payload_bytes_per_step"] == pytest.approx(
        two[0]["payload_bytes_per_step"] * 2 * 7 / 8, rel=1e-6
    )
    # a profile timed with freed memory held (as bench ranks are): its CPU times hold only for
    # a process that holds it too, which the plan says; planned for an accelerator, the advice
    # does not apply
    profile["notes"]["freed_memory_held"] = True
    held = tmp_path / "held.json"
    held.write_text(json.dumps(profile))
    again = ["--from-profile", str(held), "--hosts", "2", "--bandwidth", "1gbit", "-s", "ddp"]
    assert plan_main(again) == 0
    assert "hold_freed_memory" in capsys.readouterr().out
    assert plan_main([*again, "--accelerator-tflops", "100"]) == 0
    assert "hold_freed_memory" not in capsys.readouterr().out


def test_bench_predict_passes_the_bench_settings_and_counts_its_run_length():
    config = BenchConfig(hosts=4, bandwidth="100mbit", latency="2ms", model="m.M", data="m.D",
                         max_steps=None, epochs=3, batch_size=16, seed=7)  # fmt: skip
    argv = predicted.plan_argv(["ddp", "hylo"], config, Path("out.json"))
    for flag, value in [("--model", "m.M"), ("--data", "m.D"), ("--hosts", "4"),
                        ("--batch-size", "16"), ("--seed", "7"), ("--bandwidth", "100mbit")]:  # fmt: skip
        assert argv[argv.index(flag) + 1] == value
    assert argv.count("-s") == 2
    assert argv[argv.index("--accelerator") + 1] == "cpu"  # the profile runs where the bench does
    on_gpu = predicted.plan_argv([], BenchConfig(accelerator="cuda"), Path("o"))
    assert on_gpu[on_gpu.index("--accelerator") + 1] == "cuda"
    # 1000 samples on 4 ranks, batches of 16 dropping the last: 15 steps an epoch, 3 epochs
    profile = {"notes": {"train_samples": 1000, "drop_last": True}}
    assert predicted.run_steps(profile, config) == 45
    local = BenchConfig(network="local")
    assert predicted.plan_argv([], local, Path("o"))[-4:] != []
    assert predicted.LOOPBACK[0] in predicted.plan_argv([], local, Path("o"))


def test_the_profile_names_the_fix_for_an_accelerator_it_cannot_use():
    from lightning_parallel.bench.plan_profile import profile_module

    with pytest.raises(ValueError, match="'cpu' or 'cuda'"):
        profile_module(object(), object(), accelerator="tpu")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="no CUDA device; use 'cpu'"):
            profile_module(object(), object(), accelerator="cuda")


def test_the_comparison_prints_predicted_beside_measured():
    result = {
        "runs": [
            {"spec": "ddp", "ok": True, "step_time_s": {"median": 1.0},
             "wire_bytes_per_step": 2e6, "peak_rss_mb": 500.0, "extra": {}},
            {"spec": "hylo", "ok": False, "step_time_s": None, "wire_bytes_per_step": None,
             "peak_rss_mb": None, "extra": {}},
            {"spec": "diloco", "ok": True, "step_time_s": {"median": 1.0},
             "wire_bytes_per_step": None, "peak_rss_mb": 500.0, "extra": {}},
            {"spec": "gropipe", "ok": True, "step_time_s": {"median": 1.0},
             "wire_bytes_per_step": 1e6, "peak_rss_mb": 500.0, "extra": {"boundaries": [5]}},
        ]
    }  # fmt: skip
    prediction = {"step_s": 1.1, "mean_step_s": 1.2, "peak_rss_mb": 450.0,
                  "wire_bytes_per_step": 2e6, "samples_per_s": 64.0, "refused": None}  # fmt: skip
    nan = float("nan")  # a refusal's figures (a world of one process has nothing to plan)
    refusal = {"step_s": nan, "mean_step_s": nan, "peak_rss_mb": None, "samples_per_s": nan,
               "wire_bytes_per_step": nan, "refused": "a cluster of one process"}  # fmt: skip
    cut = {**prediction, "detail": {"boundaries": [3]}}
    predicted.attach(result, {"ddp": prediction, "diloco": refusal, "gropipe": cut})
    extra = result["runs"][0]["extra"]
    assert extra["predicted_step_s"] == 1.1 and extra["predicted_peak_rss_mb"] == 450.0
    assert "predicted_step_s" not in result["runs"][1]["extra"]
    table = predicted.comparison(result)
    assert "+10%" in table and "-10%" in table and "hylo" not in table
    assert "nan" not in table
    # a pipeline that cut elsewhere than the plan expected says so beside its bytes
    assert result["runs"][3]["extra"]["predicted_boundaries"] == [3]
    assert "(cut at [5], the plan's at [3])" in table
    assert table.count("cut at") == 1


def test_the_environment_is_given_back_one_changed_variable_at_a_time(monkeypatch):
    # the one-process fit's variables are undone without rewriting the whole environment:
    # each setenv or unsetenv may reallocate the C library's environ under a native thread
    # that reads it
    from lightning_parallel.bench.plan_profile import restore_environment

    monkeypatch.setenv("LP_TEST_KEPT", "before")
    saved = dict(os.environ)
    os.environ["LP_TEST_KEPT"] = "during"
    os.environ["LP_TEST_ADDED"] = "1"
    calls: list[str] = []
    monkeypatch.setattr(os, "putenv", lambda name, value: calls.append(f"set {os.fsdecode(name)}"))
    monkeypatch.setattr(os, "unsetenv", lambda name: calls.append(f"unset {os.fsdecode(name)}"))
    restore_environment(saved)
    assert dict(os.environ) == saved
    assert sorted(calls) == ["set LP_TEST_KEPT", "unset LP_TEST_ADDED"]
