"""Every strategy family fits a few steps on CUDA (``pytest -m gpu``; skipped without CUDA).

Two processes, launched by ``spawn`` (a process that initialised CUDA cannot fork children
that use it, and the pytest process itself never touches CUDA): on two or more GPUs one GPU per
rank over NCCL; on one GPU both ranks share it over gloo (NCCL refuses two ranks on one device),
so gloo moves the CUDA tensors through host memory by the rule of
:mod:`lightning_parallel.comm.devices`. Each fit writes a checkpoint; the model's step asserts
that it runs on CUDA.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import pytorch_lightning as pl
import torch
from helpers.models import ConvBatchNormNet, image_loader
from pytorch_lightning.callbacks import ModelCheckpoint
from pytorch_lightning.strategies import DDPStrategy, StrategyRegistry

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.slow,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA is not available"),
]


def placement() -> dict[str, Any]:
    """Two ranks: one GPU each over NCCL, or both on GPU 0 over gloo."""
    if torch.cuda.device_count() >= 2:
        return {
            "parallel_devices": [torch.device("cuda", 0), torch.device("cuda", 1)],
            "process_group_backend": "nccl",
        }
    return {"parallel_devices": [torch.device("cuda", 0)] * 2, "process_group_backend": "gloo"}


def _strategy(family: str, where: dict[str, Any]) -> tuple[Any, dict[str, Any], list[Any]]:
    from lightning_parallel.callbacks.hylo import HyloCompression
    from lightning_parallel.strategies.gropipe import GroPipeStrategy
    from lightning_parallel.strategies.hylo import HyloStrategy
    from lightning_parallel.strategies.parameter_server import ParameterServerStrategy
    from lightning_parallel.strategies.spectrain import SpecTrainStrategy

    common: dict[str, Any] = {"start_method": "spawn", **where}
    hylo: dict[str, Any] = {"min_compress_numel": 64, "warmup_steps": 1}
    if family == "ddp":
        return DDPStrategy(**common), {}, []
    if family == "hylo":
        return HyloStrategy(**hylo, **common), {}, []
    if family == "hylo_pieces":  # the 8192-weight layer in 8 pipelined pieces (auto: none)
        return HyloStrategy(**hylo, piece_numel=1024, **common), {}, []
    if family == "hylo_callback":
        return DDPStrategy(**common), {}, [HyloCompression(**hylo)]
    if family == "parameter_server":
        return ParameterServerStrategy(shards=2, **common), {}, []
    if family == "gropipe":
        return GroPipeStrategy(stages=2, micro_batches=2, **common), {"gradient_clip_val": 1.0}, []
    if family == "spectrain":
        return SpecTrainStrategy(stages=2, **common), {"gradient_clip_val": 1.0}, []
    if family == "model_averaging_overlap":  # a round in flight across steps
        from lightning_parallel.strategies.model_averaging import ModelAveragingStrategy

        return ModelAveragingStrategy(period=2, overlap=True, **common), {}, []
    if family == "diloco_streaming_int8":  # fragments, a delayed round, quantized deltas
        from lightning_parallel.strategies.model_averaging import ModelAveragingStrategy

        streaming: dict[str, Any] = {"fragments": 2, "sync_delay": 1, "outer_dtype": "int8"}
        return ModelAveragingStrategy("diloco", period=2, **streaming, **common), {}, []
    if family == "diloco_continue":  # every collective agreed on the survivors' lanes
        from lightning_parallel.strategies.model_averaging import ModelAveragingStrategy

        # over gloo also on several GPUs: an NCCL communicator does not survive a lost peer
        loss: dict[str, Any] = {"worker_loss": "continue", "heartbeat_timeout": 10.0}
        options: dict[str, Any] = {**common, "process_group_backend": "gloo"}
        return ModelAveragingStrategy("diloco", period=2, **loss, **options), {}, []
    if family.startswith("preset:"):  # model_averaging and its registered presets
        entry = StrategyRegistry[family.removeprefix("preset:")]
        options = {**entry["init_params"], "period": 2, **common}
        return entry["strategy"](**options), {}, []
    raise AssertionError(family)


FAMILIES = [
    "ddp",
    "hylo",
    "hylo_pieces",
    "hylo_callback",
    "preset:model_averaging",
    "preset:local_sgd",
    "preset:bmuf",
    "preset:easgd",
    "preset:diloco",
    "diloco_streaming_int8",
    "diloco_continue",
    "parameter_server",
    "gropipe",
    "spectrain",
]


def fit(
    family: str,
    folder: Path,
    accelerator: str,
    where: dict[str, Any],
    max_epochs: int = 1,
    ckpt_path: str | None = None,
    model: pl.LightningModule | None = None,
    extra_callbacks: tuple[pl.Callback, ...] = (),
) -> pl.Trainer:
    """Fit ``family`` on ``where``'s devices (``placement()`` on CUDA) with a checkpoint, or
    resume it from ``ckpt_path``; ``model`` replaces the default network."""
    import lightning_parallel  # noqa: F401  (registers the strategy names)

    strategy, options, callbacks = _strategy(family, where)
    callbacks = [*callbacks, *extra_callbacks]
    trainer = pl.Trainer(
        accelerator=accelerator,
        devices=len(set(where["parallel_devices"])),
        strategy=strategy,
        max_epochs=max_epochs,
        limit_train_batches=6,
        limit_val_batches=2,
        num_sanity_val_steps=0,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[ModelCheckpoint(dirpath=folder, save_last=True), *callbacks],
        default_root_dir=folder,
        **options,
    )
    trainer.fit(
        model or ConvBatchNormNet(channels=8, hidden=64, device_type=accelerator),
        image_loader(128, 16),
        image_loader(128, 16),
        ckpt_path=ckpt_path,
    )
    return trainer


@pytest.mark.parametrize("family", FAMILIES)
def test_gpu_fit(family: str, tmp_path: Path) -> None:
    trainer = fit(family, tmp_path, "cuda", placement())
    assert trainer.state.finished
    assert (tmp_path / "last.ckpt").is_file()
    assert math.isfinite(float(trainer.callback_metrics["val_loss"]))


RESUMED = [
    "preset:bmuf",
    "preset:easgd",
    "preset:diloco",
    "model_averaging_overlap",
    "diloco_streaming_int8",
    "hylo",
]


@pytest.mark.parametrize("family", RESUMED)
def test_gpu_resume(family: str, tmp_path: Path) -> None:
    """A checkpoint is loaded onto the CPU: the averagers' state (global model, momentum,
    center, outer optimizer), a round in flight and Hylo's residuals must move back to the GPU
    and training go on."""
    fit(family, tmp_path, "cuda", placement())
    resumed = fit(family, tmp_path / "resumed", "cuda", placement(), 2, str(tmp_path / "last.ckpt"))
    assert resumed.state.finished
    assert math.isfinite(float(resumed.callback_metrics["val_loss"]))
    # the spawned ranks trained the second epoch: 128 samples, 2 ranks, batches of 16 make 4
    # optimizer steps an epoch, 8 in all
    saved = torch.load(tmp_path / "resumed" / "last.ckpt", map_location="cpu", weights_only=False)
    assert (saved["epoch"], saved["global_step"]) == (1, 8)


@pytest.mark.parametrize("name", ["gropipe", "spectrain"])
def test_gpu_validate_after_fit_in_the_same_processes(name: str) -> None:
    """The bench's order on CUDA: fit, then validate with the same Trainer in each rank's own
    process (gloo, both ranks on GPU 0). Failed on an H200 before the fix: a stale layer of the
    first run (GroPipe), a torchmetrics metric left on the CPU (SpecTrain)."""
    from helpers.distributed import run_distributed
    from helpers.pipelines import fit_then_validate

    results = run_distributed(
        fit_then_validate, 2, name, "cuda", init_group=False, start_method="spawn", timeout=300
    )
    last = [r[0] for r in results if r and r[0]]
    assert last and all(math.isfinite(m["val_loss"]) and 0 <= m["val_acc"] <= 1 for m in last)
