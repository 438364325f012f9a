import json

import pytest
import torch
from pytorch_lightning import Callback, LightningModule, Trainer
from pytorch_lightning.strategies import DDPStrategy, StrategyRegistry
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.utils.data import DataLoader, TensorDataset

from lightning_parallel.callbacks import CommStats
from lightning_parallel.strategies.ddp_hooks import HookedDDPStrategy, PowerSGDDDPStrategy


class _Tiny(LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 10))

    def forward(self, x):
        return self.layers(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.cross_entropy(self(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        generator = torch.Generator().manual_seed(1)
        x = torch.randn(256, 32, generator=generator)
        y = torch.randint(0, 10, (256,), generator=generator)
        return DataLoader(TensorDataset(x, y), batch_size=16)


class _Record(Callback):
    """Each rank writes how often the hook ran and what CommStats counted."""

    def __init__(self, directory, stats: CommStats) -> None:
        self.directory = directory
        self.stats = stats

    def on_train_end(self, trainer, pl_module):
        record = {
            "hook_calls": getattr(trainer.strategy, "hook_calls", None),
            "bytes": self.stats.totals.bytes_sent,
            "steps": self.stats.totals.steps,
        }
        path = self.directory / f"rank{trainer.global_rank}.json"
        path.write_text(json.dumps(record))


def _fit(strategy, tmp_path, steps=6):
    model = _Tiny()
    stats = CommStats(log=False)
    trainer = Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        max_steps=steps,
        callbacks=[stats, _Record(tmp_path, stats)],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model)
    records = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    return torch.nn.utils.parameters_to_vector(model.parameters()).detach(), records


def test_fp16_hook_runs_on_cpu_and_matches_plain_ddp(tmp_path):
    (tmp_path / "ddp").mkdir()
    dense, dense_records = _fit(DDPStrategy(start_method="fork"), tmp_path / "ddp")
    (tmp_path / "fp16").mkdir()
    hooked = HookedDDPStrategy(ddp_comm_hook=default_hooks.fp16_compress_hook, start_method="fork")
    compressed, records = _fit(hooked, tmp_path / "fp16")
    for record in records:
        assert record["hook_calls"] >= 6  # at least one bucket per step, on every rank
    # float16 rounding of the averaged gradient only: the weights stay close to plain DDP's
    assert torch.allclose(compressed, dense, rtol=1e-3, atol=1e-4)
    assert not torch.equal(compressed, dense)
    # the hook's allreduce of float16 gradients is counted and is half of DDP's
    ratio = records[0]["bytes"] / dense_records[0]["bytes"]
    assert 0.45 < ratio < 0.6


def test_powersgd_hook_runs_and_sends_fewer_bytes(tmp_path):
    strategy = PowerSGDDDPStrategy(rank=1, start_powerSGD_iter=2, start_method="fork")
    weights, records = _fit(strategy, tmp_path, steps=8)
    for record in records:
        assert record["hook_calls"] >= 8
    dense_bytes = 2 * (1 / 2) * 4 * sum(p.numel() for p in _Tiny().parameters())
    assert records[0]["bytes"] / records[0]["steps"] < 0.5 * dense_bytes
    assert torch.isfinite(weights).all()


def test_names_are_registered_with_lightning():
    assert StrategyRegistry["ddp_fp16"]["strategy"] is HookedDDPStrategy
    assert StrategyRegistry["ddp_fp16"]["init_params"]["ddp_comm_hook"] is (
        default_hooks.fp16_compress_hook
    )
    assert StrategyRegistry["ddp_powersgd"]["strategy"] is PowerSGDDDPStrategy


def test_bad_arguments_name_the_fix():
    with pytest.raises(ValueError, match="strategy='ddp'"):
        HookedDDPStrategy()
    with pytest.raises(ValueError, match="rank must be a positive"):
        PowerSGDDDPStrategy(rank=0)
    with pytest.raises(ValueError, match="start_powerSGD_iter must be >= 2"):
        PowerSGDDDPStrategy(start_powerSGD_iter=1)
