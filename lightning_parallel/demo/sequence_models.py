"""The demo's models of sequences: gpt (next token) and recommender (next item, two losses).

Each wraps a plain-torch network and replaces
:class:`~lightning_parallel.demo.classifier.DemoClassifier`'s one-label loss:

- :class:`GPT`: the decoder-only transformer of :mod:`lightning_parallel.demo.gpt` on token
  sequences (``input_shape = (context,)``, ``num_classes`` the vocabulary); the loss and the
  accuracy are the cross-entropy and the accuracy of the next token at every position of every
  sequence;
- :class:`Recommender`: the compound network of :mod:`lightning_parallel.demo.recommender`
  (an LSTM over the item history, an autoencoder of the user features); a batch is
  ``(history, features, next item)`` and the loss is ``cross_entropy(scores, next item) +
  reconstruction_weight · mse(reconstruction, features)``, the accuracy that of the next item.

Both default to AdamW at 3e-3.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torchmetrics.classification import MulticlassAccuracy

from lightning_parallel.demo.classifier import DemoClassifier
from lightning_parallel.demo.gpt import GPTNetwork
from lightning_parallel.demo.recommender import RecommenderNetwork

__all__: list[str] = []


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
