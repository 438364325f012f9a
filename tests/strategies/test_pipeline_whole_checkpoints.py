"""A pipeline's checkpoints hold every stage whatever the launcher, or are refused.

Each rank of a pipeline holds its own stage; the whole model exists only when the stages are
gathered. Before this was fixed, a ``trainer.save_checkpoint`` after ``fit`` in the processes
that trained (Lightning's default launcher for a script, ``torchrun``, SLURM) wrote rank 0's
stage alone, without a word. These tests run the launchers as a user starts them
(``examples/whole_checkpoints.py``), and an outside launch in-process (as ``torchrun`` does).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from helpers.distributed import run_distributed
from helpers.environment import user_environment
from helpers.trainers import QUIET
from pytorch_lightning.callbacks import OnExceptionCheckpoint
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from lightning_parallel import PartialCheckpointError
from lightning_parallel.strategies.gropipe import GroPipeStrategy
from lightning_parallel.strategies.spectrain import SpecTrainStrategy

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "whole_checkpoints.py"
SAMPLES, BATCH, STEPS = 32, 8, 4


class Net(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.Sequential(
            nn.Linear(6, 12), nn.Tanh(), nn.Linear(12, 12), nn.Tanh(), nn.Linear(12, 3)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


def dataset() -> TensorDataset:
    generator = torch.Generator().manual_seed(3)
    return TensorDataset(
        torch.randn(SAMPLES, 6, generator=generator),
        torch.randint(0, 3, (SAMPLES,), generator=generator),
    )


def one_device(steps: int = STEPS) -> dict[str, torch.Tensor]:
    """``steps`` steps on one device in the order Lightning's injected sampler gives one
    data-parallel replica (shuffled, seed 0)."""
    model = Net()
    optimizer = model.configure_optimizers()
    data = dataset()
    sampler = DistributedSampler(data, num_replicas=1, rank=0, shuffle=True, seed=0)
    for batch in list(DataLoader(data, batch_size=BATCH, sampler=sampler))[:steps]:
        optimizer.zero_grad()
        model.training_step(batch, 0).backward()
        optimizer.step()
    return model.state_dict()


def _fit_then_save(rank: int, world: int, name: str, folder: str) -> dict[str, Any]:
    """One process of an outside launch (``torchrun``-like): fit, then save after ``fit``."""
    os.environ.update(LOCAL_RANK="0", NODE_RANK=str(rank))
    options: dict[str, Any] = {"stages": 2, "micro_batches": 2, "partition": [2]}
    strategy = (GroPipeStrategy if name == "gropipe" else SpecTrainStrategy)(**options)
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, num_nodes=world, strategy=strategy, max_steps=STEPS, **QUIET
    )
    model = Net()
    trainer.fit(model, DataLoader(dataset(), batch_size=BATCH))
    trainer.save_checkpoint(Path(folder) / "final.ckpt")
    held = model.state_dict()
    return {
        "meta": [k for k, v in held.items() if v.is_meta],
        "held": {k: v.clone() for k, v in held.items() if not v.is_meta},
    }


@pytest.mark.parametrize("name", ["gropipe", "spectrain"])
def test_save_after_fit_under_an_outside_launcher_holds_every_stage(
    tmp_path: Path, name: str
) -> None:
    results = run_distributed(_fit_then_save, 2, name, str(tmp_path), init_group=False)
    assert results[0]["meta"] == [], "rank 0 must hold the whole model after fit"
    assert results[1]["meta"], "the other ranks keep their own stage only"
    checkpoint = torch.load(tmp_path / "final.ckpt", weights_only=False)
    plain = Net()
    plain.load_state_dict(checkpoint["state_dict"], strict=True)
    expected = one_device() if name == "gropipe" else results[0]["held"]
    for key, value in expected.items():
        torch.testing.assert_close(checkpoint["state_dict"][key], value, rtol=1e-5, atol=1e-6)
    # the momentum of every parameter, not of rank 0's stage alone
    assert len(checkpoint["optimizer_states"][0]["state"]) == len(list(plain.parameters()))
    stages = checkpoint["pipeline"]["stages"]
    assert len(stages) == 2
    if name == "spectrain":  # each stage's predictor, kept from the end of fit
        assert all(stage.get("state") for stage in stages)


def test_a_partial_checkpoint_is_refused_and_not_written(tmp_path: Path) -> None:
    model = Net()
    with torch.device("meta"):
        model.layers[0] = nn.Linear(6, 12)  # a stage this process does not hold
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, strategy=GroPipeStrategy(stages=1), max_steps=0, **QUIET
    )
    trainer.strategy._lightning_module = model
    checkpoint = {"state_dict": trainer.strategy.lightning_module_state_dict()}
    with pytest.raises(PartialCheckpointError, match=r"miss 2 of the model's 6 tensors"):
        trainer.strategy.save_checkpoint(checkpoint, tmp_path / "partial.ckpt")
    assert not (tmp_path / "partial.ckpt").exists()


class RaiseBeforeBatch(pl.Callback):
    """Every rank raises before batch 2 (between steps: every stage can still be gathered)."""

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.global_step == 2:
            raise RuntimeError("stopped before step 3")


class RaisesInsideTheStep(Net):
    """The last stage (rank 0, the only one that computes the loss) raises inside step 3,
    while the other stage waits for its gradient."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        if self.trainer.global_rank == 0 and batch_idx == 2:
            raise RuntimeError("failed inside step 3")
        return loss


def _fit_until_it_raises(rank: int, world: int, inside: bool, folder: str) -> str:
    os.environ.update(LOCAL_RANK="0", NODE_RANK=str(rank))
    strategy = GroPipeStrategy(
        stages=2, micro_batches=2, partition=[2], timeout=timedelta(seconds=10)
    )
    saver = OnExceptionCheckpoint(dirpath=folder, filename="on_exception")
    callbacks: list[pl.Callback] = [saver] if inside else [saver, RaiseBeforeBatch()]
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        num_nodes=world,
        strategy=strategy,
        max_steps=STEPS,
        callbacks=callbacks,
        **{**QUIET, "enable_checkpointing": True},
    )
    try:
        trainer.fit(
            RaisesInsideTheStep() if inside else Net(), DataLoader(dataset(), batch_size=BATCH)
        )
    except BaseException as error:  # what each rank raised is the result
        return f"{type(error).__name__}: {error}"
    return "no error"


def test_a_checkpoint_on_exception_between_steps_holds_every_stage(tmp_path: Path) -> None:
    raised = run_distributed(_fit_until_it_raises, 2, False, str(tmp_path), init_group=False)
    assert all("stopped before step 3" in text for text in raised), raised
    state = torch.load(tmp_path / "on_exception.ckpt", weights_only=False)["state_dict"]
    Net().load_state_dict(state, strict=True)
    for key, value in one_device(2).items():
        torch.testing.assert_close(state[key], value, rtol=1e-5, atol=1e-6)


@pytest.mark.slow  # waits out the failed run's wait
def test_a_checkpoint_on_exception_inside_a_step_is_refused_not_partial(tmp_path: Path) -> None:
    raised = run_distributed(
        _fit_until_it_raises, 2, True, str(tmp_path), init_group=False, timeout=90
    )
    assert raised[0].startswith("PartialCheckpointError"), raised
    assert "rank(s) [1] did not reach this checkpoint within 5 s" in raised[0]
    assert raised[1] != "no error"  # the stuck stage fails too, it does not hang
    assert not list(tmp_path.glob("*.ckpt"))


@pytest.mark.slow
@pytest.mark.parametrize(
    ("name", "launcher"),
    [
        *[("gropipe", launcher) for launcher in ("ddp", "spawn", "fork", "torchrun")],
        # SpecTrain shares the mechanism; its own part (the engine state kept from the end of
        # fit) is tested above under an outside launch, and here under the script launcher
        ("spectrain", "ddp"),
    ],
)
def test_every_launcher_writes_whole_checkpoints(tmp_path: Path, name: str, launcher: str) -> None:
    """As a user starts it: after fit, by ModelCheckpoint during fit, load_from_checkpoint."""
    sys.path.insert(0, str(EXAMPLE.parent))
    try:
        from whole_checkpoints import cell_command
    finally:
        sys.path.remove(str(EXAMPLE.parent))
    done = subprocess.run(
        cell_command(name, launcher, tmp_path / "out"),
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
        env=user_environment(),
    )
    assert done.returncode == 0, done.stderr[-3000:]
    line = [x for x in done.stdout.splitlines() if x.startswith("RESULT ")][-1]
    result = json.loads(line[len("RESULT ") :])
    for what in (
        "save_checkpoint after fit",
        "ModelCheckpoint at step 4",
        "ModelCheckpoint at step 8",
        "trainer.lightning_module after fit",
    ):
        assert result[what]["ok"], f"{what}: {result[what]}"
        assert result[what]["tensors"] == "6/6"
