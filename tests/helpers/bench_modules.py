"""A user's own model and data, by class path, for ``bench --model helpers.bench_modules.X``.

Imported by the bench's worker processes (``tests`` on their ``PYTHONPATH``), so kept to
``pytorch_lightning`` and torch.
"""

from __future__ import annotations

from typing import Any

import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

FEATURES, CLASSES = 8, 3


class TinyClassifier(pl.LightningModule):
    """Two linear layers; with ``log_accuracy=False`` it logs ``val_loss`` and no ``val_acc``."""

    def __init__(self, hidden: int = 16, lr: float = 0.1, log_accuracy: bool = True) -> None:
        super().__init__()
        if hidden < 1:
            raise ValueError(f"hidden must be >= 1, got {hidden}")
        self.lr = lr
        self.log_accuracy = log_accuracy
        self.layers = nn.Sequential(
            nn.Linear(FEATURES, hidden), nn.ReLU(), nn.Linear(hidden, CLASSES)
        )

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        return F.cross_entropy(self.layers(batch["features"]), batch["label"])

    def validation_step(self, batch: dict[str, Tensor], batch_idx: int) -> None:
        logits = self.layers(batch["features"])
        self.log("val_loss", F.cross_entropy(logits, batch["label"]), sync_dist=True)
        if self.log_accuracy:
            accuracy = (logits.argmax(1) == batch["label"]).float().mean()
            self.log("val_acc", accuracy, sync_dist=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr)


class _Samples(TensorDataset):
    """Dictionary samples, as a tokenizer's data gives them (the bench counts their tensors)."""

    def __getitem__(self, index: int) -> Any:
        features, label = super().__getitem__(index)
        return {"features": features, "label": label}


class TinyData(pl.LightningDataModule):
    """Points of 3 separable clusters, split into training and validation by ``seed``."""

    def __init__(self, batch_size: int = 8, seed: int = 0, samples: int = 96) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(seed)
        labels = torch.randint(0, CLASSES, (samples,), generator=generator)
        centres = torch.eye(CLASSES, FEATURES) * 4.0
        features = centres[labels] + torch.randn(samples, FEATURES, generator=generator)
        cut = samples * 3 // 4
        self.batch_size = batch_size
        self.train_set = _Samples(features[:cut], labels[:cut])
        self.val_set = _Samples(features[cut:], labels[cut:])

    def train_dataloader(self) -> DataLoader[Any]:
        return DataLoader(self.train_set, batch_size=self.batch_size, shuffle=True)

    def val_dataloader(self) -> DataLoader[Any]:
        return DataLoader(self.val_set, batch_size=self.batch_size)


class TrainOnlyData(pl.LightningDataModule):
    """Training data only, no ``val_dataloader``: the bench trains and leaves ``val_acc`` null."""

    def __init__(self, batch_size: int = 8, seed: int = 0) -> None:
        super().__init__()
        self.data = TinyData(batch_size, seed)

    def train_dataloader(self) -> DataLoader[Any]:
        return self.data.train_dataloader()


class NotAModule(nn.Module):
    """A plain torch module, which the bench refuses as ``--model``."""
