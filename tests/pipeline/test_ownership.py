"""Stage ownership, optimizer rebuilding and the whole-model checkpoint layout (one process)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_parallel.bench.footprint import training_footprint
from lightning_parallel.pipeline.checkpoint_layout import (
    load_whole_model_layout,
    whole_model_layout,
)
from lightning_parallel.pipeline.ownership import (
    TensorNames,
    TiedAcrossStagesError,
    restrict_optimizer,
    take_ownership,
)
from lightning_parallel.pipeline.profile import estimate_layers
from lightning_parallel.pipeline.stages import split_stages


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 8), nn.Linear(8, 2))


def _step(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    model(torch.randn(5, 4)).sum().backward()
    optimizer.step()


def test_a_rank_keeps_its_stage_and_releases_the_rest() -> None:
    model = _model()
    stages = split_stages(list(model), [2])
    before = {n: t.clone() for n, t in model.state_dict().items()}
    ownership = take_ownership(model, stages, 1, torch.device("cpu"))
    assert ownership.names == ["2.weight", "2.bias", "3.weight", "3.bias"]
    assert ownership.released_bytes == 4 * (8 * 4 + 8 + 8 + 8 + 8 + 8) + 8  # with the counter
    assert not ownership.replaced and not ownership.materialized
    real = {n for n, t in model.state_dict().items() if not t.is_meta}
    assert real == set(ownership.names)
    for name in real:  # kept as they were
        assert torch.equal(model.state_dict()[name], before[name])
    assert training_footprint(model.parameters()).param_bytes == 4 * (64 + 8 + 16 + 2)


def test_a_meta_stage_is_materialized_by_reset_parameters() -> None:
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2))
    stages = split_stages(list(model), [1])
    ownership = take_ownership(model, stages, 0, torch.device("cpu"))
    assert ownership.materialized and len(ownership.replaced) == 2
    weight = model[0].weight
    assert not weight.is_meta and weight.abs().sum() > 0 and model[1].weight.is_meta


def test_a_meta_tensor_without_reset_parameters_is_refused() -> None:
    class Bare(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.scale = nn.Parameter(torch.ones(3))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * self.scale

    with torch.device("meta"):
        model = nn.Sequential(Bare(), nn.Linear(3, 2))
    with pytest.raises(ValueError, match="Bare"):
        take_ownership(model, split_stages(list(model), [1]), 0, torch.device("cpu"))


def test_tied_weights_across_stages_are_refused_naming_the_fix() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    model[1].weight = model[0].weight
    with pytest.raises(TiedAcrossStagesError, match="tied weights"):
        take_ownership(model, split_stages(list(model), [1]), 0, torch.device("cpu"))


def test_the_restricted_optimizer_keeps_groups_state_and_steps_alike() -> None:
    model, twin = _model(), _model()
    groups = [
        {"params": list(model[0].parameters()), "lr": 0.01},
        {"params": list(model[2].parameters()) + list(model[3].parameters())},
    ]
    optimizer = torch.optim.SGD(groups, lr=0.1, momentum=0.9)
    twin_optimizer = torch.optim.SGD(
        [
            {"params": list(twin[0].parameters()), "lr": 0.01},
            {"params": list(twin[2].parameters()) + list(twin[3].parameters())},
        ],
        lr=0.1,
        momentum=0.9,
    )
    _step(model, optimizer)
    _step(twin, twin_optimizer)
    keep = {id(p): p for p in model[3].parameters()}
    restricted = restrict_optimizer(optimizer, keep)
    assert [len(g["params"]) for g in restricted.param_groups] == [0, 2]
    assert [g["lr"] for g in restricted.param_groups] == [0.01, 0.1]
    for parameter in model[3].parameters():  # the momentum came along
        assert (
            restricted.state[parameter]["momentum_buffer"]
            is optimizer.state[parameter]["momentum_buffer"]
        )
    for module, other in ((model, restricted), (twin, twin_optimizer)):
        other.zero_grad()
        module(torch.ones(5, 4)).sum().backward()
        other.step()
    torch.testing.assert_close(model[3].weight, twin[3].weight)


def test_the_whole_model_layout_round_trips_through_a_stage() -> None:
    model = _model()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    _step(model, optimizer)
    group_names = [[n for n, _ in model.named_parameters()]]
    whole = optimizer.state_dict()
    owned = list(model[2].parameters())
    stage = restrict_optimizer(optimizer, {id(p): p for p in owned})
    name_of = TensorNames.of(model).name_of()
    layout = whole_model_layout(stage, group_names, name_of)
    assert sorted(layout["state"]) == [4, 5]  # the indices of 2.weight and 2.bias overall
    assert layout["param_groups"][0]["params"] == list(range(8))
    fresh = torch.optim.Adam(owned, lr=0.5)
    load_whole_model_layout(fresh, whole, group_names, name_of)
    assert fresh.param_groups[0]["lr"] == 0.01
    for index, parameter in zip((4, 5), owned):
        torch.testing.assert_close(
            fresh.state[parameter]["exp_avg"], whole["state"][index]["exp_avg"]
        )


def test_costs_are_estimated_from_shapes_on_meta() -> None:
    with torch.device("meta"):
        layers = [nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 10)]
    profile = estimate_layers(layers, (torch.randn(8, 64),))
    first, relu, last = profile.layers
    # 2·8·64·256 operations against 2·8·256·10: the wide layer costs more; ReLU only moves bytes
    assert first.forward_seconds > last.forward_seconds > relu.forward_seconds > 0
    assert first.backward_seconds == pytest.approx(2 * first.forward_seconds)
    assert first.parameter_bytes == 4 * (64 * 256 + 256) and relu.parameter_bytes == 0
    assert first.activation_bytes == 8 * 64 * 4  # the input, not the weight
    assert first.output_bytes == 8 * 256 * 4


def test_real_layers_are_estimated_as_their_meta_twins_without_touching_them() -> None:
    """``partition="estimate"``: layers with real weights cost what the same shapes cost on
    meta (so every run partitions alike), and their weights are neither moved nor changed."""
    torch.manual_seed(0)
    real = [nn.Linear(64, 256), nn.BatchNorm1d(256), nn.ReLU(), nn.Linear(256, 10)]
    before = [t.clone() for layer in real for t in layer.state_dict().values()]
    with torch.device("meta"):
        meta = [nn.Linear(64, 256), nn.BatchNorm1d(256), nn.ReLU(), nn.Linear(256, 10)]
    example = (torch.randn(8, 64),)
    assert estimate_layers(real, example) == estimate_layers(meta, example)
    after = [t for layer in real for t in layer.state_dict().values()]
    assert all(a.device.type == "cpu" and torch.equal(a, b) for a, b in zip(after, before))
    assert all(p.grad is None for layer in real for p in layer.parameters())
