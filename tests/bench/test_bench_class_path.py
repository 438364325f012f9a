"""``bench --model pkg.module.Class --data pkg.module.DataModule``: a user's own Lightning classes."""

import json
import os
import platform
from pathlib import Path

import pytest

from lightning_parallel.bench import worker
from lightning_parallel.bench.command import main as bench_main
from lightning_parallel.bench.specs import parse_spec

HELPERS = "helpers.bench_modules"
TESTS = Path(__file__).parents[1]


@pytest.fixture
def importable(monkeypatch: pytest.MonkeyPatch) -> None:
    """The worker processes import ``helpers.bench_modules`` as a user's processes would
    import their own module: from ``PYTHONPATH``."""
    paths = [str(TESTS), *filter(None, [os.environ.get("PYTHONPATH")])]
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(paths))


@pytest.mark.slow
def test_a_class_path_model_runs_under_two_specs_with_every_figure(tmp_path, importable):
    out = tmp_path / "out.json"
    code = bench_main(
        ["-s", "ddp", "-s", "model_averaging:period=2", "--network", "local", "--hosts", "2",
         "--model", f"{HELPERS}.TinyClassifier:hidden=16", "--data", f"{HELPERS}.TinyData",
         "--batch-size", "8", "--max-steps", "4", "--warmup-steps", "1", "--json", str(out),
         "--timeout", "300"]
    )  # fmt: skip
    assert code == 0
    result = json.loads(out.read_text())
    assert result["config"]["model"] == f"{HELPERS}.TinyClassifier:hidden=16"
    assert result["config"]["data"] == f"{HELPERS}.TinyData"
    for run in result["runs"]:
        assert run["ok"] and run["world_size"] == 2 and run["steps"] == 4, run["error"]
        # --batch-size reached the data's batch_size; the dictionary batches' tensors counted
        assert run["samples"] == 4 * 8 * 2
        assert run["step_time_s"]["median"] > 0 and run["samples_per_s"] > 0
        assert run["reported_bytes_per_step"] > 0 and run["wire_bytes_per_step"] is None
        assert 0.0 <= run["val_acc"] <= 1.0 and run["val_loss"] is not None
        assert run["peak_rss_mb"] > 0
        assert run["extra"]["parameters"] == 8 * 16 + 16 + 16 * 3 + 3
        # every rank held the memory it freed, as the plan's profile does (glibc only)
        assert result["config"]["malloc"] == "held"
        assert run["extra"]["freed_memory_held"] is (platform.libc_ver()[0] == "glibc")


def test_a_module_that_logs_no_accuracy_gives_a_null_val_acc(tmp_path):
    args = worker._parser().parse_args(
        ["--spec", "single_device", "--model", f"{HELPERS}.TinyClassifier:log_accuracy=false",
         "--data", f"{HELPERS}.TinyData", "--batch-size", "4", "--max-steps", "3",
         "--output", str(tmp_path)]
    )  # fmt: skip
    record = worker.train(args)
    assert record["steps"] == 3 and record["samples"] == 12
    (last,) = record["validations"]
    assert last["val_acc"] != last["val_acc"]  # NaN: not logged; the run's row turns it to null
    assert last["val_loss"] > 0


def test_a_module_without_validation_data_is_trained_and_not_validated(tmp_path):
    args = worker._parser().parse_args(
        ["--spec", "single_device", "--model", f"{HELPERS}.TinyClassifier",
         "--data", f"{HELPERS}.TrainOnlyData", "--batch-size", "4", "--max-steps", "2",
         "--output", str(tmp_path)]
    )  # fmt: skip
    record = worker.train(args)
    assert record["ok"] and record["steps"] == 2 and record["validations"] == []


@pytest.mark.parametrize(
    ("model", "data", "message"),
    [
        ("helpers.no_such_module.Net", f"{HELPERS}.TinyData", "cannot import module"),
        (f"{HELPERS}.Missing", f"{HELPERS}.TinyData", "has no 'Missing'; its classes: NotAModule"),
        # a module that re-exports classes defined elsewhere lists what it exports
        ("lightning_parallel.demo.models.VggMini", f"{HELPERS}.TinyData", "GPT, MLP, Recommender"),
        (f"{HELPERS}.NotAModule", f"{HELPERS}.TinyData", "is not a LightningModule"),
        (f"{HELPERS}.TinyClassifier", f"{HELPERS}.TinyClassifier", "is not a LightningDataModule"),
        (f"{HELPERS}.TinyClassifier:hiden=4", f"{HELPERS}.TinyData", "it takes hidden, lr"),
        (f"{HELPERS}.TinyClassifier:hidden=0", f"{HELPERS}.TinyData", "hidden must be >= 1"),
        (f"{HELPERS}.TinyClassifier", f"{HELPERS}.TinyData:size=3", "TinyData rejects"),
        ("vgg_mini", f"{HELPERS}.TinyData", "give them as options"),
    ],
)
def test_a_wrong_class_path_fails_at_the_start(model, data, message, monkeypatch, capsys):
    def launched(*args: object, **kwargs: object) -> None:
        raise AssertionError("a process was launched")

    monkeypatch.setattr("lightning_parallel.bench.runner.run_spec", launched)
    code = bench_main(["--network", "local", "--model", model, "--data", data])
    assert code == 2
    assert message in capsys.readouterr().err


def test_a_class_path_model_needs_its_data(capsys):
    with pytest.raises(SystemExit) as exit_:
        bench_main(["--network", "local", "--model", f"{HELPERS}.TinyClassifier"])
    assert exit_.value.code == 2
    assert "give its data too, --data pkg.module.DataModuleName" in capsys.readouterr().err


def test_a_lightning_pytorch_class_is_refused_naming_the_namespace(tmp_path, monkeypatch):
    from lightning_parallel.bench.modules import load_class

    (tmp_path / "user_lightning_model.py").write_text(
        "import lightning as L\n\nclass Net(L.LightningModule):\n    pass\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ValueError, match=r"derive it from pytorch_lightning\.LightningModule"):
        load_class("user_lightning_model.Net", "--model")


def test_a_class_path_keeps_its_case_and_takes_json_options():
    spec = parse_spec('my_pkg.models.Net:{"sizes": [64, 32], "timeout": 5}')
    assert spec.name == "my_pkg.models.Net"
    assert spec.options == {"sizes": [64, 32], "timeout": 5}  # a user's argument, as given
    assert parse_spec("my_pkg.Net:hidden=64,lr=0.1").options == {"hidden": 64, "lr": 0.1}
    assert parse_spec("DDP").name == "ddp"
    with pytest.raises(ValueError, match="not JSON"):
        parse_spec("my_pkg.Net:{hidden: 64}")


def test_the_probe_counts_the_samples_of_dictionary_and_tuple_batches():
    import torch

    assert worker._samples({"input_ids": torch.zeros(5, 7), "labels": torch.zeros(5)}) == 5
    assert worker._samples((torch.zeros(3, 2), torch.zeros(3))) == 3
    assert worker._samples([["a", "b"], torch.zeros(2)]) == 2
    assert worker._samples((["a", "b", "c"], ["x", "y", "z"])) == 3
