"""Bundled models and data shared by the CLI, the examples, the benchmark and the tests.

The classes are Lightning classes, so each exists once per Lightning namespace (see
:mod:`lightning_parallel.compat`): the names here, and :func:`build_model` /
:func:`build_datamodule`, give the build that matches the Lightning your code uses.
"""

from __future__ import annotations

from typing import Any

from lightning_parallel.compat import layer
from lightning_parallel.compat.namespaces import Namespace, active, of_object
from lightning_parallel.compat.public import public_class

__all__ = [
    "DATAMODULES",
    "DEFAULT_DATA",
    "MLP",
    "MODELS",
    "CIFAR10DataModule",
    "ConvNet",
    "CorpusDataModule",
    "DemoClassifier",
    "DigitsDataModule",
    "GPT",
    "InteractionsDataModule",
    "Recommender",
    "ResNet18",
    "ResNet50",
    "SyntheticImageDataModule",
    "VGG16",
    "VGGMini",
    "build_datamodule",
    "build_model",
    "default_data",
]

DemoClassifier = public_class(
    "demo.models", "DemoClassifier", "Base of the demo models: cross-entropy classification."
)
VGGMini = public_class("demo.models", "VGGMini", "A small VGG-style convolutional network.")
ConvNet = public_class("demo.models", "ConvNet", "A two-convolution network.")
MLP = public_class("demo.models", "MLP", "A deep multilayer perceptron of equal blocks.")
VGG16 = public_class("demo.models", "VGG16", "VGG-16 for 32x32 images (BatchNorm).")
GPT = public_class("demo.models", "GPT", "A decoder-only transformer (next-token prediction).")
Recommender = public_class(
    "demo.models", "Recommender", "LSTM + autoencoder + attention recommender (two inputs)."
)
ResNet18 = public_class("demo.models", "ResNet18", "CIFAR-style ResNet-18 (skip connections).")
ResNet50 = public_class("demo.models", "ResNet50", "CIFAR-style ResNet-50 (bottlenecks).")
DigitsDataModule = public_class(
    "demo.data", "DigitsDataModule", "Scikit-learn's handwritten digits (needs the demo extra)."
)
SyntheticImageDataModule = public_class(
    "demo.data", "SyntheticImageDataModule", "Deterministic CIFAR-shaped images of any size."
)

MODELS: dict[str, Any] = {
    "vgg_mini": VGGMini,
    "convnet": ConvNet,
    "mlp": MLP,
    "vgg16": VGG16,
    "resnet18": ResNet18,
    "resnet50": ResNet50,
    "gpt": GPT,
    "recommender": Recommender,
}
InteractionsDataModule = public_class(
    "demo.data", "InteractionsDataModule", "Generated user-item interactions for recommender."
)
CorpusDataModule = public_class(
    "demo.data", "CorpusDataModule", "Generated token sequences (a Markov chain) for gpt."
)
CIFAR10DataModule = public_class(
    "demo.data", "CIFAR10DataModule", "CIFAR-10 from its python-version files (given a path)."
)
DATAMODULES: dict[str, Any] = {
    "digits": DigitsDataModule,
    "synthetic": SyntheticImageDataModule,
    "corpus": CorpusDataModule,
    "interactions": InteractionsDataModule,
    "cifar10": CIFAR10DataModule,
}
# the data set of each bundled model's kind, used when none is named
DEFAULT_DATA: dict[str, str] = {
    "vgg_mini": "digits",
    "convnet": "digits",
    "mlp": "digits",
    "vgg16": "synthetic",
    "resnet18": "synthetic",
    "resnet50": "synthetic",
    "gpt": "corpus",
    "recommender": "interactions",
}


def _lookup(kind: str, table: dict[str, Any], name: str) -> None:
    if name not in table:
        raise ValueError(f"unknown {kind} {name!r}; choose one of {sorted(table)}")


def build_datamodule(name: str, namespace: Namespace | None = None, **kwargs: Any) -> Any:
    """Build the bundled data module ``name`` (``"digits"``, ``"synthetic"``, ``"corpus"``,
    ``"interactions"``, ``"cifar10"`` given ``path``).

    Args:
        name: the data set's short name.
        namespace: the Lightning to build it for (default: the one in use).
        **kwargs: the data module's arguments.
    """
    _lookup("data", DATAMODULES, name)
    module = layer.import_layer(namespace or active(), "demo.data")
    return module.DATAMODULES[name](**kwargs)


def default_data(model: str) -> str:
    """The bundled data set of ``model``'s kind: ``digits`` for the small CNNs and the MLP,
    ``synthetic`` 32x32x3 images for vgg16 and the ResNets, ``corpus`` for gpt,
    ``interactions`` for recommender (``digits`` for a model that is not bundled)."""
    return DEFAULT_DATA.get(model, "digits")


def build_model(
    name: str, data: Any = None, namespace: Namespace | None = None, **kwargs: Any
) -> Any:
    """Build the bundled model ``name`` (``"vgg_mini"``, ``"convnet"``, ``"mlp"``,
    ``"vgg16"``, ``"resnet18"``, ``"resnet50"``, ``"gpt"``, ``"recommender"``).

    Given ``data``, the model's ``input_shape`` and ``num_classes`` are taken from it, and the
    model is built for ``data``'s Lightning.
    """
    _lookup("model", MODELS, name)
    if data is not None:
        kwargs.setdefault("input_shape", tuple(data.input_shape))
        kwargs.setdefault("num_classes", data.num_classes)
        namespace = namespace or of_object(data)
    module = layer.import_layer(namespace or active(), "demo.models")
    return module.MODELS[name](**kwargs)
