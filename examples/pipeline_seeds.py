"""Final validation accuracy of one pipeline fit: GroPipe or SpecTrain, on the demo mlp.

Repeat it over seeds to compare the prediction options (docs/spectrain.md quotes these runs):

    for seed in 0 1 2; do for spec in gropipe v2 none 2bw; do
        python examples/pipeline_seeds.py $spec $seed
    done; done

SPEC is ``gropipe`` (2 stages, 4 micro-batches) or a SpecTrain ``prediction`` (2 stages);
the seed sets the initialization and the data order. Two processes (fork) on the CPU, 5 epochs
of digits, batch 32, the mlp's default learning rate (``--lr`` to change it), momentum and
schedule (``--momentum``, ``--lr-schedule``); SpecTrain's options pass through ``--option
key=value`` (e.g. ``--option direction=smoothed_gradient``). ``--verbose`` prints the validation
accuracy and SpecTrain's stage-0 gauges after every epoch.
"""

from __future__ import annotations

import argparse
from typing import Any

import pytorch_lightning as pl

from lightning_parallel.comm.ledger import process_ledger
from lightning_parallel.demo import build_datamodule, build_model
from lightning_parallel.strategies import GroPipeStrategy, SpecTrainStrategy


def _value(text: str) -> Any:
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return {"none": None, "true": True, "false": False}.get(text.lower(), text)


class _EpochReport(pl.Callback):
    """Print the validation accuracy and stage 0's prediction gauges after every epoch."""

    def on_validation_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.sanity_checking or trainer.global_rank != 0:
            return
        gauges = process_ledger().gauges
        names = ("prediction_error_stage0", "stale_error_stage0", "staleness_stage0")
        shown = " ".join(f"{n}={gauges[n]:.2e}" for n in names if n in gauges)
        acc = float(trainer.callback_metrics.get("val_acc", float("nan")))
        boundaries = getattr(trainer.strategy, "_boundaries", None)
        print(
            f"  epoch {trainer.current_epoch} val_acc={acc:.3f} {shown} boundaries={boundaries}",
            flush=True,
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("spec", help="gropipe, v2, v1, stash, 2bw or none")
    parser.add_argument("seed", type=int)
    parser.add_argument("--lr", type=float, default=None)
    parser.add_argument("--momentum", type=float, default=None)
    parser.add_argument("--lr-schedule", default=None, help="constant or cosine")
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--option", action="append", default=[], help="SpecTrain key=value")
    parser.add_argument("--verbose", action="store_true")
    args = parser.parse_args()
    pl.seed_everything(args.seed, verbose=False)
    data = build_datamodule("digits", batch_size=32)
    overrides = {
        key: value
        for key, value in (
            ("lr", args.lr),
            ("momentum", args.momentum),
            ("lr_schedule", args.lr_schedule),
        )
        if value is not None
    }
    model = build_model("mlp", data, **overrides)
    if args.spec == "gropipe":
        strategy: pl.strategies.Strategy = GroPipeStrategy(
            stages=2, micro_batches=4, start_method="fork"
        )
    else:
        options = dict(item.split("=", 1) for item in args.option)
        strategy = SpecTrainStrategy(
            stages=2,
            prediction=args.spec,
            start_method="fork",
            **{key: _value(value) for key, value in options.items()},
        )
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        max_epochs=args.epochs,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[_EpochReport()] if args.verbose else None,
    )
    trainer.fit(model, datamodule=data)
    described = " ".join([args.spec, *args.option, *(f"{k}={v}" for k, v in overrides.items())])
    print(f"{described} seed={args.seed} val_acc={float(trainer.callback_metrics['val_acc']):.3f}")


if __name__ == "__main__":
    main()
