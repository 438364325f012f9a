"""Generated CIFAR-shaped images: a class template plus noise, any size."""

from __future__ import annotations

import torch

from lightning_parallel.demo.data.tensors import TensorDataModule

__all__: list[str] = []


class SyntheticImageDataModule(TensorDataModule):
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
