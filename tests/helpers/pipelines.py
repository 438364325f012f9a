"""A pipeline strategy's second run in the same rank processes, for the CPU and GPU tests."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import pytorch_lightning as pl

from helpers.models import ConvBatchNormNet, TracedConvBatchNormNet, image_loader
from helpers.trainers import QUIET


def fit_then_validate(
    rank: int,
    world: int,
    name: str,
    accelerator: str,
    traced: bool = False,
    net: type[ConvBatchNormNet] | None = None,
    between: Callable[[pl.LightningModule], None] | None = None,
) -> list[dict[str, float]]:
    """``fit`` then ``validate`` with the same Trainer, one process per "host" (as the bench
    runs them): ``name`` is ``gropipe`` or ``spectrain``, two stages; gloo (two ranks may share
    one GPU); ``traced``: a model the pipeline must trace (``net``: another such class);
    ``between(model)`` runs after ``fit``. Returns what ``validate`` returned on this rank."""
    from lightning_parallel.strategies.gropipe import GroPipeStrategy
    from lightning_parallel.strategies.spectrain import SpecTrainStrategy

    os.environ.update(LOCAL_RANK="0", NODE_RANK=str(rank))
    common: dict[str, Any] = {"stages": 2, "process_group_backend": "gloo"}
    strategy = (
        GroPipeStrategy(micro_batches=2, **common)
        if name == "gropipe"
        else SpecTrainStrategy(**common)
    )
    trainer = pl.Trainer(
        accelerator=accelerator,
        devices=1,
        num_nodes=world,
        strategy=strategy,
        max_steps=4,
        num_sanity_val_steps=0,
        **QUIET,
    )
    net = net or (TracedConvBatchNormNet if traced else ConvBatchNormNet)
    model = net(channels=8, hidden=64, device_type=accelerator, metric=True)
    trainer.fit(model, image_loader(128, 16))
    if between is not None:
        between(model)
    return trainer.validate(model, image_loader(64, 16), verbose=False)
