"""The base of the bundled data modules: a fixed train/validation pair of tensors served
through ordinary data loaders.
"""

from __future__ import annotations

import torch
from pytorch_lightning import LightningDataModule
from torch.utils.data import DataLoader, TensorDataset

__all__: list[str] = []


class TensorDataModule(LightningDataModule):
    """Serve a fixed train/validation pair of tensors through ordinary data loaders."""

    num_classes: int = 10

    def __init__(self, batch_size: int, num_workers: int) -> None:
        super().__init__()
        if batch_size < 1:
            raise ValueError(f"batch_size must be a positive integer, got {batch_size}")
        if num_workers < 0:
            raise ValueError(f"num_workers must be >= 0, got {num_workers}")
        self.batch_size = batch_size
        self.num_workers = num_workers
        self.train_set: TensorDataset | None = None
        self.val_set: TensorDataset | None = None

    def _tensors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        raise RuntimeError("subclasses provide _tensors()")  # pragma: no cover

    def setup(self, stage: str | None = None) -> None:
        if self.train_set is None:
            train_x, train_y, val_x, val_y = self._tensors()
            self.train_set = TensorDataset(train_x, train_y)
            self.val_set = TensorDataset(val_x, val_y)

    def train_dataloader(self) -> DataLoader:
        assert self.train_set is not None, "call setup() first"
        # drop_last keeps every step's batch whole, so pipelines can split it into micro-batches
        return DataLoader(
            self.train_set,
            batch_size=self.batch_size,
            shuffle=True,
            drop_last=True,
            num_workers=self.num_workers,
        )

    def val_dataloader(self) -> DataLoader:
        assert self.val_set is not None, "call setup() first"
        return DataLoader(self.val_set, batch_size=self.batch_size, num_workers=self.num_workers)

    def test_dataloader(self) -> DataLoader:
        return self.val_dataloader()

    def predict_dataloader(self) -> DataLoader:
        return self.val_dataloader()
