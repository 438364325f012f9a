"""Final validation accuracy of one model-averaging fit, for comparing options over seeds.

docs/model_averaging.md ("Streaming rounds") quotes these runs, e.g.:

    for seed in 0 1 2 3 4; do
        python examples/averaging_seeds.py --seed $seed algorithm=diloco period=16 \\
            fragments=4 sync_delay=4 outer_dtype=int8
    done

Every ``key=value`` goes to ``ModelAveragingStrategy`` as the bench's SPEC options do (the
text converted to numbers, flags and ``None`` as a SPEC's is, here at the edge). Two processes
(fork) on the CPU, no shaped network (only the accuracy is meaningful; the bench measures
time), ``--model`` (default ``vgg_mini``) on digits, batch 32 per process, the demo's
optimizer, ``--epochs`` epochs (default 5): the same training as ``lightning-parallel bench
--model vgg_mini --data digits --epochs 5 --seed S``, so the accuracy equals the bench's for
the same seed. Prints ``seed=S val_acc=A``.
"""

from __future__ import annotations

import argparse

import pytorch_lightning as pl

from lightning_parallel.bench.specs import parse_spec
from lightning_parallel.demo import build_datamodule, build_model
from lightning_parallel.pytorch_lightning import ModelAveragingStrategy


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("options", nargs="*", help="key=value for ModelAveragingStrategy")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--model", default="vgg_mini")
    args = parser.parse_args()
    options = parse_spec("model_averaging:" + ",".join(args.options)).options
    pl.seed_everything(args.seed, workers=True, verbose=False)
    data = build_datamodule("digits", batch_size=32, seed=args.seed)
    model = build_model(args.model, data=data)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=ModelAveragingStrategy(start_method="fork", **options),
        max_epochs=args.epochs,
        num_sanity_val_steps=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, data)
    print(f"seed={args.seed} val_acc={float(trainer.callback_metrics['val_acc']):.4f}")


if __name__ == "__main__":
    main()
