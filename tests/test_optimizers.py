"""Rebuilding a user's optimizer over other parameters (pipeline stages, server shards)."""

import pytest
import torch

from lightning_parallel.optimizers import rebuild_optimizer


@pytest.mark.parametrize(
    "make",
    [
        lambda p: torch.optim.AdamW(p, lr=0.01, weight_decay=0.1),  # keeps a default it refuses
        lambda p: torch.optim.Adam(p, lr=0.01, amsgrad=True),
        lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, nesterov=True),
    ],
    ids=["adamw", "adam", "sgd"],
)
def test_every_torch_optimizer_rebuilds_with_its_settings(make):
    template = make([torch.nn.Parameter(torch.zeros(2))])
    fresh = torch.nn.Parameter(torch.zeros(3))
    settings = {k: v for k, v in template.param_groups[0].items() if k != "params"}
    rebuilt = rebuild_optimizer(template, [{**settings, "params": [fresh]}])
    assert type(rebuilt) is type(template)
    assert {k: v for k, v in rebuilt.param_groups[0].items() if k != "params"} == settings


def test_an_optimizer_that_cannot_be_rebuilt_names_the_fix():
    class Positional(torch.optim.SGD):
        def __init__(self, lr, params):  # settings first: not the torch.optim convention
            super().__init__(params, lr=lr)

    template = Positional(0.1, [torch.nn.Parameter(torch.zeros(2))])
    with pytest.raises(TypeError, match="parameter groups first"):
        rebuild_optimizer(template, [{"params": [torch.nn.Parameter(torch.zeros(1))]}])
