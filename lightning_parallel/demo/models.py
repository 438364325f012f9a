"""Bundled models: vgg_mini, convnet, mlp, vgg16, resnet18, resnet50, gpt and recommender.

Every model keeps its whole network in ``self.layers`` and ``forward(x) == self.layers(x)``.
For ``vgg_mini``, ``convnet``, ``mlp`` and ``vgg16`` it is an ``nn.Sequential`` of blocks,
which pipeline strategies split into stages directly; the ResNets are written the usual way,
with skip connections (:mod:`lightning_parallel.demo.resnet`), and pipelines cut them with
torch.fx. Every other strategy treats the model as one module. All log ``train_loss``,
``val_loss`` and ``val_acc`` (``torchmetrics``), and ``test_loss``/``test_acc`` under
``trainer.test``.

The models are defined by family, and this module registers them by short name
(:data:`MODELS`) and exports them:

- :mod:`lightning_parallel.demo.classifier`: :class:`DemoClassifier`, the base (loss,
  metrics, optimizer and learning-rate schedule);
- :mod:`lightning_parallel.demo.image_models`: vgg_mini, convnet, mlp, vgg16, resnet18 and
  resnet50;
- :mod:`lightning_parallel.demo.sequence_models`: gpt and recommender.
"""

from __future__ import annotations

from lightning_parallel.demo.classifier import DemoClassifier
from lightning_parallel.demo.image_models import MLP, VGG16, ConvNet, ResNet18, ResNet50, VGGMini
from lightning_parallel.demo.sequence_models import GPT, Recommender

__all__ = [
    "GPT",
    "MLP",
    "MODELS",
    "VGG16",
    "ConvNet",
    "DemoClassifier",
    "Recommender",
    "ResNet18",
    "ResNet50",
    "VGGMini",
]

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
