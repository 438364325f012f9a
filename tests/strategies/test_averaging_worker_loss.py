"""Model averaging that outlives a lost replica (``worker_loss="continue"``), on 3 processes.

The processes are started the way an outside launcher starts them (one per "host", as the
benchmark does); a rank leaves at a given step or validation batch (injected by step, not by
wall-clock time, so that a busy machine does not move it).
"""

from __future__ import annotations

import logging
import os
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import pytorch_lightning as pl
import torch
import torchmetrics
from helpers.distributed import run_distributed, start_fork_server
from pytorch_lightning import Trainer
from pytorch_lightning.callbacks import Callback, ModelCheckpoint
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_parallel.averaging import replica_files
from lightning_parallel.callbacks.hylo import HyloCompression
from lightning_parallel.strategies.model_averaging import CHECKPOINT_KEY, ModelAveragingStrategy


class Classifier(pl.LightningModule):
    """Three classes of 8-dimensional points (96 samples), a torchmetrics accuracy."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3))
        self.accuracy = torchmetrics.classification.MulticlassAccuracy(num_classes=3)

    def forward(self, inputs: Tensor) -> Tensor:
        return self.net(inputs)

    def training_step(self, batch: list[Tensor], batch_idx: int) -> Tensor:
        inputs, labels = batch
        loss = nn.functional.cross_entropy(self(inputs), labels)
        self.log("train_loss", loss, sync_dist=True, on_epoch=True, on_step=False)
        return loss

    def validation_step(self, batch: list[Tensor], batch_idx: int) -> None:
        inputs, labels = batch
        self.accuracy(self(inputs), labels)
        self.log("val_acc", self.accuracy)
        self.log("val_loss", nn.functional.cross_entropy(self(inputs), labels), sync_dist=True)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.2)

    def train_dataloader(self) -> DataLoader:
        generator = torch.Generator().manual_seed(0)
        centers = torch.randn(3, 8, generator=generator) * 2
        labels = torch.arange(96) % 3
        inputs = centers[labels] + torch.randn(96, 8, generator=generator)
        return DataLoader(TensorDataset(inputs, labels), batch_size=8)

    def val_dataloader(self) -> DataLoader:
        return self.train_dataloader()


def _vector(module: nn.Module) -> Tensor:
    return torch.cat([p.detach().reshape(-1) for p in module.net.parameters()])


class _Leave(Callback):
    """Rank ``rank`` exits at training step ``step``, or in its first validation batch."""

    def __init__(self, rank: int, when: str, step: int = 5) -> None:
        self.rank, self.when, self.step = rank, when, step

    def on_train_batch_end(self, trainer: Trainer, *args: Any) -> None:
        here = self.when == "training" and trainer.global_rank == self.rank
        if here and trainer.global_step == self.step:
            os._exit(1)

    def on_validation_batch_end(self, trainer: Trainer, *args: Any) -> None:
        if self.when == "validation" and trainer.global_rank == self.rank:
            os._exit(1)


class _Seen(Callback):
    """The first feature of every training sample this rank took, per epoch, and the number of
    samples of its last validation."""

    def __init__(self) -> None:
        self.trained: dict[int, list[float]] = {}
        self.validated = 0

    def on_train_batch_start(self, trainer: Trainer, module: Any, batch: Any, *args: Any) -> None:
        self.trained.setdefault(trainer.current_epoch, []).extend(batch[0][:, 0].tolist())

    def on_validation_epoch_start(self, *args: Any) -> None:
        self.validated = 0

    def on_validation_batch_start(
        self, trainer: Trainer, module: Any, batch: Any, *args: Any
    ) -> None:
        self.validated += len(batch[0])


def _fit(
    tmp_path: Path,
    rank: int,
    world: int,
    strategy: ModelAveragingStrategy,
    callbacks: list[Callback],
    epochs: int = 3,
    resume: Path | None = None,
    accelerator: str = "cpu",
) -> tuple[Trainer, Classifier, list[str]]:
    os.environ.update(LOCAL_RANK="0", NODE_RANK=str(rank))  # one process per "host"
    messages: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: messages.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("lightning_parallel").addHandler(handler)
    trainer = Trainer(
        accelerator=accelerator,
        devices=1,
        num_nodes=world,
        strategy=strategy,
        max_epochs=epochs,
        callbacks=callbacks,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        default_root_dir=tmp_path,
    )
    model = Classifier()
    trainer.fit(model, ckpt_path=resume)
    return trainer, model, messages


def _continuing(**kwargs: Any) -> ModelAveragingStrategy:
    return ModelAveragingStrategy(
        worker_loss="continue", heartbeat_timeout=8.0, timeout=timedelta(seconds=60), **kwargs
    )


SPECS = {
    "model_averaging": {"algorithm": "periodic", "period": 2},
    "bmuf_tree": {"algorithm": "bmuf", "period": 2, "reduce": "tree"},
    "diloco_streaming_int8": {
        "algorithm": "diloco",
        "period": 4,
        "fragments": 2,
        "sync_delay": 1,
        "outer_dtype": "int8",
        "outer_lr": 0.7,
    },
}


@pytest.mark.faults
@pytest.mark.parametrize(
    ("spec", "when"),
    [
        ("model_averaging", "training"),
        ("bmuf_tree", "training"),  # the tree before the loss, a flat ring after it
        ("diloco_streaming_int8", "training"),
        ("diloco_streaming_int8", "validation"),
    ],
)
def test_the_survivors_go_on_without_a_lost_replica_and_say_so(
    tmp_path: Path, spec: str, when: str
) -> None:
    """Rank 2 of 3 leaves (in training at step 5, in the second epoch, or in its first
    validation): ranks 0 and 1 are told, log it, train the three epochs over the two of them
    (rounds, ``sync_dist``, a torchmetrics metric), write checkpoints, and end on the same
    model. From the epoch after the one of the loss the data are divided between the two:
    together they train and validate on every sample again (6 steps an epoch instead of 4)."""

    def fn(rank: int, world: int) -> Any:
        checkpoints = ModelCheckpoint(dirpath=tmp_path, save_last=True, every_n_epochs=1)
        strategy = _continuing(**SPECS[spec])
        seen = _Seen()
        trainer, model, messages = _fit(
            tmp_path, rank, world, strategy, [_Leave(2, when), checkpoints, seen]
        )
        result = (
            trainer.current_epoch,
            trainer.global_step,
            _vector(model),
            float(trainer.callback_metrics["val_acc"]),
            [m for m in messages if "was lost" in m],
            seen.trained,
            seen.validated,
            [m for m in messages if "the data are divided among" in m],
        )
        # a later run in these processes is refused, naming the lost rank, before any
        # collective over the default group (which still counts rank 2)
        with pytest.raises(RuntimeError, match=r"rank\(s\) \[2\] were lost during the last fit"):
            trainer.validate(model, verbose=False)
        return result

    start_fork_server()  # its first start is not the run's time
    start = time.monotonic()
    results = run_distributed(fn, 3, timeout=120, may_vanish={2}, init_group=False)
    assert time.monotonic() - start < 100
    assert results[2] is None
    divided_from = 1 if when == "validation" else 2  # the epoch after the loss
    for epoch, steps, _, accuracy, said, trained, validated, _ in results[:2]:
        # 96 samples in batches of 8: 4 steps an epoch on 3 ranks, 6 on 2
        assert epoch == 3 and steps == 4 * divided_from + 6 * (3 - divided_from)
        assert [len(trained[e]) for e in range(3)] == [32] * divided_from + [48] * (
            3 - divided_from
        )
        assert validated == 48
        assert 0.5 < accuracy <= 1.0
        assert len(said) == 1, said
        assert "replica rank 2 was lost (no heartbeat for" in said[0]
        assert "training continues on the 2 remaining replicas (ranks [0, 1])" in said[0]
    dataset = Classifier().train_dataloader().dataset
    everything = set(dataset.tensors[0][:, 0].tolist())  # type: ignore[attr-defined]
    first = [set(results[rank][5][0]) for rank in (0, 1)]
    assert len(everything) == 96 and len(first[0] | first[1]) == 64  # rank 2 had the rest
    for later in range(divided_from, 3):  # the two survivors cover every sample again
        mine, yours = (set(results[rank][5][later]) for rank in (0, 1))
        assert mine | yours == everything and not mine & yours
    said = results[0][7]
    assert len(said) == 1 and "the data are divided among the 2 remaining ranks [0, 1]" in said[0]
    assert results[1][7] == []  # said once, by the first survivor
    assert torch.equal(results[0][2], results[1][2])  # the end of fit: every replica the mean
    assert results[0][3] == results[1][3]  # the metric was synchronised over both
    checkpoint = torch.load(tmp_path / "last.ckpt", weights_only=False)
    assert checkpoint["epoch"] == 2
    assert checkpoint[CHECKPOINT_KEY]["world_size"] == 2
    restored = Classifier()
    restored.load_state_dict(checkpoint["state_dict"])
    assert torch.equal(_vector(restored), results[0][2])


@pytest.mark.faults
def test_a_checkpoint_written_after_a_loss_resumes_exactly_on_the_survivors(
    tmp_path: Path,
) -> None:
    """The survivors' checkpoint names their replica files by their place (0, 1), so a run of
    two processes resumes each replica and the averager exactly (no fallback to the mean)."""
    first, second = tmp_path / "lost", tmp_path / "resumed"

    def lose(rank: int, world: int) -> Any:
        checkpoints = ModelCheckpoint(dirpath=first, save_last=True, every_n_epochs=1)
        strategy = _continuing(**SPECS["diloco_streaming_int8"])
        _fit(first, rank, world, strategy, [_Leave(1, "training"), checkpoints], epochs=2)
        return True

    run_distributed(lose, 3, timeout=120, may_vanish={1}, init_group=False)
    checkpoint_path = first / "last.ckpt"
    saved = torch.load(checkpoint_path, weights_only=False)[CHECKPOINT_KEY]
    folder = replica_files.replica_path(checkpoint_path, saved["replica_files"], 0).parent
    assert sorted(path.name for path in folder.iterdir()) == ["rank0.pt", "rank1.pt"]

    class Loaded(Callback):
        def on_train_start(self, trainer: Trainer, pl_module: pl.LightningModule) -> None:
            averaging = trainer.strategy.averaging
            self.replica = _vector(pl_module)
            self.steps = averaging.schedule.optimizer_steps
            self.started = averaging.averager.started

    def resume(rank: int, world: int) -> Any:
        loaded = Loaded()
        strategy = ModelAveragingStrategy(**SPECS["diloco_streaming_int8"])
        with _no_fallback():
            trainer, _, _ = _fit(second, rank, world, strategy, [loaded], 3, checkpoint_path)
        own = replica_files.load_replica(folder / f"rank{rank}.pt")["model"]
        expected = torch.cat([own[k].reshape(-1) for k in own if k.startswith("net.")])
        return (
            torch.equal(loaded.replica, expected),
            loaded.steps,
            loaded.started,
            trainer.current_epoch,
        )

    for exact, steps, started, epoch in run_distributed(resume, 2, timeout=120, init_group=False):
        assert exact and started and steps == saved["shared"]["schedule"]["optimizer_steps"]
        assert epoch == 3


class _no_fallback:
    """Fail if the resume falls back to the averaged model (a warning says so)."""

    def __enter__(self) -> None:
        import warnings

        self._catcher = warnings.catch_warnings(record=True)
        self._caught = self._catcher.__enter__()
        warnings.simplefilter("always")

    def __exit__(self, *exc: Any) -> None:
        self._catcher.__exit__(*exc)
        fallbacks = [str(w.message) for w in self._caught if "restarts from" in str(w.message)]
        assert not fallbacks, fallbacks


@pytest.mark.faults
def test_stop_ends_every_rank_with_an_error_after_the_timeout(tmp_path: Path) -> None:
    """The default: a lost replica ends the run on the others within the timeout."""

    def fn(rank: int, world: int) -> Any:
        strategy = ModelAveragingStrategy(period=2, timeout=timedelta(seconds=15))
        _fit(tmp_path, rank, world, strategy, [_Leave(2, "training")], epochs=20)

    start_fork_server()  # its first start is not the run's time
    start = time.monotonic()
    with pytest.raises(RuntimeError) as raised:
        run_distributed(fn, 3, timeout=90, may_vanish={2}, init_group=False)
    assert time.monotonic() - start < 15 + 45
    assert "[lightning_parallel] rank 2 (last doing: " in str(raised.value)  # the diagnosis


def test_worker_loss_arguments_are_checked_at_construction() -> None:
    assert ModelAveragingStrategy().worker_loss == "stop"
    with pytest.raises(ValueError, match="worker_loss must be 'continue' or 'stop'"):
        ModelAveragingStrategy(worker_loss="ignore")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="needs a gloo default process group"):
        ModelAveragingStrategy(worker_loss="continue", process_group_backend="nccl")
    with pytest.raises(ValueError, match="must be shorter than timeout"):
        ModelAveragingStrategy(
            worker_loss="continue", heartbeat_timeout=30, timeout=timedelta(seconds=20)
        )
    strategy = ModelAveragingStrategy(worker_loss="continue", timeout=timedelta(seconds=40))
    assert strategy.fault_timeout == 20.0


def test_hylo_on_averaging_refuses_to_continue_without_a_lost_replica(tmp_path: Path) -> None:
    """Hylo's compressed rounds use collectives of their own: the combination says so."""

    def fn(rank: int, world: int) -> Any:
        strategy = _continuing(period=2)
        _fit(tmp_path, rank, world, strategy, [HyloCompression()], epochs=1)

    with pytest.raises(RuntimeError, match="use worker_loss='stop' with it"):
        run_distributed(fn, 2, timeout=90, init_group=False)


@pytest.mark.gpu
@pytest.mark.faults
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA is not available")
def test_on_cuda_the_survivors_go_on_without_a_lost_replica(tmp_path: Path) -> None:
    """Three ranks share one GPU over gloo (streaming int8 rounds, the lanes' threads on CUDA);
    rank 2 leaves at step 5 and the two others finish on the same model."""

    def fn(rank: int, world: int) -> Any:
        strategy = _continuing(**SPECS["diloco_streaming_int8"], process_group_backend="gloo")
        leave = _Leave(2, "training")
        trainer, model, messages = _fit(tmp_path, rank, world, strategy, [leave], 2, None, "cuda")
        return trainer.current_epoch, _vector(model).cpu(), [m for m in messages if "lost" in m]

    results = run_distributed(fn, 3, timeout=180, may_vanish={2}, init_group=False)
    for epoch, _, said in results[:2]:
        assert epoch == 2 and len(said) == 1 and "replica rank 2 was lost" in said[0]
    assert torch.equal(results[0][1], results[1][1])


def test_continue_chooses_a_launcher_whose_ranks_outlive_a_dead_one() -> None:
    """Lightning's popen launcher ends every rank when one child dies; with "continue" the
    strategy's does not, and spawn/fork (which cannot keep them) warn."""

    def launcher(**kwargs: Any) -> str:
        trainer = Trainer(accelerator="cpu", devices=3, strategy=ModelAveragingStrategy(**kwargs))
        return type(trainer.strategy.launcher).__name__

    assert launcher(worker_loss="continue") == "SurvivingScriptLauncher"
    assert launcher() == "_SubprocessScriptLauncher"
    with pytest.warns(UserWarning, match="only a frozen or cut-off rank can be dropped"):
        launcher(worker_loss="continue", start_method="spawn")
