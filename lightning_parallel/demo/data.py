"""Bundled data: scikit-learn's handwritten digits (real, no download), generated images,
token sequences and interactions, and CIFAR-10 read from files a user already has.

Every data module exposes ``input_shape`` (channels, height, width; ``(length, features)``
for interactions) and ``num_classes`` so that
the demo models can be built to fit them (the CLI links them automatically).
"""

from __future__ import annotations

import pickle
import tarfile
from pathlib import Path
from typing import IO, Any

import torch
import torch.nn.functional as F
from pytorch_lightning import LightningDataModule
from torch.utils.data import DataLoader, TensorDataset

__all__: list[str] = []


class _TensorDataModule(LightningDataModule):
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


class DigitsDataModule(_TensorDataModule):
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


class SyntheticImageDataModule(_TensorDataModule):
    """Deterministic CIFAR-shaped images (3x32x32, 10 classes by default) of any size.

    Each class has a fixed random template; a sample is its class template plus Gaussian
    noise, so the task is learnable and accuracy means something, while the size is free for
    throughput runs. Everything derives from ``seed``.

    Args:
        num_samples: training samples (validation gets a fifth of that, at least one batch).
        image_size: height and width.
        channels: image channels.
        num_classes: classes.
        noise: standard deviation of the noise added to the class template.
        batch_size: samples per training step on each process.
        seed: seed of templates, noise and labels.
        num_workers: data-loader worker processes.
    """

    def __init__(
        self,
        num_samples: int = 4096,
        image_size: int = 32,
        channels: int = 3,
        num_classes: int = 10,
        noise: float = 1.0,
        batch_size: int = 64,
        seed: int = 0,
        num_workers: int = 0,
    ) -> None:
        super().__init__(batch_size, num_workers)
        for name, value in (("num_samples", num_samples), ("image_size", image_size)):
            if value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value}")
        if num_classes < 2:
            raise ValueError(f"num_classes must be at least 2, got {num_classes}")
        self.num_samples = num_samples
        self.num_classes = num_classes
        self.noise = noise
        self.seed = seed
        self.input_shape = (channels, image_size, image_size)

    def _make(self, count: int, generator: torch.Generator, templates: torch.Tensor) -> tuple:
        labels = torch.randint(0, self.num_classes, (count,), generator=generator)
        noise = torch.randn((count, *self.input_shape), generator=generator) * self.noise
        return templates[labels] + noise, labels

    def _tensors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        generator = torch.Generator().manual_seed(self.seed)
        templates = torch.randn((self.num_classes, *self.input_shape), generator=generator)
        train_x, train_y = self._make(self.num_samples, generator, templates)
        val_x, val_y = self._make(max(self.num_samples // 5, self.batch_size), generator, templates)
        return train_x, train_y, val_x, val_y


class CorpusDataModule(_TensorDataModule):
    """Generated token sequences with learnable structure, for next-token prediction.

    A fixed random Markov chain over ``vocab`` tokens: each token has ``successors`` likely next
    tokens (drawn once from ``seed``) with probabilities ``p, p·r, p·r², ...`` (``r = 0.5``,
    normalized), so the best possible next-token accuracy is the first probability (0.53 with
    the default 4 successors), against ``1/vocab`` for guessing. A sample is a window of
    ``context + 1`` tokens of one long walk (consecutive windows share one token): ``x`` the
    first ``context``, ``y`` the same shifted by one (the usual language-model pairs).
    ``input_shape`` is ``(context,)`` and ``num_classes`` the vocabulary.

    Args:
        vocab: tokens.
        context: tokens per sample.
        successors: likely next tokens per token (fewer => easier).
        num_samples: training samples (validation gets a fifth, at least one batch).
        batch_size: samples per training step on each process.
        seed: seed of the chain and the walk.
        num_workers: data-loader worker processes.
    """

    def __init__(
        self,
        vocab: int = 256,
        context: int = 64,
        successors: int = 4,
        num_samples: int = 4096,
        batch_size: int = 32,
        seed: int = 0,
        num_workers: int = 0,
    ) -> None:
        super().__init__(batch_size, num_workers)
        for name, value in (("vocab", vocab), ("context", context), ("num_samples", num_samples)):
            if value < 2:
                raise ValueError(f"{name} must be at least 2, got {value}")
        if not 1 <= successors <= vocab:
            raise ValueError(f"successors must be in [1, vocab={vocab}], got {successors}")
        self.vocab, self.context, self.successors = vocab, context, successors
        self.num_samples, self.seed = num_samples, seed
        self.input_shape = (context,)
        self.num_classes = vocab

    def _walk(self, length: int, table: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        weights = 0.5 ** torch.arange(self.successors, dtype=torch.float64)
        choices = torch.multinomial(
            weights / weights.sum(), length, replacement=True, generator=generator
        ).tolist()
        successors = table.tolist()
        tokens, token = [], 0
        for choice in choices:
            token = successors[token][choice]
            tokens.append(token)
        return torch.tensor(tokens, dtype=torch.int64)

    def _pairs(
        self, count: int, table: torch.Tensor, generator: torch.Generator
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # windows of one walk that overlap by one token only: no sample repeats another
        walk = self._walk(count * self.context + 1, table, generator)
        windows = walk.unfold(0, self.context + 1, self.context)[:count]
        return windows[:, :-1].contiguous(), windows[:, 1:].contiguous()

    def _tensors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        generator = torch.Generator().manual_seed(self.seed)
        # the chain: each token's likely successors, the same for training and validation
        table = torch.stack(
            [
                torch.randperm(self.vocab, generator=generator)[: self.successors]
                for _ in range(self.vocab)
            ]
        )
        train_x, train_y = self._pairs(self.num_samples, table, generator)
        val_x, val_y = self._pairs(max(self.num_samples // 5, self.batch_size), table, generator)
        return train_x, train_y, val_x, val_y


class InteractionsDataModule(_TensorDataModule):
    """Generated user-item interactions with learnable structure, for ``recommender``.

    Items fall into ``groups`` groups of equal size, and every user belongs to one group. A
    user's features are their group's fixed random vector plus noise (``feature_noise``). Their
    history is a walk through their group's items in a fixed cyclic order: with probability
    ``follow`` the next item is the one after the last, else any item of the group. A sample is
    ``(history, features, next item)``; the next item is predictable from the last item and the
    user's group (best accuracy about ``follow + (1 - follow) / group size``), while guessing gets
    ``1 / items``. ``input_shape`` is ``(length, features)`` and ``num_classes`` the items.

    Args:
        items: items in all.
        groups: item groups (and user groups).
        length: items in a history.
        features: user features.
        follow: probability that a user takes the next item of the cycle.
        feature_noise: standard deviation of the noise on a user's features.
        num_samples: training samples (validation gets a fifth, at least one batch).
        batch_size: samples per training step on each process.
        seed: seed of everything.
        num_workers: data-loader worker processes.
    """

    def __init__(
        self,
        items: int = 200,
        groups: int = 10,
        length: int = 16,
        features: int = 32,
        follow: float = 0.7,
        feature_noise: float = 0.5,
        num_samples: int = 4096,
        batch_size: int = 32,
        seed: int = 0,
        num_workers: int = 0,
    ) -> None:
        super().__init__(batch_size, num_workers)
        if groups < 1 or items % groups:
            raise ValueError(f"items ({items}) must be a positive multiple of groups ({groups})")
        for name, value in (
            ("length", length),
            ("features", features),
            ("num_samples", num_samples),
        ):
            if value < 1:
                raise ValueError(f"{name} must be at least 1, got {value}")
        if not 0.0 <= follow <= 1.0:
            raise ValueError(f"follow must be in [0, 1], got {follow}")
        self.items, self.groups, self.length, self.features = items, groups, length, features
        self.follow, self.feature_noise = follow, feature_noise
        self.num_samples, self.seed = num_samples, seed
        self.input_shape = (length, features)
        self.num_classes = items

    def _make(
        self, count: int, order: torch.Tensor, centers: torch.Tensor, generator: torch.Generator
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        size = self.items // self.groups
        group = torch.randint(0, self.groups, (count,), generator=generator)
        features = centers[group] + self.feature_noise * torch.randn(
            count, self.features, generator=generator
        )
        position = torch.randint(0, size, (count,), generator=generator)
        steps = []
        for _ in range(self.length + 1):
            steps.append(order[group, position])
            jump = torch.randint(0, size, (count,), generator=generator)
            follows = torch.rand(count, generator=generator) < self.follow
            position = torch.where(follows, (position + 1) % size, jump)
        walk = torch.stack(steps, 1)  # (count, length + 1) item ids
        return walk[:, :-1].contiguous(), features, walk[:, -1].contiguous()

    def setup(self, stage: str | None = None) -> None:
        if self.train_set is None:
            generator = torch.Generator().manual_seed(self.seed)
            # each group's items in a fixed cyclic order; each group's feature vector
            order = torch.randperm(self.items, generator=generator).view(self.groups, -1)
            centers = torch.randn(self.groups, self.features, generator=generator)
            validation = max(self.num_samples // 5, self.batch_size)
            self.train_set = TensorDataset(*self._make(self.num_samples, order, centers, generator))
            self.val_set = TensorDataset(*self._make(validation, order, centers, generator))


class CIFAR10DataModule(_TensorDataModule):
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


DATAMODULES: dict[str, type[LightningDataModule]] = {
    "digits": DigitsDataModule,
    "synthetic": SyntheticImageDataModule,
    "corpus": CorpusDataModule,
    "interactions": InteractionsDataModule,
    "cifar10": CIFAR10DataModule,
}
