"""The pipelines fit the bundled models that are not an ``nn.Sequential`` (fork, 2 processes).

ResNets (skip connections: cuts carry two tensors, BatchNorm), VGG-16 (a deep sequence), the
GPT (token inputs, embeddings, attention) and the recommender (two inputs, two outputs, an
LSTM), each split into 2 stages by ``gropipe`` and ``spectrain``; every rank holds only its
stage.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import pytorch_lightning as pl
from helpers.trainers import QUIET

from lightning_parallel.demo import build_datamodule, build_model
from lightning_parallel.strategies.gropipe import GroPipeStrategy
from lightning_parallel.strategies.spectrain import SpecTrainStrategy

CASES = {
    "resnet18": ("synthetic", {"width": 8}),
    "vgg16": ("synthetic", {"width": 8}),
    "gpt": ("corpus", {}),
    # two inputs, two outputs; a cut carries the LSTM's last state, a strided slice
    "recommender": ("interactions", {}),
}


class _Report(pl.Callback):
    def __init__(self, directory: Path) -> None:
        self.directory = directory

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        record = {
            "loss": float(trainer.callback_metrics["train_loss"]),
            "real": sum(not p.is_meta for p in pl_module.parameters()),
            "all": sum(1 for _ in pl_module.parameters()),
        }
        (self.directory / f"rank{trainer.global_rank}.json").write_text(json.dumps(record))


@pytest.mark.parametrize("strategy_class", [GroPipeStrategy, SpecTrainStrategy])
@pytest.mark.parametrize("name", sorted(CASES))
def test_a_pipeline_fits_the_model(tmp_path: Path, name: str, strategy_class: type) -> None:
    data_name, options = CASES[name]
    data = build_datamodule(data_name, batch_size=16, num_samples=128)
    model = build_model(name, data, **options)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy_class(stages=2, start_method="fork"),
        max_epochs=1,
        limit_val_batches=2,
        callbacks=[_Report(tmp_path)],
        **QUIET,
    )
    trainer.fit(model, datamodule=data)
    records = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert all(math.isfinite(r["loss"]) for r in records)
    assert records[0]["real"] + records[1]["real"] == records[0]["all"]  # the stages, once
    assert 0 < records[0]["real"] < records[0]["all"]
