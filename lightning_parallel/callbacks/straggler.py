"""Make one rank a straggler: its training batches take FACTOR times longer, deterministically.

Benchmarks use it to see how a strategy copes with a slow worker (synchronous DDP waits for
it every step; asynchronous or averaging strategies less so). On the chosen global rank:

1. at ``on_train_batch_start`` the callback notes the time t₀;
2. at ``on_train_batch_end`` it measures the batch's compute time d = t − t₀ and sleeps
   (FACTOR − 1)·d, so the batch took FACTOR·d in all.

Every other rank is untouched. ``lightning-parallel bench/cluster --straggler RANK:FACTOR``
exports ``LP_STRAGGLER=RANK:FACTOR``; :meth:`Straggler.from_env` builds the callback from it.

Example::

    trainer = Trainer(strategy="ddp", callbacks=[Straggler(rank=1, factor=3.0)])
"""

from __future__ import annotations

import os
import time
from typing import Any

import pytorch_lightning as pl
from pytorch_lightning.callbacks import Callback

from lightning_parallel.cluster.launcher import STRAGGLER_ENV
from lightning_parallel.cluster.units import parse_straggler

__all__: list[str] = []


class Straggler(Callback):
    """Slow down global rank ``rank`` by ``factor`` (its batch time is multiplied by it).

    Args:
        rank: the global rank that straggles.
        factor: how many times longer its batches take (>= 1; 1 changes nothing).

    Attributes:
        delayed_seconds: total time this process slept (0 on every other rank).
    """

    def __init__(self, rank: int, factor: float) -> None:
        if rank < 0:
            raise ValueError(f"rank must be a global rank >= 0, got {rank}")
        if factor < 1.0:
            raise ValueError(f"factor must be >= 1 (1 means no slowdown), got {factor}")
        self.rank = rank
        self.factor = factor
        self.delayed_seconds = 0.0
        self._start = 0.0

    @classmethod
    def from_env(cls, variable: str = STRAGGLER_ENV) -> Straggler | None:
        """The straggler ``RANK:FACTOR`` named by the environment variable, or ``None``."""
        text = os.environ.get(variable, "").strip()
        if not text:
            return None
        return cls(*parse_straggler(text))

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self.rank >= trainer.world_size:
            raise ValueError(
                f"straggler rank {self.rank} does not exist: the world size is "
                f"{trainer.world_size}; choose a rank below it"
            )

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._start = time.perf_counter()

    def on_train_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        if trainer.global_rank != self.rank or self.factor == 1.0:
            return
        delay = (self.factor - 1.0) * (time.perf_counter() - self._start)
        time.sleep(delay)
        self.delayed_seconds += delay
