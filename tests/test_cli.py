import os
import subprocess
import sys

import pytest

from lightning_parallel.cli import _expand_short_names, main


def _cli(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "lightning_parallel.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "PYTHONFAULTHANDLER": "1"},  # a crashed rank prints its stack
    )


def _told(result: subprocess.CompletedProcess) -> str:
    """The start and the end of a failed run's output (each rank's error is in the middle)."""
    err = result.stderr
    return err if len(err) < 12000 else f"{err[:6000]}\n[...]\n{err[-6000:]}"


@pytest.mark.slow
def test_fit_runs_a_two_process_cpu_fit_end_to_end(tmp_path):
    result = _cli(
        "fit",
        "--model",
        "convnet",
        "--data",
        "digits",
        "--trainer.accelerator",
        "cpu",
        "--trainer.devices",
        "2",
        "--trainer.strategy",
        "ddp_spawn",
        "--trainer.max_epochs",
        "1",
        "--trainer.enable_progress_bar",
        "false",
        f"--trainer.default_root_dir={tmp_path}",
    )
    assert result.returncode == 0, _told(result)
    assert list(tmp_path.rglob("*.ckpt")), "fit should leave a checkpoint"
    assert (
        list(tmp_path.rglob("metrics.csv"))
        or list(tmp_path.rglob("events.out.*"))
        or list(tmp_path.rglob("hparams.yaml"))
    )


def test_short_names_expand_to_class_paths():
    argv, linked = _expand_short_names(["fit", "--model", "vgg_mini", "--data=digits"])
    assert argv == [
        "fit",
        "--model=lightning_parallel.demo.models.VGGMini",
        "--data=lightning_parallel.demo.data.DigitsDataModule",
    ]
    assert linked
    argv, linked = _expand_short_names(["fit", "--model", "my_pkg.Model", "--data", "digits"])
    assert not linked and argv[1] == "--model=my_pkg.Model"


def test_a_bundled_model_alone_gets_its_data_and_the_device_flags_reach_the_trainer():
    argv, linked = _expand_short_names(
        ["fit", "--model", "gpt", "--accelerator", "cuda", "--devices=2"]
    )
    assert argv == [
        "fit",
        "--model=lightning_parallel.demo.models.GPT",
        "--trainer.accelerator",
        "cuda",
        "--trainer.devices=2",
        "--data=lightning_parallel.demo.data.CorpusDataModule",
    ]
    assert linked
    argv, _ = _expand_short_names(["fit", "--model", "resnet18", "--data", "digits"])
    assert argv[-1] == "--data=lightning_parallel.demo.data.DigitsDataModule"


def test_unknown_model_name_names_the_choices():
    with pytest.raises(SystemExit, match="convnet"):
        _expand_short_names(["fit", "--model", "resnet9"])


@pytest.mark.slow
def test_bad_model_argument_is_a_clear_error():
    result = _cli(
        "fit",
        "--model",
        "convnet",
        "--data",
        "digits",
        "--model.init_args.optimizer",
        "lbfgs",
        "--trainer.max_epochs",
        "1",
    )
    assert result.returncode != 0
    assert "optimizer must be one of" in result.stderr


@pytest.mark.slow
def test_unknown_strategy_is_a_clear_error():
    result = _cli(
        "fit",
        "--model",
        "convnet",
        "--data",
        "digits",
        "--trainer.strategy",
        "nonsense",
        "--trainer.max_epochs",
        "1",
    )
    assert result.returncode != 0
    assert "nonsense" in result.stderr


def test_unknown_command_and_help(capsys):
    assert main(["frobnicate"]) == 2
    assert "unknown command" in capsys.readouterr().err
    assert main(["--help"]) == 0
    assert main(["strategies"]) == 0


@pytest.mark.parametrize("command", ["bench", "cluster"])
def test_every_tool_has_help_that_exits_0(command, capsys):
    with pytest.raises(SystemExit) as raised:
        main([command, "--help"]) if command == "bench" else sys.exit(main([command, "--help"]))
    assert raised.value.code == 0
    assert "usage" in capsys.readouterr().out


@pytest.mark.slow
def test_fresh_install_needs_neither_scikit_learn_nor_matplotlib_for_the_library():
    # importing the package and both builds' strategies adds none of the optional dependencies
    # (Lightning itself may import matplotlib when it is installed: counted before ours)
    code = (
        "import sys, pytorch_lightning;"
        "before = set(sys.modules);"
        "import lightning_parallel, lightning_parallel.strategies, lightning_parallel.callbacks;"
        "new = set(sys.modules) - before;"
        "bad = [m for m in ('sklearn', 'matplotlib', 'deepspeed', 'torchgpipe') if m in new];"
        "assert not bad, bad"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
