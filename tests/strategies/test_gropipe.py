"""GroPipeStrategy inside real Lightning fits (fork launcher, gloo, 2 or 4 processes).

Lightning's injected training sampler shuffles (seed 0): the single-device references read the
data through ``DistributedSampler(num_replicas=1, shuffle=True)`` so both see the same order.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from pytorch_lightning.callbacks import EarlyStopping, ModelCheckpoint
from pytorch_lightning.strategies import StrategyRegistry
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from lightning_parallel.comm.ledger import process_ledger
from lightning_parallel.strategies.gropipe import GroPipeStrategy

SAMPLES, BATCH = 64, 16


class Net(pl.LightningModule):
    def __init__(self, batch_norm: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        norm: list[nn.Module] = [nn.BatchNorm1d(12)] if batch_norm else []
        self.layers = nn.Sequential(
            nn.Linear(6, 12), nn.Tanh(), *norm, nn.Linear(12, 12), nn.Tanh(), nn.Linear(12, 3)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        logits = self(x)
        self.log("val_loss", F.cross_entropy(logits, y), sync_dist=True)
        self.log("val_acc", (logits.argmax(-1) == y).float().mean())

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self(batch[0])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


def dataset(samples: int = SAMPLES) -> TensorDataset:
    generator = torch.Generator().manual_seed(3)
    return TensorDataset(
        torch.randn(samples, 6, generator=generator),
        torch.randint(0, 3, (samples,), generator=generator),
    )


def loader(batch: int = BATCH, shuffled: bool = False) -> DataLoader:
    data = dataset()
    if shuffled:  # the order Lightning's injected sampler gives with one data-parallel replica
        sampler = DistributedSampler(data, num_replicas=1, rank=0, shuffle=True, seed=0)
        return DataLoader(data, batch_size=batch, sampler=sampler)
    return DataLoader(data, batch_size=batch)


def trainer(strategy: Any, devices: int, **kwargs: Any) -> pl.Trainer:
    options: dict[str, Any] = dict(
        accelerator="cpu",
        devices=devices,
        strategy=strategy,
        max_epochs=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    options.update(kwargs)
    return pl.Trainer(**options)


def assert_same_weights(a: nn.Module, b: nn.Module, tolerance: float = 1e-5) -> None:
    for (name, left), (_, right) in zip(a.state_dict().items(), b.state_dict().items()):
        torch.testing.assert_close(left, right, rtol=tolerance, atol=1e-6, msg=f"{name} differs")


def test_registered_name() -> None:
    assert StrategyRegistry["gropipe"]["strategy"] is GroPipeStrategy
    assert GroPipeStrategy.reports_communication is True


@pytest.mark.parametrize(
    ("schedule", "extra"),
    [("1f1b", {}), ("gpipe", {"gradient_clip_val": 0.05, "accumulate_grad_batches": 2})],
)
def test_fit_matches_single_device(schedule: str, extra: dict[str, Any]) -> None:
    reference = Net()
    trainer("auto", 1, **extra).fit(reference, loader(shuffled=True), loader())
    model = Net()
    strategy = GroPipeStrategy(stages=2, micro_batches=4, schedule=schedule, start_method="fork")
    run = trainer(strategy, 2, **extra)
    run.fit(model, loader(), loader())
    assert_same_weights(reference, model)  # the fork launcher hands back every stage
    for key in ("train_loss", "val_loss", "val_acc"):
        torch.testing.assert_close(
            run.callback_metrics[key], reference.trainer.callback_metrics[key]
        )


@pytest.mark.parametrize("placement", ["pipeline", "stage"])
def test_two_groups_of_two_stages_match_single_device(placement: str) -> None:
    reference = Net()
    trainer("auto", 1).fit(reference, loader(2 * BATCH, shuffled=True))
    model = Net()
    strategy = GroPipeStrategy(
        stages=2, micro_batches=2, partition=[3], placement=placement, start_method="fork"
    )
    trainer(strategy, 4).fit(model, loader(BATCH))
    assert_same_weights(reference, model)


class DifferentOnEveryRank(Net):
    """Processes started apart (popen, torchrun) initialize their models differently."""

    def setup(self, stage: str) -> None:
        with torch.no_grad():
            for parameter in self.parameters():
                parameter.add_(float(self.global_rank))


def test_every_rank_starts_from_rank_zero_weights() -> None:
    reference = Net()
    trainer("auto", 1).fit(reference, loader(shuffled=True))
    model = DifferentOnEveryRank()
    trainer(GroPipeStrategy(stages=2, micro_batches=4, start_method="fork"), 2).fit(model, loader())
    assert_same_weights(reference, model)


class RankReport(pl.Callback):
    """Each rank writes its callback metrics and the ledger's gauges to a file."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        report = {
            "metrics": {k: float(v) for k, v in trainer.callback_metrics.items()},
            "gauges": dict(process_ledger().gauges),
        }
        (self.directory / f"rank{trainer.global_rank}.json").write_text(json.dumps(report))


def test_metrics_on_every_rank_callbacks_and_telemetry(tmp_path: Path) -> None:
    checkpoint = ModelCheckpoint(dirpath=tmp_path, monitor="val_loss", save_top_k=1)
    callbacks = [checkpoint, EarlyStopping(monitor="val_loss", patience=5), RankReport(tmp_path)]
    strategy = GroPipeStrategy(
        stages=2, micro_batches=4, start_method="fork", timeline_path=str(tmp_path / "timeline.png")
    )
    trainer(strategy, 2, callbacks=callbacks, enable_checkpointing=True).fit(
        Net(), loader(), loader()
    )
    reports = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for report in reports:  # rank 1 runs stage 0, which never computes a loss itself
        assert {"train_loss", "val_loss", "val_acc"} <= set(report["metrics"])
    assert reports[0]["metrics"] == pytest.approx(reports[1]["metrics"])
    gauges = reports[0]["gauges"]
    assert 0.0 <= gauges["bubble_fraction"] < 1.0 and 0.0 <= gauges["bubble_fraction_model"] < 1.0
    assert gauges["bubble_fraction_projected"] == pytest.approx(
        strategy_projection(gauges), rel=1e-9
    )
    assert gauges["stage0_seconds_measured"] > 0 and gauges["stage1_seconds_projected"] > 0
    # the split that ran is recorded, and every rank ran the same one
    assert gauges["partition_boundary_0"] >= 1
    assert reports[1]["gauges"]["partition_boundary_0"] == gauges["partition_boundary_0"]
    assert list(tmp_path.glob("*.ckpt")), "ModelCheckpoint saved nothing"
    assert (tmp_path / "timeline.png").stat().st_size > 0


def strategy_projection(gauges: dict[str, float]) -> float:
    """The partitioner's bubble from its projected stage times (the formula of partition.py)."""
    seconds = [gauges["stage0_seconds_projected"], gauges["stage1_seconds_projected"]]
    step = sum(seconds) + 3 * max(seconds)
    return 1 - 4 * sum(seconds) / (2 * step)


def test_checkpoint_loads_on_one_device_and_resumes_exactly(tmp_path: Path) -> None:
    straight = Net()
    trainer(GroPipeStrategy(stages=2, micro_batches=4, start_method="fork"), 2).fit(
        straight, loader()
    )

    first = Net()
    saver = ModelCheckpoint(dirpath=tmp_path, save_last=True)
    strategy = GroPipeStrategy(stages=2, micro_batches=4, start_method="fork")
    trainer(strategy, 2, max_epochs=1, callbacks=[saver], enable_checkpointing=True).fit(
        first, loader()
    )
    checkpoint = torch.load(tmp_path / "last.ckpt", weights_only=False)

    plain = Net()  # a consolidated checkpoint: every stage's weights, every momentum buffer
    plain.load_state_dict(checkpoint["state_dict"])
    assert_same_weights(plain, first, tolerance=0)
    momentum = checkpoint["optimizer_states"][0]["state"]
    assert len(momentum) == len(list(plain.parameters()))

    resumed = Net()
    strategy = GroPipeStrategy(stages=2, micro_batches=4, start_method="fork")
    trainer(strategy, 2).fit(resumed, loader(), ckpt_path=tmp_path / "last.ckpt")
    assert_same_weights(straight, resumed, tolerance=0)

    # ... and under a single device, the second epoch continues the same training
    on_one_device = Net()
    trainer("auto", 1).fit(on_one_device, loader(shuffled=True), ckpt_path=tmp_path / "last.ckpt")
    assert_same_weights(straight, on_one_device)


def test_batch_norm_is_deferred_during_fit_and_restored_after() -> None:
    model = Net(batch_norm=True)
    strategy = GroPipeStrategy(stages=2, micro_batches=4, start_method="fork")
    trainer(strategy, 2, max_epochs=1).fit(model, loader())
    norm = model.layers[2]
    assert type(norm) is nn.BatchNorm1d
    assert (
        int(norm.num_batches_tracked) == SAMPLES // BATCH
    )  # one update per step, not per micro-batch
    assert not torch.equal(norm.running_mean, torch.zeros(12))


class SavePredictions(pl.Callback):
    """Rank 0 (the last stage) saves what predict_step returned (fork launchers return none)."""

    def __init__(self, path: Path) -> None:
        self.path, self.outputs = path, []  # type: ignore[var-annotated]

    def on_predict_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        self.outputs.append(args[1])

    def on_predict_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.global_rank == 0:
            torch.save(torch.cat(self.outputs), self.path)


def test_predict_runs_through_the_pipeline(tmp_path: Path) -> None:
    model = Net()
    strategy = GroPipeStrategy(stages=2, micro_batches=4, start_method="fork")
    writer = SavePredictions(tmp_path / "predictions.pt")
    trainer(strategy, 2, callbacks=[writer]).predict(model, loader())
    expected = model(dataset().tensors[0]).detach()
    torch.testing.assert_close(torch.load(tmp_path / "predictions.pt"), expected)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"stages": 0}, "stages must be a positive integer"),
        ({"micro_batches": 0}, "micro_batches must be a positive integer"),
        ({"schedule": "zigzag"}, "schedule must be one of"),
        ({"stages": 3, "partition": [2]}, "it needs 2 boundaries"),
        ({"partition": "greedy"}, "partition must be 'auto', 'estimate', 'even'"),
        ({"recompute": "sometimes"}, "recompute must be one of"),
        ({"start_method": "thread"}, "start_method must be one of"),
    ],
)
def test_bad_arguments_fail_at_construction(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        GroPipeStrategy(**kwargs)


def test_an_estimated_partition_comes_from_shapes_and_is_the_same_every_time(monkeypatch) -> None:
    """``partition="estimate"`` splits by FLOPs and bytes (``estimate_layers``), never by
    timings, so every run of a model gets the same stages."""
    from lightning_parallel.pipeline import assembly
    from lightning_parallel.pipeline.partition import partition
    from lightning_parallel.pipeline.profile import estimate_layers

    def timed(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("partition='estimate' must not time the layers")

    monkeypatch.setattr(assembly, "profile_layers", timed)
    layers = [nn.Linear(32, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU()]
    layers += [nn.Linear(512, 16), nn.ReLU(), nn.Linear(16, 4)]
    example = (torch.randn(8, 32),)
    strategy = GroPipeStrategy(stages=3, micro_batches=2, partition="estimate")
    chosen = [strategy._choose_boundaries(layers, example)[0] for _ in range(3)]
    expected = partition(estimate_layers(layers, example), 3, 2).boundaries
    # the 512x512 product (nearly 10x the FLOPs of the rest together) gets a stage of its own
    assert chosen == [list(expected)] * 3 and expected == (1, 3)
