"""The base of the bundled demo models: cross-entropy classification with accuracy metrics.

:class:`DemoClassifier` builds its network once, in ``self.layers`` (:meth:`build_layers`, which
every model overrides), and ``forward(x) == self.layers(x)``. A step is:

- training: ``loss = cross_entropy(layers(x), y)``, logged as ``train_loss``;
- validation and test: the same loss and the micro-averaged accuracy of ``argmax`` over the
  classes (``torchmetrics``' ``MulticlassAccuracy``), logged as ``val_loss``/``val_acc`` and
  ``test_loss``/``test_acc`` (the loss averaged over the ranks, ``sync_dist``);
- prediction: the ``argmax`` class.

The optimizer is SGD with momentum or AdamW, both with ``weight_decay``; with
``lr_schedule="cosine"`` the rate follows ``lr·(1 + cos(π·min(t, T)/T))/2`` over the fit's
``T = trainer.estimated_stepping_batches`` optimizer steps, stepped after every batch.

The models of each family subclass it: :mod:`lightning_parallel.demo.image_models` and
:mod:`lightning_parallel.demo.sequence_models`; :mod:`lightning_parallel.demo.models` registers
them by short name.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from pytorch_lightning import LightningModule
from torch import nn
from torchmetrics.classification import MulticlassAccuracy

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
