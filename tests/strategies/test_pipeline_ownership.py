"""Each pipeline rank holds only its stage: parameters, gradients, optimizer state.

Fork launcher, gloo, 2 or 4 processes. The fork launcher hands the trained model back to the
parent, so rank 0 gathers every stage at the very end of ``fit`` (after the callbacks' end
hooks): the callbacks here look at what each rank holds while it trains.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from helpers.distributed import run_distributed
from helpers.trainers import QUIET
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from lightning_parallel.bench.footprint import training_footprint
from lightning_parallel.comm.ledger import process_ledger
from lightning_parallel.pipeline.consolidate import gather_to_root
from lightning_parallel.strategies.gropipe import GroPipeStrategy
from lightning_parallel.strategies.spectrain import SpecTrainStrategy

SAMPLES, BATCH = 64, 16


def _data() -> TensorDataset:
    generator = torch.Generator().manual_seed(3)
    return TensorDataset(
        torch.randn(SAMPLES, 6, generator=generator),
        torch.randint(0, 3, (SAMPLES,), generator=generator),
    )


def _loader(shuffled: bool = False) -> DataLoader:
    data = _data()
    if shuffled:  # the order Lightning's injected sampler gives with one replica
        sampler = DistributedSampler(data, num_replicas=1, rank=0, shuffle=True, seed=0)
        return DataLoader(data, batch_size=BATCH, sampler=sampler)
    return DataLoader(data, batch_size=BATCH)


class Chain(pl.LightningModule):
    """Six linear layers of different widths (uneven stages), SGD with momentum."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        widths = [6, 32, 24, 40, 16, 20, 3]
        layers: list[nn.Module] = []
        for i in range(6):
            layers += [nn.Linear(widths[i], widths[i + 1]), nn.Tanh()]
        self.layers = nn.Sequential(*layers[:-1])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self(x), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


class Residual(Chain):
    """A ``forward`` with skip connections (traced by torch.fx, cut where only tensors cross)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = None  # type: ignore[assignment]
        self.stem = nn.Linear(6, 32)
        self.blocks = nn.ModuleList(nn.Linear(32, 32) for _ in range(4))
        self.head = nn.Linear(32, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.stem(x))
        for block in self.blocks:
            h = h + torch.tanh(block(h))
        return self.head(h)


class Holdings(pl.Callback):
    """Each rank writes the bytes it holds, and what its stage owns, at the end of training."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        strategy = trainer.strategy
        pipeline = strategy._pipeline  # type: ignore[attr-defined]
        own = sum(p.numel() * p.element_size() for p in pipeline.owned_parameters)
        record = {
            **training_footprint(pl_module.parameters(), trainer.optimizers).as_dict(),
            "own_parameter_bytes": own,
            "stage": strategy.stage_index,  # type: ignore[attr-defined]
            "optimizer_parameters": sum(
                p.numel() for g in trainer.optimizers[0].param_groups for p in g["params"]
            ),
        }
        path = self.directory / f"rank{trainer.global_rank}.json"
        path.write_text(json.dumps(record))


def _fit(strategy: Any, model: pl.LightningModule, devices: int, **kwargs: Any) -> pl.Trainer:
    options: dict[str, Any] = {"max_epochs": 1, "num_sanity_val_steps": 0, **QUIET, **kwargs}
    trainer = pl.Trainer(accelerator="cpu", devices=devices, strategy=strategy, **options)
    trainer.fit(model, _loader())
    return trainer


@pytest.mark.parametrize("stages", [2, 4])
@pytest.mark.parametrize("model_class", [Chain, Residual])
@pytest.mark.parametrize("strategy_class", [GroPipeStrategy, SpecTrainStrategy])
def test_each_rank_holds_only_its_stage(
    tmp_path: Path, strategy_class: type, model_class: type, stages: int
) -> None:
    model = model_class()
    whole = sum(p.numel() * p.element_size() for p in model.parameters())
    strategy = strategy_class(stages=stages, micro_batches=2, partition="even", start_method="fork")
    _fit(strategy, model, stages, callbacks=[Holdings(tmp_path)])
    records = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(stages)]
    assert sorted(r["stage"] for r in records) == list(range(stages))
    assert sum(r["own_parameter_bytes"] for r in records) == whole  # the stages cover the model
    for record in records:
        own = record["own_parameter_bytes"]
        assert 0 < own < whole
        # parameters, their gradients and SGD's momentum: the stage's share, nothing more
        assert record["param_bytes"] == own
        assert record["grad_bytes"] <= own
        assert record["optimizer_bytes"] == own
        assert record["optimizer_parameters"] * 4 == own  # the optimizer holds the stage only


class TwoGroups(Chain):
    """Two parameter groups with their own learning rates, and a step scheduler."""

    def configure_optimizers(self) -> Any:
        first = list(self.layers[:5].parameters())
        rest = list(self.layers[5:].parameters())
        optimizer = torch.optim.SGD(
            [{"params": first, "lr": 0.05}, {"params": rest}], lr=0.2, momentum=0.9
        )
        return [optimizer], [torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)]


def test_the_rebuilt_optimizer_keeps_groups_and_schedules_and_trains_alike() -> None:
    """The stage's optimizer keeps both groups (one empty on a stage), their learning rates
    and the scheduler: the weights equal those of single-device training."""
    reference = TwoGroups()
    pl.Trainer(accelerator="cpu", devices=1, max_epochs=3, **QUIET).fit(
        reference, _loader(shuffled=True)
    )
    model = TwoGroups()
    strategy = GroPipeStrategy(stages=2, micro_batches=2, partition=[5], start_method="fork")
    pl.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_epochs=3, **QUIET).fit(
        model, _loader()
    )
    for (name, left), right in zip(reference.state_dict().items(), model.state_dict().values()):
        torch.testing.assert_close(left, right, rtol=1e-5, atol=1e-6, msg=f"{name} differs")


class Seeded(nn.Linear):
    """A linear layer whose initialization depends on its shape only (the same on every rank
    and device, whichever rank materializes it)."""

    def reset_parameters(self) -> None:
        generator = torch.Generator().manual_seed(self.in_features * 100 + self.out_features)
        with torch.no_grad():
            self.weight.copy_(torch.randn(self.weight.shape, generator=generator) * 0.3)
            self.bias.copy_(torch.randn(self.bias.shape, generator=generator) * 0.1)


class Deferred(Chain):
    """Built in ``configure_model``: under a pipeline strategy, on the meta device."""

    def __init__(self) -> None:
        pl.LightningModule.__init__(self)
        self.layers = None  # type: ignore[assignment]

    def configure_model(self) -> None:
        if self.layers is not None:
            return
        widths = [6, 32, 24, 40, 16, 3]
        layers: list[nn.Module] = []
        for i in range(5):
            layers += [Seeded(widths[i], widths[i + 1]), nn.Tanh()]
        self.layers = nn.Sequential(*layers[:-1])


class Materialized(pl.Callback):
    """Each rank records which of its parameters are real while it trains."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        real = [n for n, p in pl_module.named_parameters() if not p.is_meta]
        gauges = process_ledger().gauges
        record = {"real": real, "boundary": gauges.get("partition_boundary_0")}
        (self.directory / f"rank{trainer.global_rank}.json").write_text(json.dumps(record))


def test_a_model_built_on_meta_materializes_one_stage_per_rank(tmp_path: Path) -> None:
    """``configure_model`` under the pipeline builds on ``meta``; the automatic partition works
    from shapes; each rank materializes only its stage, and training equals single-device
    training of the same (deterministically initialized) model."""
    reference = Deferred()
    reference.configure_model()
    reference.layers.apply(lambda m: m.reset_parameters() if isinstance(m, Seeded) else None)
    pl.Trainer(accelerator="cpu", devices=1, max_epochs=2, **QUIET).fit(
        reference, _loader(shuffled=True)
    )
    model = Deferred()
    strategy = GroPipeStrategy(stages=2, micro_batches=2, start_method="fork")
    _fit(strategy, model, 2, max_epochs=2, callbacks=[Materialized(tmp_path)])
    records = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    boundary = int(records[0]["boundary"])
    assert records[1]["boundary"] == boundary and 0 < boundary < 9
    names = list(reference.state_dict())
    owned = [set(r["real"]) for r in records]
    assert owned[0].isdisjoint(owned[1]) and owned[0] | owned[1] == set(names)
    for (name, left), right in zip(reference.state_dict().items(), model.state_dict().values()):
        torch.testing.assert_close(left, right, rtol=1e-5, atol=1e-6, msg=f"{name} differs")


def test_stages_reach_the_root_one_at_a_time_memory_mapped(tmp_path: Path) -> None:
    """Ranks 1 and 2 own stages 0 and 1, the root (rank 0) stage 2: the root receives each
    stage into a file it maps, not into its memory."""

    def fn(rank: int, world: int) -> Any:
        pieces = {"state_dict": {f"w{rank}": torch.full((1000,), float(rank))}, "step": rank}
        spill = tmp_path / "spill" if rank == 0 else None
        gathered = gather_to_root(pieces, owners=[1, 2, 0], root=0, spill=spill)
        if gathered is None:
            return None
        mapped = []  # address ranges of the files this process maps from the spill folder
        for line in Path("/proc/self/maps").read_text().splitlines():
            if str(tmp_path / "spill") in line:
                low, high = (int(x, 16) for x in line.split()[0].split("-"))
                mapped.append((low, high))

        def in_file(tensor: torch.Tensor) -> bool:
            return any(low <= tensor.data_ptr() < high for low, high in mapped)

        return [
            (
                part["step"],
                float(next(iter(part["state_dict"].values()))[0]),
                in_file(next(iter(part["state_dict"].values()))),
            )
            for part in gathered
        ]

    results = run_distributed(fn, 3)
    assert results[1] is None and results[2] is None
    assert results[0] == [(1, 1.0, True), (2, 2.0, True), (0, 0.0, False)]
