import pytest
from pytorch_lightning.strategies import DDPStrategy

from lightning_parallel.bench.specs import (
    available,
    build_strategy,
    parse_spec,
    parse_value,
    register_baseline,
)
from lightning_parallel.strategies.ddp_hooks import HookedDDPStrategy, PowerSGDDDPStrategy


def test_name_only():
    spec = parse_spec("ddp")
    assert (spec.name, spec.options, spec.text) == ("ddp", {}, "ddp")


def test_options_are_typed():
    spec = parse_spec("model_averaging:period=8,lr=0.5,nesterov=true,mode=tree,x=none")
    assert spec.name == "model_averaging"
    assert spec.options == {"period": 8, "lr": 0.5, "nesterov": True, "mode": "tree", "x": None}
    assert type(spec.options["period"]) is int


@pytest.mark.parametrize(
    ("text", "value"), [("3", 3), ("1e-3", 1e-3), ("False", False), ("a", "a")]
)
def test_parse_value(text, value):
    assert parse_value(text) == value


@pytest.mark.parametrize(
    ("text", "message"),
    [(":rank=2", "no strategy name"), ("ddp:rank", "key=value"), ("ddp:a=1,a=2", "twice")],
)
def test_bad_specs_say_how_to_write_them(text, message):
    with pytest.raises(ValueError, match=message):
        parse_spec(text)


def test_registered_names_build_with_merged_options():
    assert type(build_strategy("ddp")) is DDPStrategy
    fp16 = build_strategy("ddp_fp16")
    assert isinstance(fp16, HookedDDPStrategy) and fp16.compression_ratio == 2.0
    powersgd = build_strategy("ddp_powersgd:rank=3,start_powerSGD_iter=5")
    assert isinstance(powersgd, PowerSGDDDPStrategy)
    assert (powersgd.matrix_approximation_rank, powersgd.start_powerSGD_iter) == (3, 5)


def test_unknown_name_lists_the_known_ones():
    with pytest.raises(ValueError, match=r"choose one of: .*ddp_fp16"):
        build_strategy("no_such_strategy")


def test_unknown_option_lists_the_accepted_ones():
    with pytest.raises(
        ValueError, match=r"has no option 'extra'; it accepts .*start_powerSGD_iter"
    ):
        build_strategy("ddp_powersgd:rank=2,extra=1,ddp_comm_hook=1")


def test_baselines_take_precedence_and_get_their_options():
    calls = []

    def factory(width: int = 1) -> DDPStrategy:
        calls.append(width)
        return DDPStrategy()

    register_baseline("my_peer", factory, "a test peer")
    assert isinstance(build_strategy("my_peer:width=4"), DDPStrategy)
    assert calls == [4]
    assert available()["my_peer"] == "a test peer"
    with pytest.raises(ValueError, match="lowercase"):
        register_baseline("MyPeer", factory)
