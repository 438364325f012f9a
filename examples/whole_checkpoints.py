"""Check that a pipeline's checkpoints are whole under every launcher, as a user writes them.

A plain ``import lightning as L`` module (an MLP, SGD with momentum) is trained
for 8 steps under GroPipe or SpecTrain on 2 processes (2 stages), with a ``ModelCheckpoint``
every 4 steps, then saved with ``trainer.save_checkpoint``. The process that holds the result
(rank 0, or the parent of ``spawn``/``fork``) then checks each file: it must load strictly into
the plain module, through ``load_from_checkpoint`` too, and hold the weights the run trained
(GroPipe: those of the same 8 steps on one device, to 1e-5; SpecTrain, whose asynchronous
updates differ from one device's: the weights ``trainer.lightning_module`` holds after ``fit``).

Run one cell (``--launcher ddp`` is Lightning's default launcher for a script; ``torchrun``
re-runs this script under ``python -m torch.distributed.run``)::

    .venv/bin/python examples/whole_checkpoints.py --strategy gropipe --launcher ddp

or the whole table (GroPipe and SpecTrain under ddp, spawn, fork and torchrun)::

    .venv/bin/python examples/whole_checkpoints.py --table
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
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from lightning_parallel import GroPipeStrategy, SpecTrainStrategy

SAMPLES, BATCH, EPOCHS = 64, 16, 2
STRATEGIES = {"gropipe": GroPipeStrategy, "spectrain": SpecTrainStrategy}
LAUNCHERS = ("ddp", "spawn", "fork", "torchrun")


class Net(L.LightningModule):
    """What a user writes: nothing here knows of pipelines. (No BatchNorm: a pipeline
    normalizes each micro-batch with its own statistics, so one device's weights would differ
    for a reason that is not the checkpoint's.)"""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.Sequential(
            nn.Linear(6, 12),
            nn.Tanh(),
            nn.Linear(12, 12),
            nn.Tanh(),
            nn.Linear(12, 3),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = loss_of(self, batch)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


def loss_of(model: nn.Module, batch: Any) -> torch.Tensor:
    x, y = batch
    return F.cross_entropy(model(x), y)


def dataset() -> TensorDataset:
    generator = torch.Generator().manual_seed(3)
    return TensorDataset(
        torch.randn(SAMPLES, 6, generator=generator),
        torch.randint(0, 3, (SAMPLES,), generator=generator),
    )


def one_device(steps: int) -> dict[str, torch.Tensor]:
    """The same training on one device, in plain torch: the order Lightning's injected sampler
    gives one data-parallel replica (shuffled, seed 0, a new order each epoch)."""
    model = Net()
    optimizer = model.configure_optimizers()
    data = dataset()
    sampler = DistributedSampler(data, num_replicas=1, rank=0, shuffle=True, seed=0)
    done = 0
    for epoch in range(EPOCHS):
        sampler.set_epoch(epoch)
        for batch in DataLoader(data, batch_size=BATCH, sampler=sampler):
            if done == steps:
                return model.state_dict()
            optimizer.zero_grad()
            loss_of(model, batch).backward()
            optimizer.step()
            done += 1
    return model.state_dict()


def largest_difference(state: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> float:
    return max((state[k].double() - reference[k].double()).abs().max().item() for k in reference)


def check_file(path: Path, expected: dict[str, torch.Tensor], tolerance: float) -> dict[str, Any]:
    """Load ``path`` strictly into the plain module and through ``load_from_checkpoint``."""
    state = torch.load(path, map_location="cpu", weights_only=False)["state_dict"]
    result: dict[str, Any] = {"tensors": f"{len(state)}/{len(Net().state_dict())}"}
    try:
        Net().load_state_dict(state, strict=True)
        Net.load_from_checkpoint(path, map_location="cpu")
    except RuntimeError as error:
        return {**result, "ok": False, "error": str(error).splitlines()[-1][:200]}
    difference = largest_difference(state, expected)
    return {**result, "ok": difference <= tolerance, "max_difference": difference}


def run_cell(strategy_name: str, launcher: str, out: Path) -> None:
    """Train, save, and (in the process that holds the result) check and print one JSON line."""
    out.mkdir(parents=True, exist_ok=True)
    if launcher in ("ddp", "torchrun"):
        strategy: Any = strategy_name  # the registered name, Lightning's default launcher
    else:
        strategy = STRATEGIES[strategy_name](stages=2, start_method=launcher)
    every = ModelCheckpoint(dirpath=out, filename="{step}", every_n_train_steps=4, save_top_k=-1)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        max_epochs=EPOCHS,
        callbacks=[every],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    model = Net()
    trainer.fit(model, DataLoader(dataset(), batch_size=BATCH))
    trainer.save_checkpoint(out / "final.ckpt")
    if not trainer.is_global_zero:
        return
    held = trainer.lightning_module.state_dict()
    meta = [name for name, tensor in held.items() if tensor.is_meta]
    exact = strategy_name == "gropipe"
    trained = one_device(4 * EPOCHS) if exact else held
    files = {
        "save_checkpoint after fit": (out / "final.ckpt", trained),
        "ModelCheckpoint at step 4": (out / "step=4.ckpt", one_device(4) if exact else None),
        "ModelCheckpoint at step 8": (out / "step=8.ckpt", trained),
    }
    checks = {}
    for what, (path, expected) in files.items():
        if expected is None:  # SpecTrain mid-run: loads strictly, weights not compared
            expected = torch.load(path, weights_only=False)["state_dict"]
        checks[what] = check_file(path, expected, 1e-5 if exact else 0.0)
    if exact:
        checks["trainer.lightning_module after fit"] = {
            "ok": not meta and largest_difference(held, trained) <= 1e-5,
            "tensors": f"{len(held) - len(meta)}/{len(held)}",
        }
    else:
        checks["trainer.lightning_module after fit"] = {
            "ok": not meta,
            "tensors": f"{len(held) - len(meta)}/{len(held)}",
        }
    print("RESULT " + json.dumps({"strategy": strategy_name, "launcher": launcher, **checks}))


def cell_command(strategy: str, launcher: str, out: Path) -> list[str]:
    """The command that runs one cell as a user would start it."""
    script = [str(Path(__file__).resolve()), "--strategy", strategy, "--launcher", launcher]
    script += ["--out", str(out)]
    if launcher == "torchrun":
        return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", *script]
    return [sys.executable, *script]


def run_table() -> int:
    """Every cell in a fresh process; a markdown table of what each file held."""
    rows, failed = [], 0
    for strategy in STRATEGIES:
        for launcher in LAUNCHERS:
            with tempfile.TemporaryDirectory() as folder:
                done = subprocess.run(
                    cell_command(strategy, launcher, Path(folder)),
                    capture_output=True,
                    text=True,
                    timeout=600,
                    env={**os.environ, "PYTHONWARNINGS": "ignore"},
                )
            lines = [x for x in done.stdout.splitlines() if x.startswith("RESULT ")]
            if done.returncode != 0 or not lines:
                failed += 1
                rows.append(f"| {strategy} | {launcher} | FAILED: {done.stderr[-300:]!r} |||")
                continue
            result = json.loads(lines[-1][len("RESULT ") :])
            cells = []
            for what in (
                "save_checkpoint after fit",
                "ModelCheckpoint at step 4",
                "ModelCheckpoint at step 8",
                "trainer.lightning_module after fit",
            ):
                check = result[what]
                failed += not check["ok"]
                text = ("ok" if check["ok"] else "NOT OK") + f", {check['tensors']} tensors"
                if "max_difference" in check:
                    text += f", max diff {check['max_difference']:.1e}"
                cells.append(text)
            rows.append(f"| {strategy} | {launcher} | " + " | ".join(cells) + " |")
    print("| strategy | launcher | save_checkpoint after fit | ModelCheckpoint, step 4 ", end="")
    print("| ModelCheckpoint, step 8 | trainer.lightning_module after fit |")
    print("| --- | --- | --- | --- | --- | --- |")
    print("\n".join(rows))
    return 1 if failed else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--strategy", choices=sorted(STRATEGIES), default="gropipe")
    parser.add_argument("--launcher", choices=LAUNCHERS, default="ddp")
    parser.add_argument("--out", type=Path, default=Path("whole_checkpoints"))
    parser.add_argument("--table", action="store_true", help="every strategy and launcher")
    args = parser.parse_args()
    if args.table:
        return run_table()
    run_cell(args.strategy, args.launcher, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
