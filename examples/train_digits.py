"""Train the bundled convnet on the digits under any registered strategy and report its cost.

Run (from the repository root, after ``bash scripts/install.sh``)::

    .venv/bin/python examples/train_digits.py --strategy ddp --devices 2 --max-epochs 3

It prints the final validation accuracy and the bytes this rank sent per optimizer step.
"""

from __future__ import annotations

import argparse

from pytorch_lightning import Trainer, seed_everything

import lightning_parallel
from lightning_parallel.demo import build_datamodule, build_model
from lightning_parallel.pytorch_lightning import CommStats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--strategy", default="ddp", help="any Lightning or lightning_parallel name"
    )
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--max-epochs", type=int, default=3)
    parser.add_argument("--model", default="convnet", choices=["convnet", "vgg_mini", "mlp"])
    args = parser.parse_args()

    seed_everything(0)
    data = build_datamodule("digits", batch_size=32)
    model = build_model(args.model, data)
    stats = CommStats()
    trainer = Trainer(
        accelerator="cpu",
        devices=args.devices,
        strategy=args.strategy,
        max_epochs=args.max_epochs,
        callbacks=[stats],
        logger=False,
        enable_checkpointing=False,
    )
    trainer.fit(model, data)
    if trainer.is_global_zero:
        print(f"strategies available: {', '.join(sorted(lightning_parallel.registered_names()))}")
        print(
            f"val_acc={trainer.callback_metrics['val_acc']:.3f} "
            f"bytes/step={stats.totals.bytes_per_step:.0f} steps={stats.totals.steps}"
        )


if __name__ == "__main__":
    main()
