"""A pipeline captured with torch.export on CUDA (``pytest -m gpu``; skipped without CUDA): a
language model called with keyword arguments, its loss inside, its embedding tied to its head,
under GroPipe and SpecTrain with two stages (spawned ranks, both on GPU 0 over gloo where there
is one GPU). The graph is exported on the rank's device (its device arguments are CUDA's); the
tied matrix's gradients (and under SpecTrain the owner's value) cross the stages through gloo;
the checkpoint loads strictly and holds the matrix once under both names."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import pytorch_lightning as pl
import torch
from helpers.models import TiedKeywordLM, token_loader
from pytorch_lightning.callbacks import ModelCheckpoint
from test_gpu_fits import placement

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.slow,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA is not available"),
]


@pytest.mark.parametrize("pipeline", ["GroPipeStrategy", "SpecTrainStrategy"])
def test_gpu_exported_pipeline_with_tied_weights(pipeline: str, tmp_path: Path) -> None:
    import lightning_parallel.pytorch_lightning as built

    strategy = getattr(built, pipeline)(
        stages=2, micro_batches=2, start_method="spawn", **placement()
    )
    trainer = pl.Trainer(
        accelerator="cuda", devices=2 if torch.cuda.device_count() >= 2 else 1,
        strategy=strategy, max_epochs=1, limit_train_batches=4, limit_val_batches=2,
        num_sanity_val_steps=0, logger=False, enable_progress_bar=False,
        enable_model_summary=False, callbacks=[ModelCheckpoint(dirpath=tmp_path, save_last=True)],
    )  # fmt: skip
    trainer.fit(TiedKeywordLM(device_type="cuda"), token_loader(), token_loader())
    assert math.isfinite(float(trainer.callback_metrics["val_loss"]))
    saved = torch.load(tmp_path / "last.ckpt", map_location="cpu")["state_dict"]
    TiedKeywordLM().load_state_dict(saved, strict=True)
    assert torch.equal(saved["model.head.weight"], saved["model.embedding.weight"])
