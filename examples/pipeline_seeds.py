"""Final validation accuracy of one pipeline fit: GroPipe or SpecTrain, on the demo mlp.

Repeat it over seeds to compare the prediction options (docs/spectrain.md quotes these runs):

    for seed in 0 1 2; do for spec in gropipe v2 none 2bw; do
        python examples/pipeline_seeds.py $spec $seed
    done; done

SPEC is ``gropipe`` (2 stages, 4 micro-batches) or a SpecTrain ``prediction`` (2 stages);
the seed sets the initialization and the data order. Two processes (fork) on the CPU, 5 epochs
of digits, batch 32, the mlp's default learning rate (``--lr`` to change it).
"""

from __future__ import annotations

import argparse

import pytorch_lightning as pl

from lightning_parallel.demo import build_datamodule, build_model
from lightning_parallel.strategies import GroPipeStrategy, SpecTrainStrategy


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("spec", help="gropipe, v2, v1, stash, 2bw or none")
    parser.add_argument("seed", type=int)
    parser.add_argument("--lr", type=float, default=None)
    parser.add_argument("--epochs", type=int, default=5)
    args = parser.parse_args()
    pl.seed_everything(args.seed, verbose=False)
    data = build_datamodule("digits", batch_size=32)
    model = build_model("mlp", data, **({"lr": args.lr} if args.lr is not None else {}))
    if args.spec == "gropipe":
        strategy: pl.strategies.Strategy = GroPipeStrategy(
            stages=2, micro_batches=4, start_method="fork"
        )
    else:
        strategy = SpecTrainStrategy(stages=2, prediction=args.spec, start_method="fork")
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        max_epochs=args.epochs,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, datamodule=data)
    print(f"{args.spec} seed={args.seed} val_acc={float(trainer.callback_metrics['val_acc']):.3f}")


if __name__ == "__main__":
    main()
