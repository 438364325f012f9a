"""A compound recommender: item-history LSTM, user-feature autoencoder, attention, two inputs.

The model family of the model-averaging dissertation's application (a recommender combining an
LSTM over the items a user saw, an autoencoder of the user's features and attention), written
the usual way: ``forward(history, features)`` takes two inputs and returns two outputs, the
next-item scores and the reconstructed features, and the loss has two parts (cross-entropy of
the next item plus ``reconstruction_weight`` times the reconstruction error).

1. the history (``batch x length`` item ids) is embedded and run through an LSTM;
2. the user features are encoded to a code and decoded back (the autoencoder);
3. the code, projected, queries an attention over the LSTM states (scaled dot product);
4. the attended history, the last LSTM state and the code together score every item.

Plain torch: the Lightning model ``Recommender`` in :mod:`lightning_parallel.demo.models` wraps
it; :class:`~lightning_parallel.demo.data.InteractionsDataModule` generates its data.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

__all__: list[str] = []


class RecommenderNetwork(nn.Module):
    """``(history, features) -> (item scores, reconstructed features)`` (see the module doc)."""

    def __init__(
        self, items: int, features: int, width: int = 64, code: int = 16, layers: int = 1
    ) -> None:
        super().__init__()
        for name, value in (("items", items), ("features", features), ("width", width)):
            if value < 1:
                raise ValueError(f"{name} must be at least 1, got {value}")
        self.embedding = nn.Embedding(items, width)
        self.lstm = nn.LSTM(width, width, num_layers=layers, batch_first=True)
        self.encoder = nn.Sequential(nn.Linear(features, width), nn.ReLU(), nn.Linear(width, code))
        self.decoder = nn.Sequential(nn.Linear(code, width), nn.ReLU(), nn.Linear(width, features))
        self.query = nn.Linear(code, width)
        self.scorer = nn.Sequential(
            nn.Linear(2 * width + code, width), nn.ReLU(), nn.Linear(width, items)
        )

    def forward(self, history: Tensor, features: Tensor) -> tuple[Tensor, Tensor]:
        states, _ = self.lstm(self.embedding(history))  # (batch, length, width)
        code = self.encoder(features)  # (batch, code)
        query = self.query(code).unsqueeze(1)  # (batch, 1, width)
        weights = torch.softmax(
            (query * states).sum(-1) / math.sqrt(states.shape[-1]), dim=-1
        )  # (batch, length)
        attended = (weights.unsqueeze(-1) * states).sum(1)  # (batch, width)
        scores = self.scorer(torch.cat([attended, states[:, -1], code], dim=-1))
        return scores, self.decoder(code)
