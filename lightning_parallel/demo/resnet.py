"""CIFAR-style ResNet-18 and ResNet-50, written the usual way (not an ``nn.Sequential``).

He et al., "Deep Residual Learning for Image Recognition" (2016), with the CIFAR stem: one 3x3
convolution (stride 1), BatchNorm and ReLU instead of the 7x7 convolution and max pooling of
the ImageNet networks, then four stages of residual blocks (channels ``w, 2w, 4w, 8w``; stages
2 to 4 halve the resolution), global average pooling and a linear classifier. Every block adds
its input (or a 1x1 projection of it where the shape changes) to its output: a pipeline cut
inside a block carries two tensors.

- ``resnet18``: basic blocks (two 3x3 convolutions), ``[2, 2, 2, 2]`` per stage; with
  ``width=64`` and 10 classes, 11,173,962 parameters (the published CIFAR ResNet-18).
- ``resnet50``: bottleneck blocks (1x1, 3x3, 1x1, four times expansion), ``[3, 4, 6, 3]``; with
  ``width=64`` and 10 classes, 23,520,842 parameters (the CIFAR ResNet-50).

Plain torch: the Lightning models ``ResNet18``/``ResNet50`` in
:mod:`lightning_parallel.demo.models` wrap these networks.
"""

from __future__ import annotations

from torch import Tensor, nn

__all__: list[str] = []


class BasicBlock(nn.Module):
    """Two 3x3 convolutions and the skip connection (ResNet-18/34)."""

    expansion = 1

    def __init__(self, in_channels: int, channels: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, channels, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels)
        self.shortcut = _shortcut(in_channels, channels, stride)
        self.relu = nn.ReLU()

    def forward(self, x: Tensor) -> Tensor:
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + self.shortcut(x))


class Bottleneck(nn.Module):
    """1x1 reduce, 3x3, 1x1 expand (four times), and the skip connection (ResNet-50)."""

    expansion = 4

    def __init__(self, in_channels: int, channels: int, stride: int) -> None:
        super().__init__()
        out_channels = channels * self.expansion
        self.conv1 = nn.Conv2d(in_channels, channels, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, stride, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels)
        self.conv3 = nn.Conv2d(channels, out_channels, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(out_channels)
        self.shortcut = _shortcut(in_channels, out_channels, stride)
        self.relu = nn.ReLU()

    def forward(self, x: Tensor) -> Tensor:
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return self.relu(out + self.shortcut(x))


def _shortcut(in_channels: int, out_channels: int, stride: int) -> nn.Module:
    if stride == 1 and in_channels == out_channels:
        return nn.Identity()
    return nn.Sequential(
        nn.Conv2d(in_channels, out_channels, 1, stride, bias=False), nn.BatchNorm2d(out_channels)
    )


class ResNetNetwork(nn.Module):
    """Stem, four stages of ``block``, pooling and the classifier (see the module doc)."""

    def __init__(
        self,
        block: type[BasicBlock] | type[Bottleneck],
        blocks: tuple[int, int, int, int],
        width: int,
        in_channels: int,
        num_classes: int,
    ) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(in_channels, width, 3, 1, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU()
        )
        stages: list[nn.Module] = []
        channels = width
        for index, count in enumerate(blocks):
            planes = width * 2**index
            for position in range(count):
                stride = 2 if index > 0 and position == 0 else 1
                stages.append(block(channels, planes, stride))
                channels = planes * block.expansion
        self.blocks = nn.Sequential(*stages)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(channels, num_classes)
        for module in self.modules():
            if isinstance(module, nn.Conv2d):
                nn.init.kaiming_normal_(module.weight, mode="fan_out", nonlinearity="relu")

    def forward(self, x: Tensor) -> Tensor:
        out = self.blocks(self.stem(x))
        return self.fc(self.pool(out).flatten(1))

    def as_sequential(self) -> nn.Sequential:
        """The same modules as one ``nn.Sequential`` (stem, each block, pooling, flatten,
        classifier), computing what :meth:`forward` computes: the list of layers that engines
        taking a layer list (DeepSpeed's ``PipelineModule``, torchgpipe's ``GPipe``) are given.
        """
        return nn.Sequential(self.stem, *self.blocks, self.pool, nn.Flatten(), self.fc)


ARCHITECTURES: dict[str, tuple[type[BasicBlock] | type[Bottleneck], tuple[int, int, int, int]]] = {
    "resnet18": (BasicBlock, (2, 2, 2, 2)),
    "resnet50": (Bottleneck, (3, 4, 6, 3)),
}


def resnet(name: str, width: int, depth: int, in_channels: int, num_classes: int) -> ResNetNetwork:
    """The network ``name`` (``"resnet18"``, ``"resnet50"``) with ``width`` channels in the
    first stage and ``depth`` times the published number of blocks per stage."""
    if width < 1:
        raise ValueError(f"width must be at least 1, got {width}")
    if depth < 1:
        raise ValueError(f"depth must be at least 1 (blocks per stage multiplier), got {depth}")
    block, blocks = ARCHITECTURES[name]
    counts = (blocks[0] * depth, blocks[1] * depth, blocks[2] * depth, blocks[3] * depth)
    return ResNetNetwork(block, counts, width, in_channels, num_classes)
