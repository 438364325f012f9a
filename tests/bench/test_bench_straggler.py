import time

import pytest
import torch
from pytorch_lightning import LightningModule, Trainer
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_parallel.callbacks.straggler import Straggler


class _Slow(LightningModule):
    """Each training step computes for a fixed 30 ms."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(4, 2)

    def training_step(self, batch, batch_idx):
        time.sleep(0.03)
        return self.layer(batch[0]).sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def train_dataloader(self):
        return DataLoader(TensorDataset(torch.randn(40, 4)), batch_size=4)


def _fit(callbacks):
    trainer = Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=6,
        callbacks=callbacks,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    start = time.perf_counter()
    trainer.fit(_Slow())
    return time.perf_counter() - start


def test_the_straggler_rank_takes_factor_times_longer():
    straggler = Straggler(rank=0, factor=3.0)
    _fit([straggler])
    # (factor - 1) x at least 30 ms of compute per batch, 6 batches
    assert straggler.delayed_seconds >= 6 * 2 * 0.03
    assert straggler.delayed_seconds < 6 * 2 * 0.03 * 3  # proportional, not arbitrary


def test_other_ranks_are_untouched():
    straggler = Straggler(rank=1, factor=5.0)
    with pytest.raises(ValueError, match="does not exist"):
        _fit([straggler])  # world size 1: rank 1 is a mistake, said at setup
    assert straggler.delayed_seconds == 0.0


def test_from_env(monkeypatch):
    monkeypatch.delenv("LP_STRAGGLER", raising=False)
    assert Straggler.from_env() is None
    monkeypatch.setenv("LP_STRAGGLER", "1:2.5")
    straggler = Straggler.from_env()
    assert straggler is not None and (straggler.rank, straggler.factor) == (1, 2.5)
    with pytest.raises(ValueError, match="factor"):
        Straggler(rank=0, factor=0.5)
