"""A stage that starts with an in-place operation (torchvision's ``ReLU(inplace=True)`` where a
cut lands before it) trains as the same model with the out-of-place operation does, under both
pipelines, and as one device does under GroPipe (pipeline/stage_entry.py)."""

from __future__ import annotations

from typing import Any

import pytest
import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from test_gropipe import assert_same_weights, loader, trainer
from torch import nn

from lightning_parallel.pipeline.stage_entry import stage_inputs
from lightning_parallel.strategies.gropipe import GroPipeStrategy
from lightning_parallel.strategies.spectrain import SpecTrainStrategy


class Net(pl.LightningModule):
    """``Linear | ReLU, Linear, ReLU, Linear``: with ``partition=[1]`` stage 1 starts with the
    ReLU, in place on the received activation when ``inplace``."""

    def __init__(self, inplace: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.Sequential(
            nn.Linear(6, 12),
            nn.ReLU(inplace=inplace),
            nn.Linear(12, 12),
            nn.ReLU(inplace=inplace),
            nn.Linear(12, 3),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


def _fit(model: Net, strategy: Any, devices: int) -> dict[str, torch.Tensor]:
    trainer(strategy, devices, limit_val_batches=0).fit(model, loader(shuffled=devices == 1))
    return {key: value.clone() for key, value in model.state_dict().items()}


def test_an_in_place_operation_on_a_received_activation_needs_no_copy() -> None:
    received = torch.randn(4, 3).requires_grad_(True)
    entered = stage_inputs(received)
    assert not entered.is_leaf and entered.data_ptr() == received.data_ptr()
    out = nn.functional.relu(entered, inplace=True).pow(2).sum()
    out.backward()
    reference = received.detach().clone().requires_grad_(True)
    reference.relu().pow(2).sum().backward()  # received now holds relu(x): same where x > 0
    torch.testing.assert_close(received.grad, reference.grad)
    kept = torch.randn(4, 3).requires_grad_(True)
    before = kept.detach().clone()
    with torch.no_grad():  # a forward that is recomputed later must leave its input as it came
        nn.functional.relu(stage_inputs(kept), inplace=True)
    assert torch.equal(kept.detach(), before)
    assert stage_inputs((kept, 3))[1] == 3


@pytest.mark.parametrize(
    ("schedule", "recompute"), [("1f1b", "never"), ("gpipe", "always")], ids=["1f1b", "recompute"]
)
def test_gropipe_trains_a_stage_that_starts_in_place_as_one_device_does(
    schedule: str, recompute: str
) -> None:
    reference = Net(inplace=False)
    _fit(reference, "auto", 1)
    strategy = GroPipeStrategy(
        stages=2,
        micro_batches=4,
        partition=[1],
        schedule=schedule,
        recompute=recompute,
        start_method="fork",
    )
    model = Net(inplace=True)
    _fit(model, strategy, 2)
    assert_same_weights(reference, model)


def test_spectrain_trains_a_stage_that_starts_in_place_as_out_of_place() -> None:
    def strategy() -> SpecTrainStrategy:
        return SpecTrainStrategy(stages=2, micro_batches=2, partition=[1], start_method="fork")

    out_of_place = _fit(Net(inplace=False), strategy(), 2)
    in_place = _fit(Net(inplace=True), strategy(), 2)
    for key, value in out_of_place.items():
        assert torch.equal(in_place[key], value), key
