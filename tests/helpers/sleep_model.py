"""A model whose layers take known times: each sleeps a set time in forward and in backward.

For ``bench --model helpers.sleep_model.SleepNet --data helpers.sleep_model.SleepData``: a
step's compute is known whatever else the machine runs (a sleep needs no core), so the plan's
laws for how strategies arrange compute and communication (overlap, rounds, bubbles,
asynchrony) can be checked against measured steps within a few percent.
"""

from __future__ import annotations

import time
from typing import Any

import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

FEATURES, CLASSES = 64, 4


class _Sleep(torch.autograd.Function):
    """Identity that sleeps ``forward_s`` on the way in and ``backward_s`` on the way back."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, forward_s: float, backward_s: float) -> Tensor:
        time.sleep(forward_s)
        ctx.backward_s = backward_s
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:
        time.sleep(ctx.backward_s)
        return grad, None, None


class SleepLayer(nn.Module):
    """A linear layer, then a sleep of known length each way."""

    def __init__(self, features: int, forward_s: float, backward_s: float) -> None:
        super().__init__()
        self.linear = nn.Linear(features, features)
        self.forward_s, self.backward_s = forward_s, backward_s

    def forward(self, x: Tensor) -> Tensor:
        return _Sleep.apply(torch.relu(self.linear(x)), self.forward_s, self.backward_s)


class SleepNet(pl.LightningModule):
    """``depth`` sleeping layers and a linear head, trained with SGD."""

    def __init__(
        self, depth: int = 4, forward_s: float = 0.02, backward_s: float = 0.04, lr: float = 0.05
    ) -> None:
        super().__init__()
        self.lr = lr
        self.layers = nn.Sequential(
            *[SleepLayer(FEATURES, forward_s, backward_s) for _ in range(depth)],
            nn.Linear(FEATURES, CLASSES),
        )

    def forward(self, x: Tensor) -> Tensor:
        return self.layers(x)

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        features, labels = batch
        return F.cross_entropy(self(features), labels)

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        features, labels = batch
        logits = self(features)
        self.log("val_loss", F.cross_entropy(logits, labels), sync_dist=True)
        self.log("val_acc", (logits.argmax(1) == labels).float().mean(), sync_dist=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)


class SleepData(pl.LightningDataModule):
    """Random features with labels from a fixed linear rule; a small validation split."""

    def __init__(self, batch_size: int = 32, seed: int = 0, samples: int = 4096) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(seed)
        features = torch.randn(samples, FEATURES, generator=generator)
        labels = (features[:, :CLASSES]).argmax(1)
        self.batch_size = batch_size
        self.train_set = TensorDataset(features[:-256], labels[:-256])
        self.val_set = TensorDataset(features[-256:], labels[-256:])

    def train_dataloader(self) -> DataLoader[Any]:
        return DataLoader(self.train_set, batch_size=self.batch_size, shuffle=True)

    def val_dataloader(self) -> DataLoader[Any]:
        return DataLoader(self.val_set, batch_size=self.batch_size)
