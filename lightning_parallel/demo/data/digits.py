"""Scikit-learn's handwritten digits: real data, no download."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from lightning_parallel.demo.data.tensors import TensorDataModule

__all__: list[str] = []


class DigitsDataModule(TensorDataModule):
    """Scikit-learn's 1,797 handwritten digits (8x8, 10 classes), ready for CNNs and MLPs.

    The split is fixed by ``seed`` (``val_fraction`` of the samples for validation, stratified by
    nothing but the permutation); pixels are scaled to [0, 1], optionally resized to 32x32
    (bilinear) so convolutional networks see image-sized inputs, then normalized with the
    training set's mean and standard deviation.

    Args:
        batch_size: samples per training step on each process.
        resize: upsample the 8x8 images to 32x32.
        val_fraction: share of the samples held out for validation.
        seed: seed of the train/validation permutation.
        num_workers: data-loader worker processes.
    """

    def __init__(
        self,
        batch_size: int = 64,
        resize: bool = True,
        val_fraction: float = 0.2,
        seed: int = 0,
        num_workers: int = 0,
    ) -> None:
        super().__init__(batch_size, num_workers)
        if not 0.0 < val_fraction < 1.0:
            raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
        self.resize = resize
        self.val_fraction = val_fraction
        self.seed = seed
        side = 32 if resize else 8
        self.input_shape = (1, side, side)

    def _tensors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        try:
            from sklearn.datasets import load_digits
        except ImportError as error:
            raise ModuleNotFoundError(
                "DigitsDataModule reads scikit-learn's digits data set: "
                "pip install 'lightning-parallel[demo]'"
            ) from error

        digits = load_digits()
        images = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
        labels = torch.tensor(digits.target, dtype=torch.long)
        if self.resize:
            images = F.interpolate(images, size=(32, 32), mode="bilinear", align_corners=False)
        order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(self.seed))
        n_val = round(len(labels) * self.val_fraction)
        val_idx, train_idx = order[:n_val], order[n_val:]
        mean, std = images[train_idx].mean(), images[train_idx].std()
        images = (images - mean) / std
        return images[train_idx], labels[train_idx], images[val_idx], labels[val_idx]
