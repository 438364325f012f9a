"""Every registered strategy on every bundled model: it fits, or it refuses with the reason.

For each strategy name of ``lightning-parallel strategies`` (and Lightning's ``ddp``) and each
bundled model on its data set (``synthetic`` images, ``corpus`` tokens, ``interactions``), one
short fit on 2 processes (fork launcher, CPU, gloo): ``--steps`` training steps and one
validation batch, small model sizes. Prints a table of ``ok`` or the first line of the error,
and exits 1 if any pair neither fits nor refuses cleanly (a clean refusal is a ``ValueError``
or ``TypeError`` raised before training)::

    python examples/model_matrix.py
    python examples/model_matrix.py --strategy gropipe --model gpt
"""

from __future__ import annotations

import argparse
import multiprocessing
import sys
from typing import Any

import pytorch_lightning as pl
import torch

import lightning_parallel  # noqa: F401  (registers the strategy names)
from lightning_parallel.demo import build_datamodule, build_model

# model -> (data set, small size options)
MODELS: dict[str, tuple[str, dict[str, Any]]] = {
    "mlp": ("synthetic", {"width": 64, "depth": 4}),
    "vgg_mini": ("synthetic", {"width": 8, "fc_width": 256}),
    "vgg16": ("synthetic", {"width": 8}),
    "resnet18": ("synthetic", {"width": 8}),
    "resnet50": ("synthetic", {"width": 4}),
    "gpt": ("corpus", {}),
    "recommender": ("interactions", {}),
}


def _strategy(name: str) -> Any:
    from pytorch_lightning.strategies import DDPStrategy, StrategyRegistry

    if name == "ddp":
        return DDPStrategy(start_method="fork")
    entry = StrategyRegistry[name]
    return entry["strategy"](**{**entry["init_params"], "start_method": "fork"})


def _fit(name: str, model_name: str, steps: int, queue: Any) -> None:
    try:
        torch.set_num_threads(1)
        data_name, options = MODELS[model_name]
        data = build_datamodule(data_name, batch_size=16, num_samples=256)
        model = build_model(model_name, data, **options)
        trainer = pl.Trainer(
            accelerator="cpu",
            devices=2,
            strategy=_strategy(name),
            max_steps=steps,
            limit_val_batches=1,
            num_sanity_val_steps=0,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
        )
        trainer.fit(model, datamodule=data)
        loss = float(trainer.callback_metrics.get("train_loss", float("nan")))
        queue.put(("ok", f"ok (train_loss {loss:.3f})"))
    except (ValueError, TypeError) as error:
        queue.put(("refused", f"refused: {type(error).__name__}: {str(error).splitlines()[0]}"))
    except BaseException as error:
        queue.put(("failed", f"FAILED: {type(error).__name__}: {str(error).splitlines()[0][:160]}"))


def main() -> int:
    from pytorch_lightning.strategies import StrategyRegistry

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--strategy", action="append", default=None)
    parser.add_argument("--model", action="append", default=None, choices=sorted(MODELS))
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    ours = sorted(
        name
        for name in StrategyRegistry.available_strategies()
        if StrategyRegistry[name]["strategy"].__module__.startswith("lightning_parallel")
    )
    strategies = args.strategy or ["ddp", *ours]
    context = multiprocessing.get_context("spawn")  # each fit in a fresh process
    outcomes = []
    for model_name in args.model or list(MODELS):
        for name in strategies:
            queue = context.Queue()
            process = context.Process(target=_fit, args=(name, model_name, args.steps, queue))
            process.start()
            process.join(timeout=600)
            if process.is_alive():
                process.kill()
                outcome = ("failed", "FAILED: did not finish in 600 s")
            else:
                outcome = queue.get() if not queue.empty() else ("failed", "FAILED: no result")
            outcomes.append((model_name, name, *outcome))
            print(f"{model_name:12s} {name:18s} {outcome[1]}", flush=True)
    print("\n| model | strategy | outcome |\n| --- | --- | --- |")
    for model_name, name, _, text in outcomes:
        print(f"| `{model_name}` | `{name}` | {text} |")
    return 1 if any(kind == "failed" for _, _, kind, _ in outcomes) else 0


if __name__ == "__main__":
    sys.exit(main())
