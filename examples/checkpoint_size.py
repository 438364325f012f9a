"""Model-averaging checkpoint size at W processes: the checkpoint file and the replica files.

Fits the demo ``vgg_mini`` (12.9M parameters) on synthetic images for one epoch under
``ModelAveragingStrategy(period=4)`` with W processes on this host, saves a checkpoint mid-round
and prints its size and that of the per-rank replica files::

    python examples/checkpoint_size.py 2 /tmp/checkpoints-2
    python examples/checkpoint_size.py 8 /tmp/checkpoints-8
"""

from __future__ import annotations

import argparse
from pathlib import Path

import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import ModelCheckpoint

import lightning_parallel
from lightning_parallel.demo import build_datamodule, build_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("processes", type=int)
    parser.add_argument("directory", type=Path)
    parser.add_argument("--model", default="vgg_mini")
    args = parser.parse_args()
    torch.set_num_threads(1)
    pl.seed_everything(0, verbose=False)
    data = build_datamodule(
        "synthetic", batch_size=8, num_samples=8 * args.processes * 6, image_size=32
    )
    model = build_model(args.model, data)
    checkpoint = ModelCheckpoint(dirpath=args.directory, save_top_k=-1, filename="mid")
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=args.processes,
        strategy=lightning_parallel.ModelAveragingStrategy(period=4, start_method="fork"),
        max_epochs=1,
        limit_val_batches=0,
        callbacks=[checkpoint],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, datamodule=data)
    main_bytes = (args.directory / "mid.ckpt").stat().st_size
    replicas = sorted(args.directory.rglob("rank*.pt"))
    print(
        f"{args.processes} processes: checkpoint {main_bytes / 1e6:.1f} MB, replica files "
        f"{sum(p.stat().st_size for p in replicas) / 1e6:.1f} MB in {len(replicas)} files"
    )


if __name__ == "__main__":
    main()
