"""Audit every strategy's checkpoints under a launcher: is each file whole, and is it the model?

For each registered strategy name, a plain ``import lightning as L`` module (an MLP with
BatchNorm, SGD with momentum) is trained on 2 processes for 2 epochs of 13 steps, with a
``ModelCheckpoint`` at the end of each epoch (in the middle of an averaging round of 8 steps),
then saved with ``trainer.save_checkpoint``; a third run stops with an exception raised on
every rank before step 20, under ``OnExceptionCheckpoint``. The process that holds the result
checks that each file loads strictly into the plain module, and that the file written after
``fit`` holds the model that process has (``trainer.lightning_module``). Every rank also
writes its own model at the end of ``fit``, to tell whether the ranks agree (DDP keeps the
parameters equal, and each rank's BatchNorm buffers from its last forward; the
model-averaging strategies average both at the end of ``fit``; a pipeline's ranks hold
different stages: n/a). A checkpoint on exception that a strategy refuses shows its error.

One strategy under one launcher::

    .venv/bin/python examples/checkpoint_audit.py --strategy diloco --launcher ddp

The whole table (every strategy, ``ddp`` and ``spawn``)::

    .venv/bin/python examples/checkpoint_audit.py --table
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import ModelCheckpoint, OnExceptionCheckpoint
from lightning.pytorch.strategies import StrategyRegistry
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_parallel  # noqa: F401  (registers the strategy names)

STRATEGIES = (
    "ddp", "hylo", "ddp_fp16", "ddp_powersgd", "topk_ddp", "model_averaging", "bmuf", "easgd",
    "diloco", "parameter_server", "gropipe", "spectrain",
)  # fmt: skip
LAUNCHERS = ("ddp", "spawn")
SAMPLES, BATCH, EPOCHS, RAISE_AT = 208, 8, 2, 20


class Net(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.Sequential(
            nn.Linear(6, 12), nn.Tanh(), nn.BatchNorm1d(12), nn.Linear(12, 3)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


class RaiseBeforeStep(L.Callback):
    """Every rank raises before step ``RAISE_AT`` (between steps)."""

    def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.global_step == RAISE_AT:
            raise RuntimeError(f"stopped before step {RAISE_AT + 1}")


class SaveEachRank(L.Callback):
    """Each rank writes the model it holds at the very end of ``fit``."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        state = {k: v.clone() for k, v in pl_module.state_dict().items() if not v.is_meta}
        torch.save(state, self.folder / f"rank{trainer.global_rank}.pt")


def loader() -> DataLoader:
    generator = torch.Generator().manual_seed(3)
    data = TensorDataset(
        torch.randn(SAMPLES, 6, generator=generator),
        torch.randint(0, 3, (SAMPLES,), generator=generator),
    )
    return DataLoader(data, batch_size=BATCH)


def strategy_for(name: str, launcher: str) -> Any:
    if launcher == "ddp":
        return name
    entry = StrategyRegistry[name]
    return entry["strategy"](**{**entry["init_params"], "start_method": launcher})


def trainer_for(name: str, launcher: str, callbacks: list[L.Callback]) -> L.Trainer:
    return L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy_for(name, launcher),
        max_epochs=EPOCHS,
        callbacks=callbacks,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )


def strict(path: Path) -> str:
    if not path.exists():
        return "no file"
    state = torch.load(path, map_location="cpu", weights_only=False)["state_dict"]
    try:
        Net().load_state_dict(state, strict=True)
    except RuntimeError as error:
        missing = str(error).count('"') // 2
        return f"NOT strict ({len(state)} tensors; {missing} names wrong)"
    return "strict"


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.allclose(a[k].float(), b[k].float()) for k in a)


def run_cell(name: str, launcher: str, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    epochs = ModelCheckpoint(dirpath=out, filename="{epoch}", save_top_k=-1)
    trainer = trainer_for(name, launcher, [epochs, SaveEachRank(out)])
    model = Net()
    trainer.fit(model, loader())
    trainer.save_checkpoint(out / "final.ckpt")
    # a second run that raises on every rank between two steps
    on_exception = OnExceptionCheckpoint(dirpath=out, filename="on_exception")
    failing = trainer_for(name, launcher, [on_exception, RaiseBeforeStep()])
    refused = None
    try:
        failing.fit(Net(), loader())
    except Exception as error:  # spawn wraps the child's exception in its own
        if "stopped before step" not in str(error):
            refused = f"{type(error).__name__}: {str(error).splitlines()[0][:120]}"
    if not trainer.is_global_zero:
        return
    held = model.state_dict()
    final = torch.load(out / "final.ckpt", weights_only=False)["state_dict"]
    replicas = [out / f"rank{rank}.pt" for rank in range(2)]
    agree: dict[str, bool | None] = {"parameters": None, "buffers": None}
    if all(path.exists() for path in replicas):
        first, second = (torch.load(path) for path in replicas)
        if first.keys() == second.keys():  # (a pipeline's ranks hold different stages)
            names = {name for name, _ in Net().named_parameters()}
            for kind, keep in (("parameters", True), ("buffers", False)):
                agree[kind] = same(
                    *({k: v for k, v in r.items() if (k in names) == keep} for r in (first, second))
                )
    result = {
        "strategy": name,
        "launcher": launcher,
        "ModelCheckpoint, epoch 0": strict(out / "epoch=0.ckpt"),
        "save_checkpoint after fit": strict(out / "final.ckpt"),
        "after fit = trainer.lightning_module": same(final, held),
        "ranks' parameters agree after fit": agree["parameters"],
        "ranks' buffers agree after fit": agree["buffers"],
        "OnExceptionCheckpoint": refused or strict(out / "on_exception.ckpt"),
    }
    print("AUDIT " + json.dumps(result))


def cell_command(name: str, launcher: str, out: Path) -> list[str]:
    script = str(Path(__file__).resolve())
    return [sys.executable, script, "--strategy", name, "--launcher", launcher, "--out", str(out)]


def run_table(strategies: list[str], launchers: list[str]) -> int:
    columns = (
        "ModelCheckpoint, epoch 0",
        "save_checkpoint after fit",
        "after fit = trainer.lightning_module",
        "ranks' parameters agree after fit",
        "ranks' buffers agree after fit",
        "OnExceptionCheckpoint",
    )
    print("| strategy | launcher | " + " | ".join(columns) + " |")
    print("| --- | --- |" + " --- |" * len(columns))
    failed = 0
    for launcher in launchers:
        for name in strategies:
            with tempfile.TemporaryDirectory() as folder:
                done = subprocess.run(
                    cell_command(name, launcher, Path(folder)),
                    capture_output=True,
                    text=True,
                    timeout=900,
                    env={**os.environ, "PYTHONWARNINGS": "ignore"},
                )
            lines = [x for x in done.stdout.splitlines() if x.startswith("AUDIT ")]
            if done.returncode != 0 or not lines:
                failed += 1
                tail = done.stderr.strip().splitlines()[-1:] or ["(no output)"]
                print(f"| {name} | {launcher} | FAILED: {tail[0][:200]} |" + " |" * 5)
                continue
            result = json.loads(lines[-1][len("AUDIT ") :])
            cells = ["n/a" if result[c] is None else str(result[c]) for c in columns]
            failed += any(c.startswith(("NOT", "no file", "False")) for c in cells[:3] + cells[5:])
            print(f"| {name} | {launcher} | " + " | ".join(cells) + " |", flush=True)
    return 1 if failed else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--strategy", choices=STRATEGIES, default="model_averaging")
    parser.add_argument("--launcher", choices=LAUNCHERS, default="ddp")
    parser.add_argument("--out", type=Path, default=Path("checkpoint_audit"))
    parser.add_argument("--table", action="store_true")
    parser.add_argument("--strategies", nargs="+", default=list(STRATEGIES))
    parser.add_argument("--launchers", nargs="+", default=list(LAUNCHERS))
    args = parser.parse_args()
    if args.table:
        return run_table(args.strategies, args.launchers)
    run_cell(args.strategy, args.launcher, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
