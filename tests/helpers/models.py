"""A small model and data the device and GPU fits share."""

from __future__ import annotations

from typing import Any

import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset
from torchmetrics.classification import MulticlassAccuracy


class ConvBatchNormNet(pl.LightningModule):
    """Convolution, BatchNorm and two linear layers on 1x8x8 inputs, 4 classes: every Hylo
    route and BatchNorm statistics. Given ``device_type``, a training step on another device
    fails; with ``metric``, validation also updates and logs a torchmetrics accuracy."""

    def __init__(
        self,
        channels: int = 4,
        hidden: int = 32,
        device_type: str | None = None,
        metric: bool = False,
    ) -> None:
        super().__init__()
        self.device_type = device_type
        self.accuracy = MulticlassAccuracy(num_classes=4) if metric else None
        self.layers = nn.Sequential(
            nn.Conv2d(1, channels, 3, padding=1),
            nn.BatchNorm2d(channels),
            nn.ReLU(),
            nn.Flatten(),
            nn.Linear(channels * 8 * 8, hidden),
            nn.ReLU(),
            nn.Linear(hidden, 4),
        )

    def forward(self, x: Tensor) -> Tensor:
        return self.layers(x)

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        x, y = batch
        output = self(x)
        if self.device_type is not None and output.device.type != self.device_type:
            raise AssertionError(f"the step ran on {output.device}, not on {self.device_type}")
        loss = F.cross_entropy(output, y)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        logits = self(x)
        self.log("val_loss", F.cross_entropy(logits, y), sync_dist=True)
        if self.accuracy is not None:
            self.accuracy(logits, y)
            self.log("val_acc", self.accuracy)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


class TracedConvBatchNormNet(ConvBatchNormNet):
    """:class:`ConvBatchNormNet` whose forward is not one ``nn.Sequential`` call (layers as
    attributes, called in turn): a pipeline must trace it to find its layers."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        conv, norm, relu, flatten, hidden, relu2, out = self.layers
        del self.layers
        self.conv, self.norm, self.relu, self.flatten = conv, norm, relu, flatten
        self.hidden, self.relu2, self.out = hidden, relu2, out

    def forward(self, x: Tensor) -> Tensor:
        x = self.flatten(self.relu(self.norm(self.conv(x))))
        return self.out(self.relu2(self.hidden(x)))


class PositionEmbeddedNet(TracedConvBatchNormNet):
    """:class:`TracedConvBatchNormNet` with parameters of its own, outside its submodules: one
    added to the input (as a vision transformer adds its position embedding) and one scaling
    the logits. A traced segment holds each in a slot of its own, whichever stage it is in."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.position = nn.Parameter(0.1 * torch.randn(1, 1, 8, 8))
        self.temperature = nn.Parameter(torch.ones(1))

    def forward(self, x: Tensor) -> Tensor:
        return super().forward(x + self.position) * self.temperature


def image_loader(samples: int = 64, batch_size: int = 8) -> DataLoader:
    """``samples`` random 1x8x8 images with 4 classes, fixed by seed 0."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(samples, 1, 8, 8, generator=generator)
    y = torch.randint(0, 4, (samples,), generator=generator)
    return DataLoader(TensorDataset(x, y), batch_size=batch_size)


class TiedKeywordLM(pl.LightningModule):
    """A language model as transformers writes one, in plain torch: no ``forward`` on the
    ``LightningModule``, the network called with keyword arguments, a dict with the loss
    computed inside, the input embedding tied to the output head, dropout. A pipeline splits
    it through ``torch.export`` and keeps the tied matrix on the first and last stage."""

    class Network(nn.Module):
        def __init__(self, vocabulary: int = 32, width: int = 32, blocks: int = 4) -> None:
            super().__init__()
            self.embedding = nn.Embedding(vocabulary, width)
            self.blocks = nn.ModuleList(nn.Linear(width, width) for _ in range(blocks))
            self.dropout = nn.Dropout(0.1)
            self.head = nn.Linear(width, vocabulary, bias=False)
            self.head.weight = self.embedding.weight

        def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> Any:
            hidden = self.embedding(input_ids)
            for block in self.blocks:
                hidden = hidden + self.dropout(F.gelu(block(hidden)))
            logits = self.head(hidden)
            output = {"logits": logits}
            if labels is not None:
                flat = logits[:, :-1].reshape(-1, logits.size(-1))
                output["loss"] = F.cross_entropy(flat, labels[:, 1:].reshape(-1))
            return output

    def __init__(self, device_type: str = "cpu") -> None:
        super().__init__()
        self.model = self.Network()
        self.device_type = device_type

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (ids,) = batch
        assert ids.device.type == self.device_type
        loss = self.model(input_ids=ids, labels=ids)["loss"]
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        (ids,) = batch
        self.log("val_loss", self.model(input_ids=ids, labels=ids)["loss"])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def token_loader(samples: int = 64, batch_size: int = 8, vocabulary: int = 32) -> DataLoader:
    """``samples`` random sequences of 12 tokens, fixed by seed 0."""
    generator = torch.Generator().manual_seed(0)
    return DataLoader(
        TensorDataset(torch.randint(0, vocabulary, (samples, 12), generator=generator)),
        batch_size=batch_size,
    )
