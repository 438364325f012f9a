"""Generated user-item interactions, for the ``recommender`` model."""

from __future__ import annotations

import torch
from torch.utils.data import TensorDataset

from lightning_parallel.demo.data.tensors import TensorDataModule

__all__: list[str] = []


class InteractionsDataModule(TensorDataModule):
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
