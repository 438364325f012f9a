"""A user's own modules for ``bench``/``plan --model PKG.Class``: models from torchvision, timm
and transformers, and data modules of random images and token sequences.

Used to check the plan on models it was not built on (``docs/choosing.md``)::

    PYTHONPATH=examples lightning-parallel bench --predict \\
        --model user_models.Vision:name=resnet18 --data user_models.Images \\
        -s ddp -s hylo --bandwidth 100mbit --max-steps 24

``Vision:library=timm,name=vit_tiny_patch16_224`` takes a timm model (built at 32 pixels), and
``Text:name=gpt2`` a narrow GPT-2 from transformers, trained on ``Tokens``.
"""

from __future__ import annotations

from typing import Any

import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset


def _vision(library: str, name: str, classes: int) -> nn.Module:
    if library == "torchvision":
        import torchvision

        return torchvision.models.get_model(name, weights=None, num_classes=classes)
    if library == "timm":
        import timm

        return timm.create_model(name, pretrained=False, num_classes=classes, img_size=32)
    raise ValueError(f"library must be 'torchvision' or 'timm', got {library!r}")


class Vision(pl.LightningModule):
    """An image classifier from torchvision or timm, trained with SGD and momentum."""

    def __init__(
        self,
        library: str = "torchvision",
        name: str = "resnet18",
        classes: int = 10,
        lr: float = 0.05,
    ) -> None:
        super().__init__()
        self.net = _vision(library, name, classes)
        self.lr = lr

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        images, labels = batch
        return F.cross_entropy(self.net(images), labels)

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        images, labels = batch
        logits = self.net(images)
        self.log("val_loss", F.cross_entropy(logits, labels), sync_dist=True)
        self.log("val_acc", (logits.argmax(1) == labels).float().mean(), sync_dist=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)


class Text(pl.LightningModule):
    """A narrow causal language model from transformers (GPT-2 layout), trained with AdamW."""

    def __init__(
        self, name: str = "gpt2", layers: int = 4, width: int = 256, vocab: int = 4096
    ) -> None:
        super().__init__()
        from transformers import AutoConfig, AutoModelForCausalLM

        config = AutoConfig.for_model(
            name, n_layer=layers, n_embd=width, n_head=4, vocab_size=vocab, n_positions=64
        )
        self.model = AutoModelForCausalLM.from_config(config)

    def training_step(self, batch: tuple[Tensor], batch_idx: int) -> Tensor:
        (ids,) = batch
        return self.model(input_ids=ids, labels=ids).loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=3e-4)


class Images(pl.LightningDataModule):
    """Random 32x32 colour images with random labels (timing and bytes, not accuracy)."""

    def __init__(self, batch_size: int = 32, seed: int = 0, samples: int = 2048) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(seed)
        self.batch_size = batch_size
        images = torch.randn(samples, 3, 32, 32, generator=generator)
        labels = torch.randint(0, 10, (samples,), generator=generator)
        self.train_set = TensorDataset(images, labels)
        self.val_set = TensorDataset(images[:256], labels[:256])

    def train_dataloader(self) -> DataLoader[Any]:
        return DataLoader(self.train_set, batch_size=self.batch_size, shuffle=True, drop_last=True)

    def val_dataloader(self) -> DataLoader[Any]:
        return DataLoader(self.val_set, batch_size=self.batch_size)


class Tokens(pl.LightningDataModule):
    """Random token sequences of 32 tokens."""

    def __init__(self, batch_size: int = 32, seed: int = 0, samples: int = 2048) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(seed)
        self.batch_size = batch_size
        self.train_set = TensorDataset(torch.randint(0, 4096, (samples, 32), generator=generator))

    def train_dataloader(self) -> DataLoader[Any]:
        return DataLoader(self.train_set, batch_size=self.batch_size, shuffle=True, drop_last=True)
