"""Generated token sequences from a fixed Markov chain, for next-token prediction."""

from __future__ import annotations

import torch

from lightning_parallel.demo.data.tensors import TensorDataModule

__all__: list[str] = []


class CorpusDataModule(TensorDataModule):
    """Generated token sequences with learnable structure, for next-token prediction.

    A fixed random Markov chain over ``vocab`` tokens: each token has ``successors`` likely next
    tokens (drawn once from ``seed``) with probabilities ``p, p·r, p·r², ...`` (``r = 0.5``,
    normalized), so the best possible next-token accuracy is the first probability (0.53 with
    the default 4 successors), against ``1/vocab`` for guessing. A sample is a window of
    ``context + 1`` tokens of one long walk (consecutive windows share one token): ``x`` the
    first ``context``, ``y`` the same shifted by one (the usual language-model pairs).
    ``input_shape`` is ``(context,)`` and ``num_classes`` the vocabulary.

    Args:
        vocab: tokens.
        context: tokens per sample.
        successors: likely next tokens per token (fewer => easier).
        num_samples: training samples (validation gets a fifth, at least one batch).
        batch_size: samples per training step on each process.
        seed: seed of the chain and the walk.
        num_workers: data-loader worker processes.
    """

    def __init__(
        self,
        vocab: int = 256,
        context: int = 64,
        successors: int = 4,
        num_samples: int = 4096,
        batch_size: int = 32,
        seed: int = 0,
        num_workers: int = 0,
    ) -> None:
        super().__init__(batch_size, num_workers)
        for name, value in (("vocab", vocab), ("context", context), ("num_samples", num_samples)):
            if value < 2:
                raise ValueError(f"{name} must be at least 2, got {value}")
        if not 1 <= successors <= vocab:
            raise ValueError(f"successors must be in [1, vocab={vocab}], got {successors}")
        self.vocab, self.context, self.successors = vocab, context, successors
        self.num_samples, self.seed = num_samples, seed
        self.input_shape = (context,)
        self.num_classes = vocab

    def _walk(self, length: int, table: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        weights = 0.5 ** torch.arange(self.successors, dtype=torch.float64)
        choices = torch.multinomial(
            weights / weights.sum(), length, replacement=True, generator=generator
        ).tolist()
        successors = table.tolist()
        tokens, token = [], 0
        for choice in choices:
            token = successors[token][choice]
            tokens.append(token)
        return torch.tensor(tokens, dtype=torch.int64)

    def _pairs(
        self, count: int, table: torch.Tensor, generator: torch.Generator
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # windows of one walk that overlap by one token only: no sample repeats another
        walk = self._walk(count * self.context + 1, table, generator)
        windows = walk.unfold(0, self.context + 1, self.context)[:count]
        return windows[:, :-1].contiguous(), windows[:, 1:].contiguous()

    def _tensors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        generator = torch.Generator().manual_seed(self.seed)
        # the chain: each token's likely successors, the same for training and validation
        table = torch.stack(
            [
                torch.randperm(self.vocab, generator=generator)[: self.successors]
                for _ in range(self.vocab)
            ]
        )
        train_x, train_y = self._pairs(self.num_samples, table, generator)
        val_x, val_y = self._pairs(max(self.num_samples // 5, self.batch_size), table, generator)
        return train_x, train_y, val_x, val_y
