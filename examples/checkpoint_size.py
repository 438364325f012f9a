"""Model-averaging checkpoint size and exact resume at W processes on one or several hosts.

Trains the demo ``vgg_mini`` (12.9M parameters) on synthetic images, three times on the same
processes:

1. ``--steps`` steps straight (the reference);
2. ``--save-at`` steps (the end of the first epoch of 5 steps: mid-round for ``period=4``;
   Lightning restarts an interrupted epoch from its first batch, so an exact resume needs an
   epoch boundary), saving a checkpoint there;
3. a new ``Trainer`` resumed from that checkpoint to ``--steps``;

then prints the size of the checkpoint file and of the per-rank replica files, and whether every
rank's parameters after 3 equal those after 1, bit for bit. Every rank must see ``DIR``; the
processes are started by a launcher (the simulated cluster here, torchrun or SLURM elsewhere)::

    lightning-parallel cluster --hosts 2 -- python examples/checkpoint_size.py DIR2
    lightning-parallel cluster --hosts 4 --procs-per-host 2 -- \\
        python examples/checkpoint_size.py DIR8
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import ModelCheckpoint

from lightning_parallel.demo import build_datamodule, build_model
from lightning_parallel.pytorch_lightning import ModelAveragingStrategy


def _strategy() -> ModelAveragingStrategy:
    return ModelAveragingStrategy(period=4)


def _fit(args: argparse.Namespace, steps: int, **options: Any) -> pl.Trainer:
    devices, world = args.devices, args.world
    nodes = world // devices
    pl.seed_everything(0, verbose=False)
    data = build_datamodule("synthetic", batch_size=8, num_samples=8 * world * 5, image_size=32)
    model = build_model("vgg_mini", data)
    ckpt_path = options.pop("ckpt_path", None)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=devices,
        num_nodes=nodes,
        strategy=_strategy(),
        max_steps=steps,
        limit_val_batches=0,
        logger=False,
        enable_checkpointing="callbacks" in options,
        enable_progress_bar=False,
        enable_model_summary=False,
        **options,
    )
    trainer.fit(model, datamodule=data, ckpt_path=ckpt_path)
    kind = "resumed" if ckpt_path else "reference"
    torch.save(
        {k: v.detach().clone() for k, v in model.state_dict().items()},
        args.directory / f"params-{trainer.global_rank}-{steps}-{kind}.pt",
    )
    return trainer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("directory", type=Path)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--save-at", type=int, default=5)
    args = parser.parse_args()
    # read once: Lightning's teardown removes WORLD_SIZE from the environment
    args.devices = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    args.world = int(os.environ.get("WORLD_SIZE", "1"))
    torch.set_num_threads(1)
    args.directory.mkdir(parents=True, exist_ok=True)
    _fit(args, args.steps)
    checkpoint = ModelCheckpoint(
        dirpath=args.directory, filename="mid", save_top_k=-1, every_n_train_steps=args.save_at
    )
    _fit(args, args.save_at, callbacks=[checkpoint])
    resumed = _fit(args, args.steps, ckpt_path=str(args.directory / "mid.ckpt"))
    rank = resumed.global_rank
    ref = torch.load(args.directory / f"params-{rank}-{args.steps}-reference.pt")
    got = torch.load(args.directory / f"params-{rank}-{args.steps}-resumed.pt")
    exact = all(torch.equal(ref[k], got[k]) for k in ref)
    print(f"rank {rank}: resumed parameters equal the straight run's: {exact}", flush=True)
    if rank == 0:
        main_bytes = (args.directory / "mid.ckpt").stat().st_size
        replicas = sorted(args.directory.rglob("rank*.pt"))
        print(
            f"{resumed.world_size} processes: checkpoint "
            f"{main_bytes / 1e6:.1f} MB, replica files "
            f"{sum(p.stat().st_size for p in replicas) / 1e6:.1f} MB in {len(replicas)} files"
        )


if __name__ == "__main__":
    main()
