import pytest
import torch
from pytorch_lightning import LightningModule, Trainer
from pytorch_lightning.strategies import DDPStrategy
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_parallel.callbacks import CommStats
from lightning_parallel.comm.ledger import CommLedger


class _Tiny(LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(32, 4)  # 132 parameters -> 528 gradient bytes

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.cross_entropy(self.layer(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _loader() -> DataLoader:
    generator = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(64, 32, generator=generator), torch.randint(0, 4, (64,)))
    return DataLoader(data, batch_size=8)


def _fit(accumulate: int) -> Trainer:
    trainer = Trainer(
        accelerator="cpu",
        devices=2,
        strategy=DDPStrategy(start_method="fork"),
        max_steps=4,
        accumulate_grad_batches=accumulate,
        callbacks=[CommStats()],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(_Tiny(), _loader())
    return trainer


def test_plain_ddp_bytes_are_the_gradient_ring_allreduce():
    # DDP's reducer communicates in C++; CommStats adds 2(W-1)/W * 528 bytes per step (W = 2),
    # and every Python-side collective Lightning runs on top is counted as it happens.
    trainer = _fit(accumulate=1)
    reported = trainer.callback_metrics["comm/bytes"].item()
    assert 528 <= reported < 528 + 64
    assert trainer.callback_metrics["comm/calls"].item() >= 1


def test_bytes_are_per_optimizer_step_under_gradient_accumulation():
    trainer = _fit(accumulate=2)
    reported = trainer.callback_metrics["comm/bytes"].item()
    assert 528 <= reported < 528 + 64


class _Gauged(_Tiny):
    """Sets a gauge in a ledger each step, as a strategy would; records what is logged when."""

    def __init__(self, ledger: CommLedger) -> None:
        super().__init__()
        self.ledger = ledger
        self.logged: dict[str, list[int]] = {}

    def training_step(self, batch, batch_idx):
        self.ledger.set_gauge("probe", float(self.global_step))
        return super().training_step(batch, batch_idx)

    def log(self, name, value, *args, **kwargs) -> None:
        self.logged.setdefault(name, []).append(self.trainer.global_step)
        super().log(name, value, *args, **kwargs)


def _single(stats: CommStats, **trainer_options) -> dict[str, list[int]]:
    trainer = Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=8,
        callbacks=[stats],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **trainer_options,
    )
    model = _Gauged(stats.ledger)
    trainer.fit(model, _loader())
    assert stats.totals.steps == 8 and len(stats.history) == 8  # collected in any case
    return model.logged


def test_log_false_logs_nothing_although_lightning_sets_every_callbacks_log():
    # Lightning assigns the module's `log` to an attribute `log` of every callback: the switch
    # must live elsewhere, or log=False is silently ignored
    logged = _single(CommStats(log=False, ledger=CommLedger()))
    assert not any(name.startswith("comm/") for name in logged)


def test_gauges_are_logged_on_the_steps_the_trainer_writes():
    logged = _single(CommStats(ledger=CommLedger()), log_every_n_steps=4)
    assert logged["comm/bytes"] == list(range(1, 9))  # every step
    assert logged["comm/probe"] == [4, 8]


def test_gauges_every_n_steps_overrides_the_trainer():
    logged = _single(CommStats(ledger=CommLedger(), gauges_every_n_steps=2), log_every_n_steps=4)
    assert logged["comm/probe"] == [2, 4, 6, 8]
    with pytest.raises(ValueError, match="gauges_every_n_steps"):
        CommStats(gauges_every_n_steps=0)
