"""A second Lightning run in the same rank processes (``trainer.validate`` after ``fit``, as the
bench and a user's script do) after device moves. On CUDA, Lightning's teardown moves the module
to the CPU and the next run's setup moves it back: every move makes new tensors (buffers, and the
parameters the pipeline moves itself). On the CPU a move to the same device keeps them, so these
tests renew them where a CUDA run would. Both failed on a GPU before the fix (a stale BatchNorm
layer of the first run: ``KeyError`` in ``take_ownership``; a torchmetrics metric left behind on
the CPU)."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
import torchmetrics
from helpers.distributed import run_distributed
from helpers.models import image_loader
from helpers.pipelines import fit_then_validate
from helpers.spies import recording
from torch import nn

from lightning_parallel.pipeline import device_moves
from lightning_parallel.strategies import pipeline_base

pytestmark = pytest.mark.slow


def _renew_tensors(model: nn.Module, device: torch.device | None = None) -> None:
    """What a move between devices does: every real parameter and buffer a new tensor."""
    with torch.no_grad():
        for module in model.modules():
            for slots in (module._parameters, module._buffers):
                for name, tensor in list(slots.items()):
                    if tensor is None or tensor.is_meta:
                        continue
                    renewed = tensor.clone()
                    if isinstance(tensor, nn.Parameter):
                        renewed = nn.Parameter(renewed, requires_grad=tensor.requires_grad)
                    slots[name] = renewed  # type: ignore[assignment]


def _fit_then_validate(rank: int, world: int, name: str, traced: bool) -> dict[str, Any]:
    metric_moves: list[int] = []  # per pipeline move: how many metrics moved with it
    move_real = device_moves.move_real
    with recording(torchmetrics.Metric, "_apply") as applied:

        def moving(model: nn.Module, device: torch.device) -> nn.Module:  # as CUDA's moves do
            before = len(applied)
            move_real(model, device)
            metric_moves.append(len(applied) - before)
            _renew_tensors(model)
            return model

        pipeline_base.move_real = moving  # where the strategy looks it up
        validated = fit_then_validate(rank, world, name, "cpu", traced)
    return {"validated": validated, "metric_moves": metric_moves}


@pytest.mark.parametrize("traced", [False, True], ids=["sequential", "traced"])
@pytest.mark.parametrize("name", ["gropipe", "spectrain"])
def test_validate_after_fit_in_the_same_processes(name: str, traced: bool) -> None:
    results = run_distributed(_fit_then_validate, 2, name, traced, init_group=False, timeout=120)
    last = [r["validated"][0] for r in results if r["validated"] and r["validated"][0]]
    assert last, "no rank reported validation metrics"
    for metrics in last:
        assert math.isfinite(metrics["val_loss"]) and 0.0 <= metrics["val_acc"] <= 1.0
    # a rank that holds one stage moves it itself: fit's teardown, validate's setup and
    # teardown moved the metric too; rank 0 holds the whole model after fit (every stage
    # gathered), so fit's teardown and validate's setup are Lightning's own Module.to, and
    # only validate's teardown (it holds one stage again) is the pipeline's move
    for rank, result in enumerate(results):
        assert len(result["metric_moves"]) >= (1 if rank == 0 else 3)
        assert all(count >= 1 for count in result["metric_moves"])


def _validate_own_parameter(rank: int, world: int, name: str) -> tuple[float | None, float]:
    from helpers.models import PositionEmbeddedNet

    expected: list[float] = []

    def whole_model_loss(model: nn.Module) -> None:  # rank 0 holds every stage after fit
        if rank == 0:
            x, y = next(iter(image_loader(64, 64)))
            with torch.no_grad():
                model.eval()
                expected.append(float(torch.nn.functional.cross_entropy(model(x), y)))

    validated = fit_then_validate(rank, world, name, "cpu", net=PositionEmbeddedNet,
                                  between=whole_model_loss)  # fmt: skip
    return (expected[0] if expected else None), validated[0]["val_loss"]


@pytest.mark.parametrize("name", ["gropipe", "spectrain"])
def test_validate_after_fit_with_a_parameter_on_the_split_module(name: str) -> None:
    """A traced segment holds such a parameter (a ViT's position embedding) in a slot of its
    own; rank 0's end-of-fit gather gives the model new tensors (``assign=True``), and the
    next run's stages must take them, not the first run's (``KeyError`` in
    ``take_ownership`` before the fix: timm's ViT under the bench)."""
    (expected, first), (_, second) = run_distributed(
        _validate_own_parameter, 2, name, init_group=False, timeout=120
    )
    assert expected is not None
    # validation runs the trained weights: the whole model's loss on the same 64 samples
    assert [first, second] == pytest.approx([expected, expected], rel=1e-4)


def test_move_real_moves_real_metrics_and_leaves_meta_ones() -> None:
    """A metric built on meta (in ``configure_model``) cannot move; one with real states must."""
    with torch.device("meta"):
        on_meta = torchmetrics.classification.MulticlassAccuracy(num_classes=3)
    real = torchmetrics.classification.MulticlassAccuracy(num_classes=3)
    model = nn.ModuleDict({"on_meta": on_meta, "real": real, "layer": nn.Linear(2, 2)})
    with recording(torchmetrics.Metric, "_apply") as moved:
        device_moves.move_real(model, torch.device("cpu"))
    assert [call[0] for call in moved] == [real]
    assert on_meta.tp.is_meta
