"""Bundled models and data shared by the CLI, the examples, the benchmark and the tests."""

from __future__ import annotations

from typing import Any

from pytorch_lightning import LightningDataModule

from lightning_parallel.demo.data import DigitsDataModule, SyntheticImageDataModule
from lightning_parallel.demo.models import MLP, ConvNet, DemoClassifier, VGGMini

__all__ = [
    "DATAMODULES",
    "MLP",
    "MODELS",
    "ConvNet",
    "DemoClassifier",
    "DigitsDataModule",
    "SyntheticImageDataModule",
    "VGGMini",
    "build_datamodule",
    "build_model",
]

MODELS: dict[str, type[DemoClassifier]] = {"vgg_mini": VGGMini, "convnet": ConvNet, "mlp": MLP}
DATAMODULES: dict[str, type[LightningDataModule]] = {
    "digits": DigitsDataModule,
    "synthetic": SyntheticImageDataModule,
}


def _lookup(kind: str, table: dict[str, Any], name: str) -> Any:
    if name not in table:
        raise ValueError(f"unknown {kind} {name!r}; choose one of {sorted(table)}")
    return table[name]


def build_datamodule(name: str, **kwargs: Any) -> LightningDataModule:
    """Build the bundled data module ``name`` (``"digits"`` or ``"synthetic"``)."""
    return _lookup("data", DATAMODULES, name)(**kwargs)  # type: ignore[no-any-return]


def build_model(
    name: str, data: LightningDataModule | None = None, **kwargs: Any
) -> DemoClassifier:
    """Build the bundled model ``name`` (``"vgg_mini"``, ``"convnet"``, ``"mlp"``).

    Given ``data``, the model's ``input_shape`` and ``num_classes`` are taken from it.
    """
    model_cls = _lookup("model", MODELS, name)
    if data is not None:
        kwargs.setdefault("input_shape", tuple(data.input_shape))  # type: ignore[attr-defined]
        kwargs.setdefault("num_classes", data.num_classes)  # type: ignore[attr-defined]
    return model_cls(**kwargs)  # type: ignore[no-any-return]
