"""ParameterServerStrategy inside real Lightning fits (fork launcher, 2 processes on gloo)."""

import json
import logging
import os
import time
from datetime import timedelta

import pytest
import torch
import torchmetrics
from helpers.distributed import run_distributed
from pytorch_lightning import Callback, LightningModule, Trainer
from pytorch_lightning.callbacks import ModelCheckpoint
from pytorch_lightning.strategies import DDPStrategy, StrategyRegistry
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_parallel.callbacks import CommStats
from lightning_parallel.comm.ledger import process_ledger
from lightning_parallel.strategies.parameter_server import (
    ParameterServerStrategy,
    resolve_worker_loss,
)


class _Tiny(LightningModule):
    def __init__(self, samples: int = 64) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.samples = samples
        self.layers = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3))

    def forward(self, x):
        return self.layers(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.cross_entropy(self(x), y)
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", nn.functional.cross_entropy(self(x), y), sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)

    def _data(self, seed):
        generator = torch.Generator().manual_seed(seed)
        x = torch.randn(self.samples, 8, generator=generator)
        return TensorDataset(x, (x[:, 0] > 0).long() + (x[:, 1] > 0).long())

    def train_dataloader(self):
        return DataLoader(self._data(1), batch_size=8)

    def val_dataloader(self):
        return DataLoader(self._data(2), batch_size=8)


class _Record(Callback):
    """Each rank writes what it did: batches, gauges, bytes; rank 1 may be slowed down."""

    def __init__(self, directory, stats, slow_rank=None, delay=0.0):
        self.directory, self.stats, self.slow_rank, self.delay = directory, stats, slow_rank, delay
        self.batches = 0

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.batches += 1
        if trainer.global_rank == self.slow_rank:
            time.sleep(self.delay)

    def on_train_end(self, trainer, pl_module):
        skipped = getattr(trainer.strategy, "skipped_batches", 0)
        record = {
            "batches": self.batches - skipped,  # trained (a skipped batch went to another rank)
            "skipped": skipped,
            "bytes": self.stats.totals.bytes_sent,
            "gauges": dict(process_ledger().gauges),
        }
        (self.directory / f"rank{trainer.global_rank}.json").write_text(json.dumps(record))


def _trainer(strategy, epochs=2, callbacks=(), checkpoint_dir=None, devices=2, **kwargs):
    return Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=strategy,
        max_epochs=epochs,
        callbacks=list(callbacks),
        logger=False,
        enable_checkpointing=checkpoint_dir is not None,
        default_root_dir=checkpoint_dir,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        **kwargs,
    )


def _vector(model):
    return torch.nn.utils.parameters_to_vector(model.parameters()).detach()


@pytest.mark.parametrize("overlap", [False, True])
def test_fit_shares_the_epoch_and_reports_telemetry(tmp_path, overlap):
    """Every batch of the shared budget is trained once, with or without overlapped exchanges
    (an overlapped step must not hand back batches its worker already started)."""
    stats = CommStats(log=False)
    record = _Record(tmp_path, stats, slow_rank=1, delay=0.05)
    model = _Tiny(samples=128)
    before = _vector(model).clone()
    trainer = _trainer(
        ParameterServerStrategy(staleness="inverse", overlap=overlap, start_method="fork"),
        callbacks=[stats, record],
    )
    trainer.fit(model)
    assert not torch.equal(_vector(model), before)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    batches = [r["batches"] for r in ranks]
    assert sum(batches) == 2 * 16  # 2 epochs of 128 samples in batches of 8, shared
    assert batches[0] > batches[1]  # the fast worker took more of the epoch
    gauges = ranks[0]["gauges"]  # rank 0 hosts the server
    assert gauges["ps_applied"] == 32 and gauges["ps_updates"] == 32
    assert sum(v for k, v in gauges.items() if k.startswith("staleness_hist_")) == 32
    assert gauges["staleness_mean"] > 0
    assert ranks[1]["bytes"] > 0 and ranks[0]["bytes"] > 0  # gradients out, weights back
    assert "ps_wait_s" in ranks[1]["gauges"]


def test_local_accumulation_pushes_once_per_m_batches(tmp_path):
    """``accumulate_grad_batches=m``: a worker accumulates m local batches and pushes their mean
    once ("iterate m steps, then synchronise"): about m times fewer pushes, every batch still
    trained once. Lightning steps at an epoch's last batch whatever was accumulated, so each
    rank's share of an epoch ends with one partial push at most."""
    stats = CommStats(log=False)
    record = _Record(tmp_path, stats)
    trainer = _trainer(
        ParameterServerStrategy(start_method="fork"),
        callbacks=[stats, record],
        accumulate_grad_batches=4,
    )
    trainer.fit(_Tiny(samples=128))
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert sum(r["batches"] for r in ranks) == 2 * 16
    pushes = sum(r["gauges"]["ps_gradients_sent"] for r in ranks)
    assert ranks[0]["gauges"]["ps_applied"] == pushes
    full, partial_at_most = 2 * 16 // 4, 2 * 2  # 2 ranks x 2 epochs
    assert full <= pushes <= full + partial_at_most


class _Slow(Callback):
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_rank == 1:
            time.sleep(0.02)


def test_max_staleness_zero_equals_ddp_with_a_straggler():
    synchronous = _Tiny(samples=72)
    _trainer(
        ParameterServerStrategy(max_staleness=0, start_method="fork"),
        devices=3,
        callbacks=[_Slow()],
    ).fit(synchronous)
    reference = _Tiny(samples=72)
    _trainer(DDPStrategy(start_method="fork"), devices=3).fit(reference)
    torch.testing.assert_close(_vector(synchronous), _vector(reference), rtol=0, atol=1e-6)


def test_checkpoint_resume_is_exact_and_loads_elsewhere(tmp_path):
    straight = _Tiny()
    _trainer(ParameterServerStrategy(max_staleness=0, start_method="fork"), epochs=2).fit(straight)

    first = _Tiny()
    checkpoint = ModelCheckpoint(dirpath=tmp_path, save_last=True)
    _trainer(
        ParameterServerStrategy(max_staleness=0, start_method="fork"),
        epochs=1,
        callbacks=[checkpoint],
        checkpoint_dir=tmp_path,
    ).fit(first)
    path = tmp_path / "last.ckpt"
    saved = torch.load(path, weights_only=False)
    assert saved["parameter_server"]["versions"] == [4]  # 4 synchronous updates per epoch
    assert all("momentum_buffer" in s for s in saved["optimizer_states"][0]["state"].values())

    resumed = _Tiny()
    _trainer(
        ParameterServerStrategy(max_staleness=0, start_method="fork"),
        epochs=2,
        checkpoint_dir=tmp_path,
    ).fit(resumed, ckpt_path=path)
    torch.testing.assert_close(_vector(resumed), _vector(straight), rtol=0, atol=1e-7)

    under_ddp = _Tiny()
    _trainer(DDPStrategy(start_method="fork"), epochs=2).fit(under_ddp, ckpt_path=path)
    torch.testing.assert_close(_vector(under_ddp), _vector(straight), rtol=0, atol=1e-6)

    one_device = _Tiny()
    Trainer(
        accelerator="cpu",
        devices=1,
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    ).fit(one_device, ckpt_path=path)
    torch.testing.assert_close(_vector(one_device), _vector(first), rtol=0, atol=0)


def test_bench_specs_build_from_the_registry():
    for name in ("parameter_server", "async_ps"):
        entry = StrategyRegistry[name]
        assert entry["strategy"] is ParameterServerStrategy
    build = StrategyRegistry["parameter_server"]
    specs = {"staleness": "inverse"}, {"softsync": 2}, {"max_staleness": 2}, {"dc": 0.04}
    policies = [build["strategy"](**{**build["init_params"], **spec}).policy for spec in specs]
    assert policies[0].staleness == "inverse" and policies[1].softsync == 2
    assert policies[2].max_staleness == 2 and policies[3].delay_compensation == 0.04
    assert ParameterServerStrategy.reports_communication is True


def test_bad_arguments_name_the_fix():
    with pytest.raises(ValueError, match="staleness must be one of"):
        ParameterServerStrategy(staleness="linear")
    with pytest.raises(ValueError, match="shards must be an integer >= 1"):
        ParameterServerStrategy(shards=0)
    with pytest.raises(ValueError, match="start_method must be one of"):
        ParameterServerStrategy(start_method="thread")
    with pytest.raises(ValueError, match="worker_loss='continue' needs a gloo default"):
        ParameterServerStrategy(worker_loss="continue", process_group_backend="nccl")


def test_a_lost_worker_stops_the_run_by_default_over_nccl_and_continue_is_refused_there():
    # an NCCL communicator does not survive a lost peer: stop, unless gloo carries the group
    assert resolve_worker_loss(None, "gloo") == "continue"
    assert resolve_worker_loss(None, "nccl") == "stop"
    assert resolve_worker_loss(None, "cpu:gloo,cuda:nccl") == "stop"
    assert resolve_worker_loss("stop", "gloo") == "stop"
    with pytest.raises(ValueError, match="use worker_loss='stop'"):
        resolve_worker_loss("continue", "nccl")


def test_mid_epoch_validation_is_refused():
    with pytest.raises(Exception, match="validates at epoch ends only"):
        _trainer(ParameterServerStrategy(start_method="fork"), val_check_interval=0.5).fit(_Tiny())


@pytest.mark.faults
def test_killed_worker_stops_lightning_ranks_naming_it(tmp_path):
    """Processes started outside Lightning (as the benchmark does); rank 2 dies mid-epoch and
    ``worker_loss="stop"`` ends the run on the others."""

    class Die(Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if trainer.global_rank == 2 and batch_idx == 2:
                os._exit(1)

    def fn(rank, world):
        os.environ.update(LOCAL_RANK="0", NODE_RANK=str(rank))  # one process per "host"
        trainer = Trainer(
            accelerator="cpu",
            devices=1,
            num_nodes=world,
            strategy=ParameterServerStrategy(heartbeat_timeout=10.0, worker_loss="stop"),
            max_epochs=50,
            callbacks=[Die()],
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            num_sanity_val_steps=0,
            default_root_dir=tmp_path,
        )
        trainer.fit(_Tiny(samples=512))

    start = time.monotonic()
    with pytest.raises(RuntimeError) as raised:
        run_distributed(fn, 3, timeout=90)
    assert time.monotonic() - start < 60
    assert "worker rank 2 failed" in str(raised.value)


class _Measured(_Tiny):
    """With a torchmetrics metric, which synchronises over its own process group."""

    def __init__(self, samples: int = 64) -> None:
        super().__init__(samples)
        self.accuracy = torchmetrics.classification.MulticlassAccuracy(num_classes=3)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.accuracy(self(x), y)
        self.log("val_acc", self.accuracy)
        super().validation_step(batch, batch_idx)


@pytest.mark.faults
@pytest.mark.parametrize("when", ["training", "validation"])
def test_the_others_go_on_without_a_killed_worker_and_say_so(tmp_path, when):
    """Rank 2 of 3 dies in the first epoch, in its training (the others learn it at the drain)
    or in its validation (the others' collectives fail, and go on over the survivors): ranks 0
    and 1 train the three epochs, validate (``sync_dist`` and a torchmetrics metric, over the
    survivors), save checkpoints and log the loss; both end on the server's weights. From the
    second epoch on they divide every sample among themselves: rank 2's share is trained and
    validated again."""

    class Seen(Callback):
        """The first feature of every sample this rank trained on, per epoch, and of every
        sample of its last validation."""

        def __init__(self):
            self.trained, self.validated = {}, []

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            self.trained.setdefault(trainer.current_epoch, []).extend(batch[0][:, 0].tolist())

        def on_validation_epoch_start(self, trainer, pl_module):
            self.validated = []

        def on_validation_batch_start(self, trainer, pl_module, batch, *args):
            self.validated.extend(batch[0][:, 0].tolist())

    class Die(Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if when == "training" and trainer.global_rank == 2 and batch_idx == 2:
                os._exit(1)

        def on_validation_batch_end(self, trainer, pl_module, *args):
            if when == "validation" and trainer.global_rank == 2:
                os._exit(1)

    def fn(rank, world):
        os.environ.update(LOCAL_RANK="0", NODE_RANK=str(rank))
        messages = []
        handler = logging.Handler()
        handler.emit = lambda record: messages.append(record.getMessage())
        logging.getLogger("lightning_parallel").addHandler(handler)
        checkpoints = ModelCheckpoint(dirpath=tmp_path, save_last=True, every_n_epochs=1)
        strategy = ParameterServerStrategy(timeout=timedelta(seconds=30))
        seen = Seen()
        trainer = Trainer(
            accelerator="cpu",
            devices=1,
            num_nodes=world,
            strategy=strategy,
            max_epochs=3,
            callbacks=[Die(), checkpoints, seen],
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            num_sanity_val_steps=0,
            default_root_dir=tmp_path,
        )
        model = _Measured(samples=512)
        trainer.fit(model)
        return (
            trainer.current_epoch,
            strategy.survivors,
            _vector(model),
            float(trainer.callback_metrics["val_acc"]),
            [m for m in messages if "was lost" in m],
            seen.trained,
            seen.validated,
            [m for m in messages if "the data are divided among" in m],
            trainer.reload_dataloaders_every_n_epochs,
        )

    start = time.monotonic()
    results = run_distributed(fn, 3, timeout=120, may_vanish={2}, init_group=False)
    assert time.monotonic() - start < 90
    assert results[2] is None
    for epoch, survivors, _, accuracy, said, _, validated, _, reload in results[:2]:
        assert epoch == 3 and survivors == [0, 1]
        assert 0.0 <= accuracy <= 1.0
        assert len(said) == 1 and "worker rank 2 was lost" in said[0], said
        assert "training continues on the 2 remaining workers" in said[0]
        assert len(validated) == 256  # half of the 512 validation samples (a third before)
        assert reload == 0  # the user's setting is back after fit
    everything = set(_Measured(samples=512)._data(1).tensors[0][:, 0].tolist())
    trained = [results[rank][5][2] for rank in (0, 1)]
    # the last epoch's budget is the survivors' shares, all 512 samples (2 x 22 batches of a
    # third each before, 352 samples; a batch whose grant a faster worker took is recorded,
    # not trained), and they drew from more samples than the old budget held (not from each
    # exactly once: a fast worker past its share reshuffles, a slow one stops early; even
    # one worker taking the whole budget would draw about 384 different ones in expectation)
    assert len(trained[0]) + len(trained[1]) >= 512
    last = set(trained[0]) | set(trained[1])
    assert last <= everything and len(last) > 2 * 22 * 8
    validation = set(_Measured(samples=512)._data(2).tensors[0][:, 0].tolist())
    mine, yours = set(results[0][6]), set(results[1][6])
    assert mine | yours == validation and not mine & yours
    said = results[0][7]
    assert len(said) == 1 and "the data are divided among the 2 remaining ranks [0, 1]" in said[0]
    assert results[1][7] == []
    assert torch.equal(results[0][2], results[1][2])
    assert results[0][3] == results[1][3]  # the metric was synchronised over both
    checkpoint = torch.load(tmp_path / "last.ckpt", weights_only=False)
    assert checkpoint["epoch"] == 2  # the last epoch's checkpoint, written by rank 0
    restored = _Measured()
    restored.load_state_dict(checkpoint["state_dict"])
    assert torch.equal(_vector(restored), results[0][2])


@pytest.mark.filterwarnings("error:Detected call of `lr_scheduler.step\\(\\)`:UserWarning")
def test_a_scheduler_follows_the_server_steps_without_torch_s_order_warning():
    """The server steps in place of the user's optimizer; torch's scheduler must still see a
    step before its own: the forked ranks inherit the filter that turns the warning
    "lr_scheduler.step() before optimizer.step()" into an error, which fails the fit."""

    class Scheduled(_Tiny):
        def configure_optimizers(self):
            optimizer = torch.optim.SGD(self.parameters(), lr=0.1)
            scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
            return [optimizer], [scheduler]

    model = Scheduled()
    before = _vector(model).clone()
    trainer = _trainer(ParameterServerStrategy(start_method="fork"), epochs=2)
    trainer.fit(model)  # raises if a rank warned
    assert not torch.equal(_vector(model), before)  # the trained weights came back


def test_one_process_trains_like_plain_sgd():
    """One worker and its in-process server: every gradient is fresh, so it is plain SGD.

    The fit runs in a child process of its own, so it leaves no process group, store or rank
    variables behind in the test session.
    """

    def fn(rank, world):
        settings = dict(
            accelerator="cpu",
            devices=1,
            max_epochs=2,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            num_sanity_val_steps=0,
            use_distributed_sampler=False,
        )  # the same batch order for both
        served = _Tiny()
        Trainer(strategy=ParameterServerStrategy(), **settings).fit(served)
        torch.distributed.destroy_process_group()
        plain = _Tiny()
        Trainer(**settings).fit(plain)
        return _vector(served), _vector(plain)

    [(served, plain)] = run_distributed(fn, 1, timeout=90, init_group=False)
    assert not torch.equal(served, _vector(_Tiny()))
    torch.testing.assert_close(served, plain, rtol=0, atol=1e-6)


def test_limits_are_global_batch_budgets(tmp_path):
    """limit_train_batches caps each rank's share of the pool; max_steps the whole run's."""
    stats = CommStats(log=False)
    _trainer(
        ParameterServerStrategy(start_method="fork"),
        epochs=2,
        limit_train_batches=3,
        callbacks=[stats, _Record(tmp_path, stats)],
    ).fit(_Tiny(samples=128))
    batches = [json.loads((tmp_path / f"rank{r}.json").read_text())["batches"] for r in range(2)]
    assert sum(batches) == 2 * 2 * 3  # 2 epochs x 2 ranks x 3 batches

    stats = CommStats(log=False)
    trainer = Trainer(
        accelerator="cpu",
        devices=2,
        strategy=ParameterServerStrategy(start_method="fork"),
        max_steps=5,
        callbacks=[stats, _Record(tmp_path, stats)],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    trainer.fit(_Tiny(samples=128))
    batches = [json.loads((tmp_path / f"rank{r}.json").read_text())["batches"] for r in range(2)]
    assert sum(batches) == 5 * 2  # max_steps x world size, however the ranks shared it
