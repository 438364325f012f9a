"""Every strategy name this package registers resolves through ``Trainer(strategy=name)``."""

import pytest
from pytorch_lightning import Trainer
from pytorch_lightning.strategies import StrategyRegistry

import lightning_parallel

# the names the docs promise; each strategy module adds its own when it lands
_EXPECTED_NAMES = {
    "ddp_fp16",
    "ddp_powersgd",
    "model_averaging",
    "local_sgd",
    "bmuf",
    "easgd",
    "diloco",
    "gropipe",
    "spectrain",
    "hylo",
    "parameter_server",
    "async_ps",
}


def test_expected_names_are_registered():
    assert set(lightning_parallel.registered_names()) >= _EXPECTED_NAMES


@pytest.mark.parametrize("name", sorted(lightning_parallel.registered_names()))
def test_name_resolves_in_trainer(name):
    trainer = Trainer(accelerator="cpu", devices=2, strategy=name, logger=False)
    assert isinstance(trainer.strategy, StrategyRegistry[name]["strategy"])
