"""Bundled models: vgg_mini, convnet, mlp, vgg16, resnet18, resnet50, gpt and recommender.

Every model keeps its whole network in ``self.layers`` and ``forward(x) == self.layers(x)``.
For ``vgg_mini``, ``convnet``, ``mlp`` and ``vgg16`` it is an ``nn.Sequential`` of blocks,
which pipeline strategies split into stages directly; the ResNets are written the usual way,
with skip connections (:mod:`lightning_parallel.demo.resnet`), and pipelines cut them with
torch.fx. Every other strategy treats the model as one module. All log ``train_loss``,
``val_loss`` and ``val_acc`` (``torchmetrics``), and ``test_loss``/``test_acc`` under
``trainer.test``.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from pytorch_lightning import LightningModule
from torch import nn
from torchmetrics.classification import MulticlassAccuracy

from lightning_parallel.demo.gpt import GPTNetwork
from lightning_parallel.demo.recommender import RecommenderNetwork
from lightning_parallel.demo.resnet import resnet

__all__: list[str] = []

_OPTIMIZERS = ("sgd", "adamw")
_SCHEDULES = ("constant", "cosine")


class DemoClassifier(LightningModule):
    """Base of the demo models: cross-entropy classification with accuracy metrics.

    Subclasses implement :meth:`build_layers`. Args common to every demo model:

    Args:
        input_shape: (channels, height, width) of one sample; the CLI takes it from the data.
        num_classes: number of classes.
        lr: learning rate.
        momentum: SGD momentum (ignored by AdamW).
        weight_decay: L2 penalty.
        optimizer: ``"sgd"`` or ``"adamw"``.
        lr_schedule: ``"constant"`` or ``"cosine"``: the learning rate follows
            ``lr·(1 + cos(π·t/T))/2`` over the fit's ``T`` optimizer steps
            (``trainer.estimated_stepping_batches``), stepped after every batch.
    """

    def __init__(
        self,
        input_shape: tuple[int, int, int] = (1, 32, 32),
        num_classes: int = 10,
        lr: float = 0.05,
        momentum: float = 0.9,
        weight_decay: float = 0.0,
        optimizer: str = "sgd",
        lr_schedule: str = "constant",
    ) -> None:
        super().__init__()
        if optimizer not in _OPTIMIZERS:
            raise ValueError(f"optimizer must be one of {_OPTIMIZERS}, got {optimizer!r}")
        if lr_schedule not in _SCHEDULES:
            raise ValueError(f"lr_schedule must be one of {_SCHEDULES}, got {lr_schedule!r}")
        self.lr_schedule = lr_schedule
        if lr <= 0:
            raise ValueError(f"lr must be positive, got {lr}")
        if not input_shape or min(input_shape) < 1:
            raise ValueError(
                "input_shape must be the positive sizes of one sample ((channels, height, "
                f"width) for images, (context,) for token sequences), got {input_shape}"
            )
        self.save_hyperparameters()
        self.lr, self.momentum, self.weight_decay, self.optimizer_name = (
            lr,
            momentum,
            weight_decay,
            optimizer,
        )
        self.input_shape = tuple(input_shape)
        self.num_classes = num_classes
        self.layers = self.build_layers(tuple(input_shape), num_classes)  # type: ignore[arg-type]
        self.val_acc = MulticlassAccuracy(num_classes=num_classes, average="micro")
        self.test_acc = MulticlassAccuracy(num_classes=num_classes, average="micro")

    def build_layers(self, input_shape: tuple[int, int, int], num_classes: int) -> nn.Sequential:
        """Return the network as a sequence of blocks (overridden by every model)."""
        raise TypeError(f"{type(self).__name__} must override build_layers()")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def _evaluate(self, batch: Any, prefix: str, metric: MulticlassAccuracy) -> torch.Tensor:
        x, y = batch
        logits = self(x)
        loss = F.cross_entropy(logits, y)
        metric(logits, y)
        self.log(f"{prefix}_loss", loss, prog_bar=True, sync_dist=True)
        self.log(f"{prefix}_acc", metric, prog_bar=True)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self._evaluate(batch, "val", self.val_acc)

    def test_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self._evaluate(batch, "test", self.test_acc)

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self(batch[0]).argmax(dim=-1)

    def configure_optimizers(self) -> Any:
        optimizer: torch.optim.Optimizer
        if self.optimizer_name == "adamw":
            optimizer = torch.optim.AdamW(
                self.parameters(), lr=self.lr, weight_decay=self.weight_decay
            )
        else:
            optimizer = torch.optim.SGD(
                self.parameters(),
                lr=self.lr,
                momentum=self.momentum,
                weight_decay=self.weight_decay,
            )
        if self.lr_schedule == "constant":
            return optimizer
        total = max(1, int(self.trainer.estimated_stepping_batches))
        scheduler = torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda step: 0.5 * (1.0 + math.cos(math.pi * min(step, total) / total))
        )
        schedule = {"scheduler": scheduler, "interval": "step"}
        return {"optimizer": optimizer, "lr_scheduler": schedule}


def _conv_block(in_channels: int, out_channels: int, batch_norm: bool) -> nn.Sequential:
    layers: list[nn.Module] = [nn.Conv2d(in_channels, out_channels, 3, padding=1)]
    if batch_norm:
        layers.append(nn.BatchNorm2d(out_channels))
    layers.append(nn.ReLU())
    return nn.Sequential(*layers)


def _vgg_init(network: nn.Module) -> None:
    """VGG's initialization: without it nine ReLU layers without BatchNorm do not train.

    Convolutions get Kaiming-normal weights (fan-out, ReLU gain), linear layers N(0, 0.01),
    biases zero (Simonyan & Zisserman 2015; He et al. 2015).
    """
    for module in network.modules():
        if isinstance(module, nn.Conv2d):
            nn.init.kaiming_normal_(module.weight, mode="fan_out", nonlinearity="relu")
        elif isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, 0.0, 0.01)
        if isinstance(module, (nn.Conv2d, nn.Linear)) and module.bias is not None:
            nn.init.zeros_(module.bias)


class VGGMini(DemoClassifier):
    """A small VGG: six 3x3 convolutions in three stages, then three large linear layers.

    As in VGG-16, the fully-connected layers hold most of the parameters (about 12.6M of
    12.9M with the defaults on 32x32 inputs), and the convolutions most of the compute.

    Args:
        width: channels of the first convolution stage (doubled at each stage).
        fc_width: width of the first hidden linear layer (the second has a quarter).
        batch_norm: put BatchNorm after every convolution.
        **kwargs: see :class:`DemoClassifier` (``lr`` defaults to 0.02 here).
    """

    def __init__(
        self, width: int = 32, fc_width: int = 4096, batch_norm: bool = False, **kwargs: Any
    ) -> None:
        self.width, self.fc_width, self.batch_norm = width, fc_width, batch_norm
        # 0.05 diverges without BatchNorm; 0.02 trained best of {0.01, 0.02, 0.05} on digits
        kwargs.setdefault("lr", 0.02)
        super().__init__(**kwargs)

    def build_layers(self, input_shape: tuple[int, int, int], num_classes: int) -> nn.Sequential:
        channels, height, width = input_shape
        if height % 8 or width % 8:
            raise ValueError(f"vgg_mini needs height and width divisible by 8, got {input_shape}")
        w, bn = self.width, self.batch_norm
        flat = 4 * w * (height // 8) * (width // 8)
        layers = nn.Sequential(
            _conv_block(channels, w, bn),
            _conv_block(w, w, bn),
            nn.MaxPool2d(2),
            _conv_block(w, 2 * w, bn),
            _conv_block(2 * w, 2 * w, bn),
            nn.MaxPool2d(2),
            _conv_block(2 * w, 4 * w, bn),
            _conv_block(4 * w, 4 * w, bn),
            nn.MaxPool2d(2),
            nn.Flatten(),
            nn.Sequential(nn.Linear(flat, self.fc_width), nn.ReLU()),
            nn.Sequential(nn.Linear(self.fc_width, self.fc_width // 4), nn.ReLU()),
            nn.Linear(self.fc_width // 4, num_classes),
        )
        _vgg_init(layers)
        return layers


class ConvNet(DemoClassifier):
    """A small CNN: two convolution stages and two linear layers (about 0.1M parameters).

    Args:
        width: channels of the first convolution (the second has twice as many).
        **kwargs: see :class:`DemoClassifier`.
    """

    def __init__(self, width: int = 16, **kwargs: Any) -> None:
        self.width = width
        super().__init__(**kwargs)

    def build_layers(self, input_shape: tuple[int, int, int], num_classes: int) -> nn.Sequential:
        channels, height, width = input_shape
        if height % 4 or width % 4:
            raise ValueError(f"convnet needs height and width divisible by 4, got {input_shape}")
        w = self.width
        return nn.Sequential(
            _conv_block(channels, w, False),
            nn.MaxPool2d(2),
            _conv_block(w, 2 * w, False),
            nn.MaxPool2d(2),
            nn.Flatten(),
            nn.Sequential(nn.Linear(2 * w * (height // 4) * (width // 4), 64), nn.ReLU()),
            nn.Linear(64, num_classes),
        )


class MLP(DemoClassifier):
    """A deep multilayer perceptron: an input layer, ``depth`` equal blocks, a classifier.

    The equal blocks make it the natural pipeline case: any split into stages is balanced.

    Args:
        depth: number of hidden blocks (Linear + optional BatchNorm + ReLU); at least 1.
        width: width of every hidden block.
        batch_norm: put BatchNorm1d in every block.
        **kwargs: see :class:`DemoClassifier` (``lr`` defaults to 0.02 and ``lr_schedule``
            to ``"cosine"`` here).
    """

    def __init__(
        self, depth: int = 8, width: int = 256, batch_norm: bool = False, **kwargs: Any
    ) -> None:
        if depth < 1:
            raise ValueError(f"depth must be at least 1, got {depth}")
        self.depth, self.width, self.batch_norm = depth, width, batch_norm
        # on digits after 3 epochs: 0.86 val accuracy at lr 0.02, 0.67 at 0.05
        kwargs.setdefault("lr", 0.02)
        # at a constant rate the final accuracy after 5 epochs of digits swung by 5 points from
        # seed to seed (0.900-0.969 for the same pipeline); decayed to 0, every strategy ends on
        # its plateau, which is what comparisons of strategies need
        kwargs.setdefault("lr_schedule", "cosine")
        super().__init__(**kwargs)

    def _block(self, in_features: int) -> nn.Sequential:
        layers: list[nn.Module] = [nn.Linear(in_features, self.width)]
        if self.batch_norm:
            layers.append(nn.BatchNorm1d(self.width))
        layers.append(nn.ReLU())
        return nn.Sequential(*layers)

    def build_layers(self, input_shape: tuple[int, int, int], num_classes: int) -> nn.Sequential:
        in_features = math.prod(input_shape)
        blocks = [self._block(self.width) for _ in range(self.depth)]
        layers = nn.Sequential(
            nn.Flatten(),
            self._block(in_features),
            *blocks,
            nn.Linear(self.width, num_classes),
        )
        # PyTorch's default init shrinks the signal through ten ReLU layers and the MLP stays
        # at chance; Kaiming (fan-in, ReLU gain) keeps its scale
        for module in layers.modules():
            if isinstance(module, nn.Linear):
                nn.init.kaiming_normal_(module.weight, nonlinearity="relu")
                nn.init.zeros_(module.bias)
        return layers


class GPT(DemoClassifier):
    """A decoder-only transformer predicting the next token (:mod:`lightning_parallel.demo.gpt`).

    Built for a token data set (``corpus``): ``input_shape`` is ``(context,)`` and
    ``num_classes`` the vocabulary. The loss and the accuracy are over every position of every
    sequence.

    Args:
        d_model: width of the embeddings and blocks (768 for GPT-2 small).
        depth: transformer blocks (12 for GPT-2 small).
        heads: attention heads (``d_model`` must be a multiple; 12 for GPT-2 small).
        **kwargs: see :class:`DemoClassifier` (``optimizer`` defaults to ``"adamw"``, ``lr`` to
            3e-3 and ``lr_schedule`` to ``"cosine"`` here).
    """

    def __init__(self, d_model: int = 64, depth: int = 2, heads: int = 4, **kwargs: Any) -> None:
        self.d_model, self.depth, self.heads = d_model, depth, heads
        kwargs.setdefault("optimizer", "adamw")
        kwargs.setdefault("lr", 3e-3)
        kwargs.setdefault("lr_schedule", "cosine")
        kwargs.setdefault("input_shape", (64,))
        kwargs.setdefault("num_classes", 256)
        super().__init__(**kwargs)

    def build_layers(self, input_shape: tuple[int, ...], num_classes: int) -> nn.Module:  # type: ignore[override]
        if len(input_shape) != 1:
            raise ValueError(
                f"gpt reads token sequences: input_shape must be (context,), got {input_shape}; "
                "use --data corpus"
            )
        return GPTNetwork(num_classes, input_shape[0], self.d_model, self.depth, self.heads)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.cross_entropy(self(x).flatten(0, 1), y.flatten())
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def _evaluate(self, batch: Any, prefix: str, metric: MulticlassAccuracy) -> torch.Tensor:
        x, y = batch
        logits, targets = self(x).flatten(0, 1), y.flatten()
        loss = F.cross_entropy(logits, targets)
        metric(logits, targets)
        self.log(f"{prefix}_loss", loss, prog_bar=True, sync_dist=True)
        self.log(f"{prefix}_acc", metric, prog_bar=True)
        return loss


class Recommender(DemoClassifier):
    """The compound recommender (:mod:`lightning_parallel.demo.recommender`): two inputs, two
    outputs, a two-part loss.

    Built for ``interactions``: ``input_shape`` is ``(history length, user features)`` and
    ``num_classes`` the items. A batch is ``(history, features, next item)``; the loss is the
    cross-entropy of the next item plus ``reconstruction_weight`` times the mean squared error
    of the reconstructed features; accuracy is of the next item.

    Args:
        width: embedding, LSTM and hidden width.
        code: width of the autoencoder's code.
        lstm_layers: stacked LSTM layers.
        reconstruction_weight: weight of the autoencoder's loss.
        **kwargs: see :class:`DemoClassifier` (``optimizer`` defaults to ``"adamw"``, ``lr`` to
            3e-3 here).
    """

    def __init__(
        self,
        width: int = 64,
        code: int = 16,
        lstm_layers: int = 1,
        reconstruction_weight: float = 0.1,
        **kwargs: Any,
    ) -> None:
        self.width, self.code, self.lstm_layers = width, code, lstm_layers
        self.reconstruction_weight = reconstruction_weight
        kwargs.setdefault("optimizer", "adamw")
        kwargs.setdefault("lr", 3e-3)
        kwargs.setdefault("input_shape", (16, 32))
        kwargs.setdefault("num_classes", 200)
        super().__init__(**kwargs)

    def build_layers(self, input_shape: tuple[int, ...], num_classes: int) -> nn.Module:  # type: ignore[override]
        if len(input_shape) != 2:
            raise ValueError(
                "recommender reads (history, features): input_shape must be (history length, "
                f"user features), got {input_shape}; use --data interactions"
            )
        return RecommenderNetwork(
            num_classes, input_shape[1], self.width, self.code, self.lstm_layers
        )

    def forward(self, history: torch.Tensor, features: torch.Tensor) -> Any:  # type: ignore[override]
        return self.layers(history, features)

    def _loss(self, batch: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        history, features, target = batch
        scores, reconstruction = self(history, features)
        loss = F.cross_entropy(scores, target)
        loss = loss + self.reconstruction_weight * F.mse_loss(reconstruction, features)
        return loss, scores, target

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss, _, _ = self._loss(batch)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def _evaluate(self, batch: Any, prefix: str, metric: MulticlassAccuracy) -> torch.Tensor:
        loss, scores, target = self._loss(batch)
        metric(scores, target)
        self.log(f"{prefix}_loss", loss, prog_bar=True, sync_dist=True)
        self.log(f"{prefix}_acc", metric, prog_bar=True)
        return loss

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self(batch[0], batch[1])[0].argmax(dim=-1)


_VGG16 = (1, 1, "M", 2, 2, "M", 4, 4, 4, "M", 8, 8, 8, "M", 8, 8, 8, "M")


class VGG16(DemoClassifier):
    """VGG-16 for 32x32 images: thirteen 3x3 convolutions in five stages, then a classifier.

    The CIFAR form of Simonyan & Zisserman's network: the convolutions of VGG-16 (channels
    ``w, 2w, 4w, 8w, 8w``, a max pooling after each stage), BatchNorm after every convolution,
    and one linear layer on the ``8w`` features of the 1x1 map. With ``width=64``,
    ``batch_norm=True`` and 10 classes it has 14,728,266 parameters, the usual CIFAR VGG-16.

    Args:
        width: channels of the first stage (default 16; 64 is the published network).
        batch_norm: BatchNorm after every convolution (default ``True``).
        **kwargs: see :class:`DemoClassifier` (``lr`` defaults to 0.02 here).
    """

    def __init__(self, width: int = 16, batch_norm: bool = True, **kwargs: Any) -> None:
        if width < 1:
            raise ValueError(f"width must be at least 1, got {width}")
        self.width, self.batch_norm = width, batch_norm
        kwargs.setdefault("lr", 0.02)
        super().__init__(**kwargs)

    def build_layers(self, input_shape: tuple[int, int, int], num_classes: int) -> nn.Sequential:
        channels, height, width = input_shape
        if height % 32 or width % 32:
            raise ValueError(
                f"vgg16 pools five times: it needs height and width divisible by 32 (CIFAR's "
                f"32x32), got {input_shape}; use --data synthetic (32x32) or vgg_mini for digits"
            )
        layers: list[nn.Module] = []
        current = channels
        for entry in _VGG16:
            if entry == "M":
                layers.append(nn.MaxPool2d(2))
                continue
            out = int(entry) * self.width
            layers.append(_conv_block(current, out, self.batch_norm))
            current = out
        flat = current * (height // 32) * (width // 32)
        network = nn.Sequential(*layers, nn.Flatten(), nn.Linear(flat, num_classes))
        _vgg_init(network)
        return network


class _ResNet(DemoClassifier):
    architecture = "resnet18"

    def __init__(self, width: int = 16, depth: int = 1, **kwargs: Any) -> None:
        self.width, self.depth = width, depth
        super().__init__(**kwargs)

    def build_layers(self, input_shape: tuple[int, int, int], num_classes: int) -> nn.Module:  # type: ignore[override]
        return resnet(self.architecture, self.width, self.depth, input_shape[0], num_classes)


class ResNet18(_ResNet):
    """CIFAR-style ResNet-18: basic blocks, 2-2-2-2 per stage, skip connections, BatchNorm.

    Args:
        width: channels of the first stage (default 16; 64 is the published network, 11.2M
            parameters with 10 classes).
        depth: blocks per stage, as a multiple of the published 2-2-2-2.
        **kwargs: see :class:`DemoClassifier`.
    """

    architecture = "resnet18"


class ResNet50(_ResNet):
    """CIFAR-style ResNet-50: bottleneck blocks, 3-4-6-3 per stage, skip connections, BatchNorm.

    Args:
        width: channels of the first stage before the four times expansion (default 16; 64 is
            the published network, 23.5M parameters with 10 classes).
        depth: blocks per stage, as a multiple of the published 3-4-6-3.
        **kwargs: see :class:`DemoClassifier`.
    """

    architecture = "resnet50"


MODELS: dict[str, type[DemoClassifier]] = {
    "vgg_mini": VGGMini,
    "convnet": ConvNet,
    "mlp": MLP,
    "vgg16": VGG16,
    "resnet18": ResNet18,
    "resnet50": ResNet50,
    "gpt": GPT,
    "recommender": Recommender,
}
