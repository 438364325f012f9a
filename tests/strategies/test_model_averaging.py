"""ModelAveragingStrategy inside real Lightning fits: 2 CPU processes, fork launcher."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import Callback, ModelCheckpoint
from pytorch_lightning.strategies import StrategyRegistry
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_parallel.strategies.model_averaging  # noqa: F401  (registers the names)
from lightning_parallel.averaging import (
    BlockMomentumAverager,
    ElasticAverager,
    OuterOptimizerAverager,
    replica_files,
)
from lightning_parallel.bench.specs import parse_spec
from lightning_parallel.strategies.model_averaging import CHECKPOINT_KEY, ModelAveragingStrategy


class Regression(pl.LightningModule):
    """A linear regression on a fixed synthetic set (40 samples: 5 batches of 4 per rank)."""

    def __init__(self, momentum: float = 0.0, optimizers: int = 1) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.first = nn.Linear(4, 3)
        self.second = nn.Linear(3, 2)
        self.momentum = momentum
        self.optimizer_count = optimizers
        self.automatic_optimization = optimizers == 1
        self.validation_checks: list[float] = []

    def forward(self, inputs: Tensor) -> Tensor:
        return self.second(torch.tanh(self.first(inputs)))

    def training_step(self, batch: list[Tensor], batch_idx: int) -> Tensor | None:
        inputs, targets = batch
        loss = nn.functional.mse_loss(self(inputs), targets)
        if self.automatic_optimization:
            return loss
        for optimizer in self.optimizers():  # type: ignore[union-attr]
            optimizer.zero_grad()
        self.manual_backward(loss)
        for optimizer in self.optimizers():  # type: ignore[union-attr]
            optimizer.step()
        return None

    def on_validation_start(self) -> None:
        # Module hooks run before the strategy's: the replica is still this rank's own here.
        self._replica_mean = self.all_gather(flat(self)).mean(0)

    def validation_step(self, batch: list[Tensor], batch_idx: int) -> None:
        inputs, targets = batch
        self.log("val_loss", nn.functional.mse_loss(self(inputs), targets), sync_dist=True)
        if batch_idx == 0:
            self.validation_checks.append(float((flat(self) - self._replica_mean).abs().max()))

    def configure_optimizers(self) -> Any:
        if self.optimizer_count == 1:
            return torch.optim.SGD(self.parameters(), lr=0.1, momentum=self.momentum)
        return [
            torch.optim.SGD(self.first.parameters(), lr=0.1),
            torch.optim.SGD(self.second.parameters(), lr=0.1),
        ]

    def train_dataloader(self) -> DataLoader:
        generator = torch.Generator().manual_seed(0)
        inputs = torch.randn(40, 4, generator=generator)
        targets = torch.randn(40, 2, generator=generator)
        return DataLoader(TensorDataset(inputs, targets), batch_size=4)

    def val_dataloader(self) -> DataLoader:
        return self.train_dataloader()


def flat(module: nn.Module) -> Tensor:
    return torch.cat([p.detach().reshape(-1) for p in module.parameters()])


class Recorder(Callback):
    """Writes what each rank saw into ``directory/rank<r>.json`` (the parent only gets rank 0)."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.steps_per_batch: list[int] = []
        self.gradient_reductions = 0

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        averaging = trainer.strategy.averaging  # type: ignore[attr-defined]
        original = averaging.average_gradients

        def counted(*args: Any, **kwargs: Any) -> None:
            self.gradient_reductions += 1
            original(*args, **kwargs)

        averaging.average_gradients = counted

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        averaging = trainer.strategy.averaging  # type: ignore[attr-defined]
        self.steps_per_batch.append(averaging.schedule.optimizer_steps)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # Callbacks run before the strategy's on_train_end: this is the rank's own replica.
        averaging = trainer.strategy.averaging  # type: ignore[attr-defined]
        from lightning_parallel.comm.ledger import process_ledger

        record = {
            "replica": flat(pl_module).tolist(),
            "rounds": averaging.rounds,
            "gauges": dict(process_ledger().gauges),
            "steps_per_batch": self.steps_per_batch,
            "gradient_reductions": self.gradient_reductions,
            "synchronous_steps": averaging.schedule.synchronous_steps,
            "rollbacks": averaging.rollbacks,
            "validation_checks": getattr(pl_module, "validation_checks", []),
        }
        path = self.directory / f"rank{trainer.global_rank}.json"
        path.write_text(json.dumps(record))


def fit(
    model: pl.LightningModule,
    strategy: Any,
    directory: Path | None = None,
    callbacks: list[Callback] | None = None,
    ckpt_path: str | None = None,
    **trainer_kwargs: Any,
) -> pl.Trainer:
    callbacks = list(callbacks or [])
    if directory is not None:
        callbacks.append(Recorder(directory))
    trainer_kwargs.setdefault("limit_val_batches", 0)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=trainer_kwargs.pop("devices", 2),
        strategy=strategy,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=any(isinstance(c, ModelCheckpoint) for c in callbacks),
        num_sanity_val_steps=0,
        callbacks=callbacks,
        **trainer_kwargs,
    )
    trainer.fit(model, ckpt_path=ckpt_path)
    return trainer


def records(directory: Path, world_size: int = 2) -> list[dict[str, Any]]:
    return [json.loads((directory / f"rank{r}.json").read_text()) for r in range(world_size)]


def averaging(**kwargs: Any) -> ModelAveragingStrategy:
    return ModelAveragingStrategy(start_method="fork", **kwargs)


# ---------------------------------------------------------------------------- equivalence


def test_period_one_equals_ddp() -> None:
    reference = Regression()
    fit(reference, "ddp_fork", max_steps=5)
    model = Regression()
    fit(model, averaging(period=1), max_steps=5)
    assert (flat(model) - flat(reference)).abs().max() < 1e-6


# ---------------------------------------------------------------------------- counting


def test_rounds_count_steps_not_batches_or_optimizers(tmp_path: Path) -> None:
    # gradient accumulation: 5 batches per rank and epoch, 2 per step, 2 epochs -> 6 steps
    accumulated = tmp_path / "accumulated"
    accumulated.mkdir()
    fit(
        Regression(),
        averaging(period=2, warmup_steps=1),
        accumulated,
        max_epochs=2,
        accumulate_grad_batches=2,
    )
    for record in records(accumulated):
        assert record["steps_per_batch"] == [0, 1, 1, 2, 3, 3, 4, 4, 5, 6]
        assert record["rounds"] == 2  # after steps 3 and 5 (step 1 is the warm-up)
        assert record["gradient_reductions"] == 1  # the warm-up step only
    # two optimizers stepping in every batch (manual optimization): one step per batch
    two_optimizers = tmp_path / "two_optimizers"
    two_optimizers.mkdir()
    fit(Regression(optimizers=2), averaging(period=2), two_optimizers, max_epochs=1)
    for record in records(two_optimizers):
        assert record["steps_per_batch"] == [1, 2, 3, 4, 5]
        assert record["rounds"] == 2
        assert record["gauges"]["rounds"] == 2
        assert record["gauges"]["bytes_per_round"] > 0
        assert record["gauges"]["divergence"] > 0  # the replicas moved apart between rounds
        assert record["gradient_reductions"] == 0


def test_the_capped_outer_steps_are_counted_in_the_gauge(tmp_path: Path) -> None:
    # outer Nesterov SGD at lr 0.7, μ 0.9 moves 1.33 times the workers' mean in the first round
    # and more as its momentum builds: the default cap (1) shortens both rounds, and the
    # outer_steps_capped gauge that CommStats logs counts each; uncapped, no gauge is set
    outer = {
        "algorithm": "outer_optimizer",
        "outer_optimizer": "sgd",
        "outer_lr": 0.7,
        "outer_momentum": 0.9,
        "outer_nesterov": True,
        "period": 2,
        "rollback_on_spike": False,
        "replace_collapsed": False,
    }
    for name, options in (("capped", {}), ("free", {"outer_step_cap": float("inf")})):
        (tmp_path / name).mkdir()
        fit(Regression(), averaging(**outer, **options), tmp_path / name, max_epochs=1)
    for capped, free in zip(records(tmp_path / "capped"), records(tmp_path / "free"), strict=True):
        assert capped["rounds"] == free["rounds"] == 2
        assert capped["gauges"]["outer_steps_capped"] == capped["rounds"]  # both rounds
        assert "outer_steps_capped" not in free["gauges"]
        assert capped["replica"] != free["replica"]


def test_validation_sees_the_mean_and_the_parent_gets_the_mean(tmp_path: Path) -> None:
    model = Regression(momentum=0.9)
    fit(model, averaging(algorithm="one_shot"), tmp_path, max_epochs=2, limit_val_batches=1)
    ranks = records(tmp_path)
    replicas = torch.tensor([record["replica"] for record in ranks])
    assert (replicas[0] - replicas[1]).abs().max() > 1e-3  # one-shot: replicas diverged
    for record in ranks:
        assert record["rounds"] == 0
        assert len(record["validation_checks"]) == 2
        assert max(record["validation_checks"]) < 1e-6  # validated on the mean of the replicas
    assert torch.allclose(flat(model), replicas.mean(0), atol=1e-6)  # the parent's model


def test_validation_policies_round_and_mean(tmp_path: Path) -> None:
    # "round": each epoch-end validation (after steps 5 and 10) runs a round first, and the
    # next round comes 3 steps later: rounds after steps 3, 5, 8, 10
    rounds = tmp_path / "round"
    rounds.mkdir()
    fit(Regression(momentum=0.9), averaging(period=3), rounds, max_epochs=2, limit_val_batches=1)
    for record in records(rounds):
        assert record["rounds"] == 4
        assert max(record["validation_checks"]) < 1e-6
    # "mean": validation swaps the mean in and out; training is as if there were no validation
    mean = tmp_path / "mean"
    mean.mkdir()
    validated = Regression(momentum=0.9)
    strategy = averaging(period=3, before_validation="mean")
    fit(validated, strategy, mean, max_epochs=2, limit_val_batches=1)
    for record in records(mean):
        assert record["rounds"] == 3  # after steps 3, 6, 9
        assert max(record["validation_checks"]) < 1e-6
    unvalidated = Regression(momentum=0.9)
    fit(unvalidated, averaging(period=3, before_validation="mean"), max_epochs=2)
    assert torch.equal(flat(validated), flat(unvalidated))


# ---------------------------------------------------------------------------- checkpoints


@pytest.mark.parametrize(
    ("options", "momentum", "validation_batches"),
    [
        ({"algorithm": "bmuf", "nesterov": True}, 0.9, 0),
        ({"algorithm": "diloco", "optimizer_state": "average", "overlap": True}, 0.9, 0),
        ({"algorithm": "easgd", "reduce": "tree"}, 0.0, 0),
        ({"algorithm": "periodic", "buffers": "local"}, 0.9, 1),  # saved after validation
        # streaming: fragment 1's round (started at step 4) is in flight at the step-5 save
        (
            {
                "algorithm": "diloco",
                "fragments": 2,
                "sync_delay": 2,
                "outer_dtype": "int4",
                "outer_error_feedback": True,
            },
            0.9,
            1,
        ),
    ],
)
def test_resume_mid_round_equals_uninterrupted(
    tmp_path: Path, options: dict[str, Any], momentum: float, validation_batches: int
) -> None:
    limits = {"limit_val_batches": validation_batches}
    uninterrupted = Regression(momentum)
    fit(uninterrupted, averaging(period=3, **options), max_epochs=2, **limits)
    checkpoints = tmp_path / "checkpoints"
    # epoch 1 ends after step 5, in the middle of the round that ends at step 6
    first_half = Regression(momentum)
    checkpoint = ModelCheckpoint(dirpath=checkpoints, save_top_k=-1, filename="first")
    fit(first_half, averaging(period=3, **options), callbacks=[checkpoint], max_epochs=1, **limits)
    resumed = Regression(momentum)
    resumed.first.weight.data.fill_(7.0)  # everything must come from the checkpoint
    fit(
        resumed,
        averaging(period=3, **options),
        max_epochs=2,
        ckpt_path=str(checkpoints / "first.ckpt"),
        **limits,
    )
    assert torch.equal(flat(resumed), flat(uninterrupted))


class SpikyRegression(Regression):
    """:class:`Regression` whose loss (and gradient) is 50 times larger at step 6 on every rank,
    or a plain one with ``spike_at=None``."""

    def __init__(self, momentum: float = 0.9, spike_at: int | None = 6) -> None:
        super().__init__(momentum)
        self.spike_at = spike_at

    def training_step(self, batch: list[Tensor], batch_idx: int) -> Tensor | None:
        loss = super().training_step(batch, batch_idx)
        assert loss is not None
        return loss * 50 if self.global_step == self.spike_at else loss


def test_the_plateau_window_runs_its_synchronous_steps_then_switches(tmp_path: Path) -> None:
    # the regression's loss falls from the first steps: the rule fires within a few of them
    strategy = averaging(period=2, synchronous_window=3, plateau_drop=0.02, rollback_on_spike=False)
    fit(SpikyRegression(spike_at=None), strategy, tmp_path, max_epochs=4)
    for record in records(tmp_path):
        assert record["synchronous_steps"] == 3
        assert record["gradient_reductions"] == 3
        window_at = record["gauges"]["synchronous_window_at"]
        assert 1 <= window_at < 10
        # rounds every 2 steps before the step that fired (whose due round the window
        # replaces) and every 2 steps after the window, up to step 20
        window_at = int(window_at)
        assert record["rounds"] == (window_at - 1) // 2 + (20 - window_at - 3) // 2


def test_a_loss_spike_rolls_back_and_the_old_settings_never_do(tmp_path: Path) -> None:
    old = {"synchronous_window": 0, "rollback_on_spike": False, "replace_collapsed": False}
    for name in ("new", "old", "plain-new", "plain-old"):
        (tmp_path / name).mkdir()
    for name, options in [("new", {}), ("old", old)]:
        fit(SpikyRegression(), averaging(period=4, **options), tmp_path / name, max_epochs=2)
    new, old_records = records(tmp_path / "new"), records(tmp_path / "old")
    assert [record["rollbacks"] for record in new] == [1, 1]
    assert [record["rollbacks"] for record in old_records] == [0, 0]
    assert "rollbacks" not in old_records[0]["gauges"]
    # without a spike the rule only watches: the run is bit for bit the former one
    for name, options in [("plain-new", {}), ("plain-old", old)]:
        fit(
            SpikyRegression(spike_at=None),
            averaging(period=4, **options),
            tmp_path / name,
            max_epochs=2,
        )
    assert (
        records(tmp_path / "plain-new")[0]["replica"]
        == (records(tmp_path / "plain-old")[0]["replica"])
    )
    assert records(tmp_path / "plain-new")[0]["rollbacks"] == 0


class CollapsingRegression(Regression):
    """:class:`Regression` whose reported loss (its gradient is the true one's) leaves 2.3 at
    step 2 on every rank and is back at 2.3 from step 6 on the ranks in ``dead_ranks`` (rank
    1 only: a collapsed replica; every rank: a regression)."""

    def __init__(self, momentum: float = 0.0, dead_ranks: tuple[int, ...] = (1,)) -> None:
        super().__init__(momentum)
        self.dead_ranks = dead_ranks

    def training_step(self, batch: list[Tensor], batch_idx: int) -> Tensor | None:
        loss = super().training_step(batch, batch_idx)
        assert loss is not None
        dead = self.global_step < 2 or (
            self.global_rank in self.dead_ranks and self.global_step >= 6
        )
        return loss - loss.detach() + (2.3 if dead else 1.0)


class StartRecorder(Callback):
    """Writes, for every training step of each rank, the parameters it started from (seen
    before the backward pass: after the strategy's batch start, where a roll-back lands) and
    those it ended with, into ``directory/steps<r>.json``."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.starts: list[list[float]] = []
        self.ends: list[list[float]] = []

    def on_before_backward(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, *_: Any
    ) -> None:
        self.starts.append(flat(pl_module).tolist())

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, *_: Any
    ) -> None:
        self.ends.append(flat(pl_module).tolist())

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        path = self.directory / f"steps{trainer.global_rank}.json"
        path.write_text(json.dumps({"starts": self.starts, "ends": self.ends}))


def test_easgd_goes_back_to_its_center_on_a_regression_and_trains_through_a_spike(
    tmp_path: Path,
) -> None:
    easgd = {"algorithm": "easgd", "period": 4}
    for name in ("regression", "spike", "spike-unwatched"):
        (tmp_path / name).mkdir()
    # every rank's loss back at the start from step 6: a regression, which rolls both ranks
    # back to the center kept by the last round before the climb
    fit(
        CollapsingRegression(momentum=0.9, dead_ranks=(0, 1)),
        averaging(**easgd),
        tmp_path / "regression",
        callbacks=[StartRecorder(tmp_path / "regression")],
        max_epochs=5,
    )
    for record in records(tmp_path / "regression"):
        assert record["rollbacks"] == 1
        assert record["gauges"]["loss_regressions"] == 1
    ranks = [json.loads((tmp_path / "regression" / f"steps{r}.json").read_text()) for r in (0, 1)]
    # the round after step 3 (0-based) restarted replica i at x_i + α(x̃ − x_i) (x_i: its
    # end of step 3), so the center it kept is x̃ = x_i + (x_i' − x_i)/α; the loss climbs
    # from step 6 and the round after step 7 is held apart, so step 16, the one after the
    # regression, starts from that center on both ranks, the first step since step 0 where
    # the replicas agree
    starts = [ranks[0]["starts"][step] == ranks[1]["starts"][step] for step in range(25)]
    assert [step for step, same in enumerate(starts) if same] == [0, 16]
    alpha = 0.9 / 2
    for steps in ranks:
        end, restart = torch.tensor(steps["ends"][3]), torch.tensor(steps["starts"][4])
        center = end + (restart - end) / alpha
        torch.testing.assert_close(torch.tensor(steps["starts"][16]), center, rtol=1e-4, atol=1e-5)
    # a spike is counted and trained through (going back to the center before a descent
    # EASGD trains through cost vgg_mini seeds 4 and 11 up to 17 points): the run is bit for
    # bit the one without the rule
    old = {"rollback_on_spike": False}
    for name, options in [("spike", {}), ("spike-unwatched", old)]:
        fit(SpikyRegression(), averaging(**easgd, **options), tmp_path / name, max_epochs=2)
    watched, unwatched = records(tmp_path / "spike"), records(tmp_path / "spike-unwatched")
    assert [record["rollbacks"] for record in watched] == [0, 0]
    assert watched[0]["gauges"]["loss_spikes"] >= 1  # the spike step and some after it
    assert "loss_spikes" not in unwatched[0]["gauges"]
    assert watched[0]["replica"] == unwatched[0]["replica"]


@pytest.mark.parametrize("replace", [True, False])
def test_a_collapsed_replica_is_replaced_under_lightning(tmp_path: Path, replace: bool) -> None:
    # the default rule (smoothing 0.7, patience 3) sees rank 1 back at the start from step 12
    options = {} if replace else {"replace_collapsed": False}
    fit(CollapsingRegression(momentum=0.9), averaging(period=50, **options), tmp_path, max_epochs=4)
    for record in records(tmp_path):
        assert record["rollbacks"] == 0
        assert record["gauges"].get("replicas_replaced") == (1 if replace else None)


def test_checkpoint_holds_the_mean_and_loads_anywhere(tmp_path: Path) -> None:
    checkpoint = ModelCheckpoint(dirpath=tmp_path, save_top_k=-1, filename="mid")
    fit(Regression(momentum=0.9), averaging(period=4), callbacks=[checkpoint], max_epochs=1)
    path = tmp_path / "mid.ckpt"
    saved = torch.load(path, weights_only=False)
    state = saved[CHECKPOINT_KEY]
    assert state["shared"]["schedule"] == {
        "optimizer_steps": 5,
        "warmup_steps": 0,
        "synchronous_steps": 0,
        "rounds": 1,
        "last_round_step": 4,
        "phase_origin": 0,
    }
    assert "replicas" not in state  # each rank's replica is in a file of its own
    replicas = [
        replica_files.load_replica(replica_files.replica_path(path, state["replica_files"], rank))[
            "model"
        ]
        for rank in range(2)
    ]
    for key, value in saved["state_dict"].items():
        mean = (replicas[0][key] + replicas[1][key]) / 2
        assert torch.allclose(value, mean, atol=1e-7), key
    assert not torch.equal(replicas[0]["first.weight"], replicas[1]["first.weight"])
    # plain torch, one device, and DDP all take the checkpoint as an ordinary one
    plain = Regression()
    plain.load_state_dict(saved["state_dict"])
    single = pl.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False)
    single.validate(Regression(), ckpt_path=str(path), verbose=False)
    fit(Regression(momentum=0.9), "ddp_fork", max_epochs=2, ckpt_path=str(path))


def _checkpoint_at(directory: Path, world_size: int) -> Path:
    checkpoint = ModelCheckpoint(dirpath=directory, save_top_k=-1, filename="mid")
    fit(
        Regression(momentum=0.9),
        averaging(period=4),
        callbacks=[checkpoint],
        max_epochs=1,
        devices=world_size,
    )
    return directory / "mid.ckpt"


def test_checkpoint_size_does_not_grow_with_the_world_size(tmp_path: Path) -> None:
    sizes = {}
    for world_size in (2, 4):
        path = _checkpoint_at(tmp_path / str(world_size), world_size)
        saved = torch.load(path, weights_only=False)
        (save,) = path.with_name("mid.ckpt.replicas").iterdir()
        assert save.name == saved[CHECKPOINT_KEY]["replica_files"]
        assert sorted(p.name for p in save.iterdir()) == [f"rank{r}.pt" for r in range(world_size)]
        sizes[world_size] = path.stat().st_size
    assert abs(sizes[4] - sizes[2]) / sizes[2] < 0.10, sizes


def test_a_replica_save_that_fails_leaves_the_previous_file_whole(tmp_path: Path) -> None:
    path = replica_files.replica_path(tmp_path / "last.ckpt", "step4", 0)
    replica_files.save_replica({"weights": torch.ones(3)}, path)

    class Unpicklable:
        def __reduce__(self) -> Any:
            raise RuntimeError("the save broke half-way")

    with pytest.raises(RuntimeError, match="half-way"):
        replica_files.save_replica({"weights": torch.zeros(3), "broken": Unpicklable()}, path)
    assert torch.equal(replica_files.load_replica(path)["weights"], torch.ones(3))
    assert [p.name for p in path.parent.iterdir()] == ["rank0.pt"]  # no temporary left


def test_removing_a_checkpoint_removes_its_replica_files(tmp_path: Path) -> None:
    # save_top_k=1 keeps the better checkpoint and removes the other, with its replicas
    checkpoint = ModelCheckpoint(dirpath=tmp_path, save_top_k=1, monitor="step", mode="max")
    fit(Regression(), averaging(period=2), callbacks=[checkpoint], max_epochs=2)
    kept = sorted(p.name for p in tmp_path.iterdir())
    assert len([name for name in kept if name.endswith(".ckpt")]) == 1
    assert [name for name in kept if name.endswith(".replicas")] == [
        f"{name}.replicas" for name in kept if name.endswith(".ckpt")
    ]


# ---------------------------------------------------------------------------- arguments


def test_registered_names_and_bench_style_construction() -> None:
    expected = {
        "model_averaging": "periodic",
        "local_sgd": "periodic",
        "bmuf": "bmuf",
        "easgd": "easgd",
        "diloco": "outer_optimizer",
    }
    for name, algorithm in expected.items():
        entry = StrategyRegistry[name]
        assert entry["strategy"] is ModelAveragingStrategy
        # the bench converts the SPEC's text at its edge, then constructs as Python does
        options = parse_spec(f"{name}:period=8,reduce=tree").options
        strategy = entry["strategy"](**{**entry["init_params"], **options})
        assert strategy.algorithm == algorithm
        assert strategy.period == 8
        assert strategy.policies.reduce == "tree"
        assert strategy.reports_communication
    diloco = StrategyRegistry["diloco"]["strategy"](**StrategyRegistry["diloco"]["init_params"])
    outer = diloco._make_averager()
    outer.reset([torch.zeros(1)], 2)
    assert isinstance(outer, OuterOptimizerAverager)
    assert outer.optimizer is not None
    assert outer.optimizer.defaults["lr"] == 0.7
    assert outer.optimizer.defaults["momentum"] == 0.5  # not the paper's 0.9: see the docs
    assert outer.optimizer.defaults["nesterov"]
    assert outer.step_cap == 1.0  # the workers' own step at most
    uncapped = parse_spec("diloco:outer_step_cap=inf").options
    paper = ModelAveragingStrategy(**{**StrategyRegistry["diloco"]["init_params"], **uncapped})
    assert isinstance(free := paper._make_averager(), OuterOptimizerAverager)
    assert free.step_cap == float("inf")
    bmuf = StrategyRegistry["bmuf"]["strategy"](**StrategyRegistry["bmuf"]["init_params"])
    block = bmuf._make_averager()
    block.reset([torch.zeros(1)], 2)
    assert isinstance(block, BlockMomentumAverager)
    assert (block.block_momentum, block.block_learning_rate, block.nesterov) == (0.5, 0.5, True)
    easgd = StrategyRegistry["easgd"]["strategy"](**StrategyRegistry["easgd"]["init_params"])
    elastic = easgd._make_averager()
    elastic.reset([torch.zeros(1)], 2)
    assert isinstance(elastic, ElasticAverager)
    assert (elastic.alpha, elastic.beta, elastic.center_first) == (0.45, 0.9, True)
    # the algorithm's name gives the same defaults as the registered preset
    named = ModelAveragingStrategy(algorithm="easgd")._make_averager()
    assert isinstance(named, ElasticAverager) and named.center_first
    paper = ModelAveragingStrategy(algorithm="easgd", center_first=False)._make_averager()
    assert isinstance(paper, ElasticAverager) and not paper.center_first
    assert StrategyRegistry["diloco"]["init_params"]["period"] == 16
    assert StrategyRegistry["easgd"]["init_params"]["period"] == 6
    custom = ModelAveragingStrategy(algorithm=BlockMomentumAverager(block_momentum=0.3))
    assert custom.algorithm == "BlockMomentumAverager"


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"period": 0}, "period must be a positive integer"),
        ({"period": None}, "one_shot"),
        ({"algorithm": "sgd"}, "algorithm must be one of"),
        ({"buffers": "sync"}, "buffers must be one of"),
        ({"optimizer_state": "drop"}, "optimizer_state must be one of"),
        ({"reduce": "ring"}, "reduce must be one of"),
        ({"algorithm": "periodic", "alpha": 0.5}, r"alpha \(for easgd\)"),
        ({"algorithm": "bmuf", "block_momentum": 1.5}, "block_momentum"),
        ({"algorithm": "outer_optimizer", "outer_optimizer": "nope"}, "not a torch.optim class"),
        (
            {"algorithm": "outer_optimizer", "outer_optimizer": "adam", "outer_momentum": 0.9},
            "Adam",
        ),
        ({"algorithm": "outer_optimizer", "outer_step_cap": 0.0}, "step_cap must be a positive"),
        ({"algorithm": "bmuf", "outer_step_cap": 1.0}, r"outer_step_cap \(for outer_optimizer\)"),
        ({"warmup_steps": -1}, "warmup_steps"),
        ({"synchronous_window": -1}, "synchronous_window"),
        ({"plateau_drop": 1.5}, "plateau_drop"),
        ({"spike_ratio": 1.0}, "spike_ratio must be above 1"),
        ({"spike_regression": 0.0}, r"spike_regression must be in \(0, 1\]"),
        ({"rollback_on_spike": "yes"}, "rollback_on_spike"),
        ({"replace_collapsed": "yes"}, "replace_collapsed"),
        ({"overlap": "maybe"}, "overlap must be true or false"),
        ({"period": 4, "fragments": 5}, "fragments must be between 1 and period"),
        ({"period": 4, "sync_delay": 5}, "must not exceed the period"),
        ({"algorithm": "one_shot", "outer_dtype": "int8"}, "one_shot averages once"),
        ({"overlap": True, "sync_delay": 0}, "overlap=True"),
        ({"fragment_update_alpha": 2}, r"\[0, 1\]"),
        ({"outer_dtype": "fp8"}, "outer_dtype must be one of"),
        ({"outer_error_feedback": True}, "outer_error_feedback keeps"),
        ({"before_validation": "center"}, "before_validation must be one of"),
    ],
)
def test_bad_arguments_fail_at_construction(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises((ValueError, TypeError), match=message):
        ModelAveragingStrategy(**kwargs)


def test_sync_batchnorm_is_refused() -> None:
    # raised in the worker's setup; the fork launcher re-raises it in the parent
    with pytest.raises(Exception, match="sync_batchnorm"):
        pl.Trainer(
            accelerator="cpu",
            devices=1,
            strategy=averaging(period=2),
            sync_batchnorm=True,
            logger=False,
            enable_progress_bar=False,
            enable_checkpointing=False,
            max_steps=1,
        ).fit(Regression())


def test_streaming_rounds_send_one_fragment_each_and_validate_the_global_model(
    tmp_path: Path,
) -> None:
    strategy = averaging(
        algorithm="diloco",
        period=4,
        fragments=2,
        sync_delay=1,
        outer_dtype="int8",
        before_validation="global",
    )
    model = Regression(momentum=0.9)
    fit(model, strategy, tmp_path, max_epochs=2, limit_val_batches=1)
    for record in records(tmp_path):
        # fragment 0 (first Linear) at local steps 2, 6, 10; fragment 1 at 4, 8 (the round due
        # after step 10 starts when the last validation synchronizes)
        assert record["rounds"] == 5
        # one int8 fragment a round: a single 256-value block and its scale, sent once
        assert record["gauges"]["peak_round_bytes"] == 256 + 4
        assert len(record["validation_checks"]) == 2
    # the replicas had diverged before the end; the parent's model is rank 0's after the final
    # round of every fragment (an agreed point, not either replica)
    replicas = torch.tensor([record["replica"] for record in records(tmp_path)])
    assert (replicas[0] - replicas[1]).abs().max() > 1e-4
    assert (flat(model) - replicas[0]).abs().max() > 1e-6
    assert torch.isfinite(flat(model)).all()
