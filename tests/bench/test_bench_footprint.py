"""The bytes of a rank's training state: parameters, gradients, optimizer state, each storage once."""

import torch
from torch import nn

from lightning_parallel.bench.footprint import TrainingFootprint, training_footprint


def _model():
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))


def _bytes(module):
    return sum(p.numel() * p.element_size() for p in module.parameters())


def _step(model, optimizer):
    model(torch.randn(8, 16)).square().mean().backward()
    optimizer.step()


def test_sgd_without_momentum_holds_params_and_grads_only():
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    assert training_footprint(model.parameters(), [optimizer]) == TrainingFootprint(
        _bytes(model), 0, 0
    )  # no gradient before the first backward
    _step(model, optimizer)
    footprint = training_footprint(model.parameters(), [optimizer])
    assert footprint == TrainingFootprint(_bytes(model), _bytes(model), 0)
    assert footprint.as_dict() == {
        "param_bytes": 4 * (16 * 32 + 32 + 32 * 4 + 4),
        "grad_bytes": 4 * (16 * 32 + 32 + 32 * 4 + 4),
        "optimizer_bytes": 0,
    }


def test_momentum_and_adam_state_are_counted():
    model = _model()
    momentum = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    _step(model, momentum)
    assert training_footprint(model.parameters(), [momentum]).optimizer_bytes == _bytes(model)
    adam = torch.optim.Adam(model.parameters(), lr=0.1)
    _step(model, adam)
    tensors = len(list(model.parameters()))
    # exp_avg and exp_avg_sq per parameter, and a float32 step counter each; both optimizers
    assert training_footprint(model.parameters(), [momentum, adam]).optimizer_bytes == (
        3 * _bytes(model) + 4 * tensors
    )


def test_shared_storage_counts_once_in_the_first_category():
    flat = torch.zeros(100)
    weight = nn.Parameter(flat[:60].view(6, 10))
    bias = nn.Parameter(flat[60:66])
    tied = [weight, bias, weight]  # a tied weight listed twice
    assert training_footprint(tied).param_bytes == 400  # the whole flat storage, once
    grads = torch.zeros(66)
    weight.grad, bias.grad = grads[:60].view(6, 10), grads[60:]  # views into one bucket
    footprint = training_footprint([weight, bias])
    assert (footprint.param_bytes, footprint.grad_bytes) == (400, 264)
    # an optimizer state tensor that is a parameter's own storage is not counted again
    optimizer = torch.optim.SGD([weight], lr=0.1)
    optimizer.state[weight]["alias"] = [
        weight.detach(),
        {"nested": torch.ones(3, dtype=torch.float64)},
    ]
    assert training_footprint([weight, bias], [optimizer]).optimizer_bytes == 24


def test_meta_tensors_hold_nothing():
    with torch.device("meta"):
        model = _model()
    assert training_footprint(model.parameters()) == TrainingFootprint(0, 0, 0)
