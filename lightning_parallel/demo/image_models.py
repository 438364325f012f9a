"""The demo's image classifiers: vgg_mini, convnet, mlp, vgg16, resnet18 and resnet50.

Each reads images of ``input_shape = (channels, height, width)`` and trains with
:class:`~lightning_parallel.demo.classifier.DemoClassifier`'s steps (one label per image,
cross-entropy). The networks:

- :class:`VGGMini`, :class:`ConvNet` and :class:`VGG16`: stages of 3x3 convolution blocks
  (convolution, optional BatchNorm, ReLU), a 2x2 max pooling after each stage, then linear
  layers; the VGGs start from VGG's initialization (Kaiming-normal convolutions, N(0, 0.01)
  linear layers, zero biases);
- :class:`MLP`: ``Flatten``, an input block, ``depth`` equal hidden blocks (Linear, optional
  BatchNorm, ReLU) and a classifier, Kaiming-initialized;
- :class:`ResNet18` and :class:`ResNet50`: the CIFAR ResNets of
  :mod:`lightning_parallel.demo.resnet` (basic or bottleneck blocks with skip connections).

All but the ResNets are an ``nn.Sequential`` of blocks, which pipeline strategies split into
stages directly; pipelines cut the ResNets with torch.fx.
"""

from __future__ import annotations

import math
from typing import Any

from torch import nn

from lightning_parallel.demo.classifier import DemoClassifier
from lightning_parallel.demo.resnet import resnet

__all__: list[str] = []


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
