"""Bundled data: scikit-learn's handwritten digits (real, no download), generated images,
token sequences and interactions, and CIFAR-10 read from files a user already has.

Every data module exposes ``input_shape`` (channels, height, width; ``(length, features)``
for interactions) and ``num_classes`` so that
the demo models can be built to fit them (the CLI links them automatically).
"""

from __future__ import annotations

from pytorch_lightning import LightningDataModule

from lightning_parallel.demo.data.cifar10 import CIFAR10DataModule
from lightning_parallel.demo.data.corpus import CorpusDataModule
from lightning_parallel.demo.data.digits import DigitsDataModule
from lightning_parallel.demo.data.interactions import InteractionsDataModule
from lightning_parallel.demo.data.synthetic import SyntheticImageDataModule

__all__ = [
    "DATAMODULES",
    "CIFAR10DataModule",
    "CorpusDataModule",
    "DigitsDataModule",
    "InteractionsDataModule",
    "SyntheticImageDataModule",
]

DATAMODULES: dict[str, type[LightningDataModule]] = {
    "digits": DigitsDataModule,
    "synthetic": SyntheticImageDataModule,
    "corpus": CorpusDataModule,
    "interactions": InteractionsDataModule,
    "cifar10": CIFAR10DataModule,
}
