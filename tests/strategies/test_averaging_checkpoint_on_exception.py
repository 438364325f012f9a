"""A model-averaging checkpoint asked for after the run raised (``OnExceptionCheckpoint``)
averages the replicas only if every rank asks for it; one rank's failure inside a step is
refused at once, not after the group's timeout in a collective the others never join."""

from __future__ import annotations

import os
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from helpers.distributed import run_distributed
from helpers.trainers import QUIET
from pytorch_lightning.callbacks import OnExceptionCheckpoint
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_parallel.strategies.model_averaging import ModelAveragingStrategy


class Net(pl.LightningModule):
    def __init__(self, fail_on_rank: int | None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layer = nn.Linear(4, 2)
        self.fail_on_rank = fail_on_rank

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if batch_idx == 3 and self.fail_on_rank in (None, self.trainer.global_rank):
            raise RuntimeError("failed at step 4")
        x, y = batch
        return F.cross_entropy(self.layer(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _fit(rank: int, world: int, fail_on_rank: int | None, folder: str) -> tuple[str, float]:
    os.environ.update(LOCAL_RANK="0", NODE_RANK=str(rank))
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        num_nodes=world,
        strategy=ModelAveragingStrategy(period=2, timeout=timedelta(seconds=20)),
        max_steps=8,
        callbacks=[OnExceptionCheckpoint(dirpath=folder, filename="on_exception")],
        **{**QUIET, "enable_checkpointing": True},
    )
    generator = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(64, 4, generator=generator), torch.randint(0, 2, (64,)))
    started = time.monotonic()
    try:
        trainer.fit(Net(fail_on_rank), DataLoader(data, batch_size=4))
    except BaseException as error:  # what each rank raised is the result
        return f"{type(error).__name__}: {error}", time.monotonic() - started
    return "no error", time.monotonic() - started


def test_a_failure_on_every_rank_still_saves_the_average(tmp_path: Path) -> None:
    results = run_distributed(_fit, 2, None, str(tmp_path), init_group=False)
    assert all("failed at step 4" in text for text, _ in results), results
    state = torch.load(tmp_path / "on_exception.ckpt", weights_only=False)["state_dict"]
    assert set(state) == {"layer.weight", "layer.bias"}


@pytest.mark.slow  # waits out the failed run's wait
def test_one_rank_failing_inside_a_step_is_refused_within_half_the_timeout(
    tmp_path: Path,
) -> None:
    results = run_distributed(
        _fit, 2, 1, str(tmp_path), init_group=False, timeout=90, may_vanish=(0,)
    )
    text, seconds = results[1]
    assert text.startswith("PartialCheckpointError"), results
    assert "rank(s) [0] did not reach this checkpoint within 10 s" in text
    assert seconds < 20  # the wait (10 s), not the group's timeout (20 s) on top of it
    assert not list(tmp_path.glob("*.ckpt"))
