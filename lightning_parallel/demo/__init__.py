"""Bundled models and data shared by the CLI, the examples, the benchmark and the tests.

The classes are Lightning classes, so each exists once per Lightning namespace (see
:mod:`lightning_parallel.compat`): the names here, and :func:`build_model` /
:func:`build_datamodule`, give the build that matches the Lightning your code uses.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from lightning_parallel.compat.namespaces import Namespace, active, of_object

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

if TYPE_CHECKING:  # what a type checker reads: the lightning.pytorch build
    from lightning_parallel.lightning.demo.data import (
        CIFAR10DataModule,
        CorpusDataModule,
        DigitsDataModule,
        InteractionsDataModule,
        SyntheticImageDataModule,
    )
    from lightning_parallel.lightning.demo.models import (
        GPT,
        MLP,
        VGG16,
        ConvNet,
        DemoClassifier,
        Recommender,
        ResNet18,
        ResNet50,
        VGGMini,
    )

# each bundled model's class name, in the layer module ``demo.models`` of either build
MODELS: dict[str, str] = {
    "vgg_mini": "VGGMini",
    "convnet": "ConvNet",
    "mlp": "MLP",
    "vgg16": "VGG16",
    "resnet18": "ResNet18",
    "resnet50": "ResNet50",
    "gpt": "GPT",
    "recommender": "Recommender",
}
# each bundled data set's class name, in the layer module ``demo.data`` of either build
DATAMODULES: dict[str, str] = {
    "digits": "DigitsDataModule",
    "synthetic": "SyntheticImageDataModule",
    "corpus": "CorpusDataModule",
    "interactions": "InteractionsDataModule",
    "cifar10": "CIFAR10DataModule",
}
_CLASSES: dict[str, str] = {
    **{name: "demo.models" for name in [*MODELS.values(), "DemoClassifier"]},
    **{name: "demo.data" for name in DATAMODULES.values()},
}


def __getattr__(name: str) -> Any:
    """A demo class, from the build of the Lightning in use (:func:`.namespaces.active`)."""
    if name not in _CLASSES:
        raise AttributeError(f"module 'lightning_parallel.demo' has no attribute {name!r}")
    return getattr(importlib.import_module(active().module_of(_CLASSES[name])), name)


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


def _lookup(kind: str, table: dict[str, str], name: str) -> None:
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
    module = importlib.import_module((namespace or active()).module_of("demo.data"))
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
    module = importlib.import_module((namespace or active()).module_of("demo.models"))
    return module.MODELS[name](**kwargs)
