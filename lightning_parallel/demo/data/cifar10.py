"""CIFAR-10 read from its python-version files on disk (no download)."""

from __future__ import annotations

import pickle
import tarfile
from pathlib import Path
from typing import IO, Any

import torch
import torch.nn.functional as F
from torch.utils.data import TensorDataset

from lightning_parallel.demo.data.tensors import TensorDataModule

__all__: list[str] = []


class CIFAR10DataModule(TensorDataModule):
    """CIFAR-10 read from its python-version files on disk (no download).

    ``path`` is the extracted ``cifar-10-batches-py`` directory, a directory holding it, or
    the ``cifar-10-python.tar.gz`` archive itself. The training set is ``data_batch_1`` to
    ``data_batch_5`` (50,000 images), validation is ``test_batch`` (10,000); each file is a
    pickled dict whose ``b"data"`` is a ``uint8`` array of shape ``(N, 3072)`` (channel-major
    32x32 images) and ``b"labels"`` a list of class indices. Pixels are scaled to [0, 1] and
    normalized per channel with the training set's mean and standard deviation. ``augment``
    adds the usual random crop (4-pixel padding) and horizontal flip to training batches.

    Args:
        path: where the files are.
        num_samples: keep only the first ``num_samples`` training images (``None``: all).
        augment: random crop and flip on training batches.
        batch_size: samples per training step on each process.
        seed: seed of the augmentation.
        num_workers: data-loader worker processes.
    """

    FILES = (*(f"data_batch_{i}" for i in range(1, 6)), "test_batch")

    def __init__(
        self,
        path: str,
        num_samples: int | None = None,
        augment: bool = False,
        batch_size: int = 64,
        seed: int = 0,
        num_workers: int = 0,
    ) -> None:
        super().__init__(batch_size, num_workers)
        if num_samples is not None and num_samples < 1:
            raise ValueError(f"num_samples must be a positive integer or None, got {num_samples}")
        self.path = Path(path)
        if not self.path.exists():
            raise FileNotFoundError(
                f"no CIFAR-10 files at {self.path}: give the extracted cifar-10-batches-py "
                "directory or the cifar-10-python.tar.gz archive (this package downloads nothing)"
            )
        self.num_samples = num_samples
        self.augment = augment
        self.seed = seed
        self.input_shape = (3, 32, 32)

    def _batches(self) -> dict[str, dict[bytes, Any]]:
        if self.path.is_file():
            with tarfile.open(self.path) as archive:
                members = {Path(m.name).name: m for m in archive.getmembers() if m.isfile()}
                return {
                    name: _unpickle(archive.extractfile(members[name]))
                    for name in self.FILES
                    if name in members
                }
        for directory in (self.path, self.path / "cifar-10-batches-py"):
            if all((directory / name).is_file() for name in self.FILES):
                return {name: _unpickle((directory / name).open("rb")) for name in self.FILES}
        return {}

    def _tensors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        batches = self._batches()
        missing = [name for name in self.FILES if name not in batches]
        if missing:
            raise FileNotFoundError(f"{self.path} lacks the CIFAR-10 files {missing}")

        def stack(names: tuple[str, ...]) -> tuple[torch.Tensor, torch.Tensor]:
            data = [torch.as_tensor(batches[n][b"data"], dtype=torch.uint8) for n in names]
            labels = [torch.as_tensor(batches[n][b"labels"], dtype=torch.long) for n in names]
            images = torch.cat(data).view(-1, 3, 32, 32).to(torch.float32) / 255.0
            return images, torch.cat(labels)

        train_x, train_y = stack(self.FILES[:5])
        val_x, val_y = stack(self.FILES[5:])
        if self.num_samples is not None:
            train_x, train_y = train_x[: self.num_samples], train_y[: self.num_samples]
        mean = train_x.mean(dim=(0, 2, 3), keepdim=True)
        std = train_x.std(dim=(0, 2, 3), keepdim=True)
        return (train_x - mean) / std, train_y, (val_x - mean) / std, val_y

    def setup(self, stage: str | None = None) -> None:
        super().setup(stage)
        if self.augment and self.train_set is not None:
            images, labels = self.train_set.tensors
            self.train_set = _CropFlip(images, labels, self.seed)  # type: ignore[assignment]


def _unpickle(stream: IO[bytes] | None) -> dict[bytes, Any]:
    if stream is None:
        raise FileNotFoundError("a CIFAR-10 member of the archive is not a file")
    with stream:
        return pickle.load(stream, encoding="bytes")


class _CropFlip(TensorDataset):
    """Training images with a random 4-pixel-padded 32x32 crop and a random horizontal flip."""

    def __init__(self, images: torch.Tensor, labels: torch.Tensor, seed: int) -> None:
        super().__init__(images, labels)
        self.generator = torch.Generator().manual_seed(seed)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        image, label = super().__getitem__(index)
        dy, dx, flip = torch.randint(0, 9, (3,), generator=self.generator).tolist()
        padded = F.pad(image, (4, 4, 4, 4))[:, dy : dy + 32, dx : dx + 32]
        return (padded.flip(-1) if flip % 2 else padded), label
