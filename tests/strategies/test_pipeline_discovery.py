"""Which module a pipeline splits (pipeline/discovery.py): ``self.net(x)`` in a step of a
``LightningModule`` without ``forward`` trains under GroPipe as on one device and under SpecTrain,
``module="net"`` names it, and a step that calls something else (or first a small part of the
network) is refused before any stage is built, naming the candidates and the argument."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from pytorch_lightning.callbacks import ModelCheckpoint
from test_gropipe import RankReport, assert_same_weights, loader, trainer
from torch import nn

from lightning_parallel.pipeline.discovery import (
    discover,
    named_target,
    split_point_boundaries,
    static_target,
)
from lightning_parallel.pipeline.stages import PipelineSplitError, layer_sequence
from lightning_parallel.strategies.gropipe import GroPipeStrategy
from lightning_parallel.strategies.spectrain import SpecTrainStrategy


class Network(nn.Module):
    """A user's network: its own ``forward`` (not a Sequential), a residual branch."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Linear(6, 12)
        self.block = nn.Linear(12, 12)
        self.head = nn.Linear(12, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.stem(x))
        h = h + torch.tanh(self.block(h))
        return self.head(h)


class NoForward(pl.LightningModule):
    """The common shape of a real module: no ``forward``; ``training_step`` calls ``self.net``."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = Network()
        self.criterion = nn.CrossEntropyLoss()  # a child without parameters: not a candidate

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = self.criterion(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_acc", (self.net(x).argmax(-1) == y).float().mean())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


class TwoNetworks(NoForward):
    """The step calls a small ``encoder``, then a larger ``decoder``."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Linear(6, 4)
        self.decoder = nn.Sequential(nn.Linear(4, 12), nn.Tanh(), nn.Linear(12, 3))
        del self.net

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self.decoder(self.encoder(x)), y)


class Wrapped(NoForward):
    """The network one level down, as ``self.model.backbone``: named with ``module=``."""

    def __init__(self) -> None:
        super().__init__()
        self.model = nn.ModuleDict({"backbone": self.net})
        del self.net

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self.model["backbone"](x), y)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_acc", (self.model["backbone"](x).argmax(-1) == y).float().mean())


BATCH = (torch.randn(4, 6), torch.randint(0, 3, (4,)))


def test_the_step_finds_the_child_it_calls_or_the_module_itself() -> None:
    module = NoForward()
    found = discover(module, "training_step", BATCH, (0,))
    assert (found.name, found.module, found.how) == ("net", module.net, "step")
    assert static_target(module, None) is None  # no `layers`: the step has to decide

    class CallsSelf(NoForward):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.net(x)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            return self(batch[0]).sum()

    calls_self = CallsSelf()
    assert discover(calls_self, "training_step", BATCH, (0,)).module is calls_self
    # the step ran with every forward stopped and log silenced: nothing was left patched
    assert "forward" not in vars(calls_self) and "forward" not in vars(calls_self.net)
    assert "log" not in vars(calls_self)


def test_a_step_that_leaves_parameters_out_or_calls_nothing_is_refused_with_the_way_out() -> None:
    with pytest.raises(PipelineSplitError, match=r"self\.encoder first.*28.*99.*decoder\.0\.w"):
        discover(TwoNetworks(), "training_step", BATCH, (0,))

    class CallsNothing(NoForward):
        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            return batch[0].sum()

    with pytest.raises(PipelineSplitError, match=r"\['net'\].*module='<child name>'"):
        discover(CallsNothing(), "training_step", BATCH, (0,))


def test_module_names_a_submodule_and_a_wrong_name_lists_the_children() -> None:
    module = Wrapped()
    target = named_target(module, "model.backbone")
    assert target.module is module.model["backbone"] and target.how == "argument"
    with pytest.raises(PipelineSplitError, match=r"module='backbone'.*\['model'\]"):
        named_target(module, "backbone")


def _fit(model: pl.LightningModule, strategy: Any, devices: int, **options: Any) -> pl.Trainer:
    run = trainer(strategy, devices, limit_val_batches=2, **options)
    run.fit(model, loader(shuffled=devices == 1), loader())
    return run


def _gropipe() -> GroPipeStrategy:
    return GroPipeStrategy(stages=2, micro_batches=4, partition="even", start_method="fork")


def test_gropipe_splits_the_child_the_step_calls_as_one_device_trains_it(tmp_path: Path) -> None:
    reference = NoForward()
    _fit(reference, "auto", 1)
    model = NoForward()
    saver = ModelCheckpoint(dirpath=tmp_path, save_last=True)
    run = _fit(model, _gropipe(), 2, callbacks=[saver], enable_checkpointing=True)
    assert_same_weights(reference, model)
    assert "val_acc" in run.callback_metrics
    # one consolidated file, keyed as the plain module is: it loads strictly on one device
    plain = NoForward()
    plain.load_state_dict(torch.load(tmp_path / "last.ckpt")["state_dict"], strict=True)
    assert_same_weights(plain, model, tolerance=0)


def test_a_single_device_checkpoint_resumes_under_gropipe_as_on_one_device(tmp_path: Path) -> None:
    saver = ModelCheckpoint(dirpath=tmp_path, save_last=True)
    _fit(NoForward(), "auto", 1, max_epochs=1, callbacks=[saver], enable_checkpointing=True)
    on_one_device, piped = NoForward(), NoForward()
    trainer("auto", 1).fit(on_one_device, loader(shuffled=True), ckpt_path=tmp_path / "last.ckpt")
    trainer(_gropipe(), 2).fit(piped, loader(), ckpt_path=tmp_path / "last.ckpt")
    assert_same_weights(on_one_device, piped)


def test_spectrain_and_module_argument_split_a_nested_network() -> None:
    model = Wrapped()
    before = {key: value.clone() for key, value in model.state_dict().items()}
    strategy = SpecTrainStrategy(
        stages=2, micro_batches=2, module="model.backbone", start_method="fork"
    )
    assert strategy.split_module == "model.backbone"
    _fit(model, strategy, 2)
    after = model.state_dict()
    assert after.keys() == before.keys()
    assert all(not torch.equal(after[key], before[key]) for key in before)  # every layer trained


@pytest.mark.parametrize("strategy", [GroPipeStrategy, SpecTrainStrategy])
def test_a_step_that_calls_two_networks_fails_before_any_stage_is_built(strategy: Any) -> None:
    # every rank stops at its first step (the fork launcher raises one rank's error here)
    with pytest.raises(Exception, match=r"PipelineSplitError: .* would all run on the last stage"):
        _fit(TwoNetworks(), strategy(stages=2, micro_batches=2, start_method="fork"), 2)


def test_a_keyword_call_with_tied_weights_trains_under_gropipe_as_one_device_does(
    tmp_path: Path,
) -> None:
    """Plain torch, no transformers: keyword arguments and a dict output take the export path;
    the embedding tied to the head lives on stages 0 and 3, its gradients summed."""
    from helpers.models import TiedKeywordLM, token_loader
    from torch.utils.data import DataLoader, DistributedSampler

    def fit(strategy: Any, devices: int, **options: Any) -> TiedKeywordLM:
        torch.manual_seed(0)
        module = TiedKeywordLM()
        module.model.dropout.p = 0.0  # random masks would differ between the runs
        data = token_loader().dataset
        sampler = DistributedSampler(data, num_replicas=1, rank=0, shuffle=True, seed=0)
        batches = DataLoader(data, batch_size=8, sampler=sampler if devices == 1 else None)
        trainer(strategy, devices, max_epochs=1, **options).fit(module, batches)
        return module

    reference = fit("auto", 1)
    saver = ModelCheckpoint(dirpath=tmp_path, save_last=True)
    strategy = GroPipeStrategy(stages=4, micro_batches=2, partition="even", start_method="fork")
    piped = fit(strategy, 4, callbacks=[saver], enable_checkpointing=True)
    assert_same_weights(reference, piped)
    saved = torch.load(tmp_path / "last.ckpt")["state_dict"]
    TiedKeywordLM().load_state_dict(saved, strict=True)
    assert torch.equal(saved["model.head.weight"], saved["model.embedding.weight"])


def test_split_points_start_a_stage_at_the_named_modules_first_layer() -> None:
    network = Network()
    layers = layer_sequence(network, (torch.randn(4, 6),))
    ran = [[n.target for n in layer.graph.nodes if n.op == "call_module"] for layer in layers]
    assert split_point_boundaries(layers, network, ["block"]) == [ran.index(["block"])]
    assert split_point_boundaries(layers, network, ["block", "head"]) == [
        ran.index(["block"]),
        ran.index(["head"]),
    ]
    sequence = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Sequential(nn.Linear(8, 3)))
    assert split_point_boundaries(list(sequence), sequence, ["2"]) == [2]
    assert split_point_boundaries(list(sequence), sequence, ["2.0"]) == [2]
    with pytest.raises(PipelineSplitError, match=r"'stem' runs in the first layer"):
        split_point_boundaries(layers, network, ["stem"])
    with pytest.raises(
        PipelineSplitError, match=r"'blocks' is not run.*\['stem', 'block', 'head'\]"
    ):
        split_point_boundaries(layers, network, ["blocks"])


def test_split_points_are_checked_when_the_strategy_is_built() -> None:
    with pytest.raises(ValueError, match=r"needs 1 module names, got \['a', 'b'\]"):
        GroPipeStrategy(stages=2, split_points=["a", "b"])
    with pytest.raises(ValueError, match="not both"):
        SpecTrainStrategy(stages=2, partition="even", split_points=["head"])


def test_gropipe_cuts_at_the_split_point_and_still_trains_as_one_device(tmp_path: Path) -> None:
    reference = NoForward()
    _fit(reference, "auto", 1)
    model = NoForward()
    strategy = GroPipeStrategy(
        stages=2, micro_batches=4, split_points=["head"], start_method="fork"
    )
    _fit(model, strategy, 2, callbacks=[RankReport(tmp_path)])
    assert_same_weights(reference, model)
    layers = layer_sequence(model.net, (torch.randn(4, 6),))
    expected = split_point_boundaries(layers, model.net, ["head"])[0]
    for rank in range(2):
        gauges = json.loads((tmp_path / f"rank{rank}.json").read_text())["gauges"]
        assert gauges["partition_boundary_0"] == expected
