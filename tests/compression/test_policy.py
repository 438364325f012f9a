"""HyloPolicy: codec by layer type and size; the cost model's decision rule."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_parallel.compression import (
    QSGD,
    CostModel,
    HyloPolicy,
    KernelTopK,
    LowRank,
    NoCompression,
    TopK,
    TwoBitQuantizer,
)


def _model() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 8, 3),  # 216: small conv
        nn.Conv2d(8, 64, 3),  # 4608: large conv
        nn.BatchNorm2d(64),
        nn.Flatten(),
        nn.Linear(64, 128),  # 8192: large linear
        nn.Linear(128, 10),  # 1280: small linear
    )


def test_hylo_policy_by_layer_type_and_size() -> None:
    plans = HyloPolicy(min_compress_numel=4096, rank=2).plan(_model().named_parameters())
    routes = {name: plan.route for name, plan in plans.items()}
    assert routes == {
        "0.weight": "dense",
        "0.bias": "dense",
        "1.weight": "kernel",
        "1.bias": "dense",
        "2.weight": "dense",  # norms
        "2.bias": "dense",
        "4.weight": "low_rank",  # rank-2 factors: 1,536 bytes; 2-bit codes: 2,112
        "4.bias": "dense",
        "5.weight": "dense",
        "5.bias": "dense",
    }
    assert isinstance(plans["1.weight"].codec, KernelTopK)
    assert isinstance(plans["4.weight"].codec, LowRank)
    assert isinstance(plans["0.bias"].codec, NoCompression)
    assert plans["4.weight"].numel == 8192 and plans["4.weight"].compressed
    policy = HyloPolicy(min_compress_numel=4096, rank=2)
    candidates = policy.candidates("4.weight", (128, 64))
    assert [plan.route for plan in candidates] == ["low_rank", "two_bit"]
    # at the default rank (8) the factors of so small a layer are larger than its 2-bit codes
    assert HyloPolicy(min_compress_numel=4096).assign("4.weight", (128, 64)).route == "two_bit"
    assert [plan.route for plan in policy.candidates("1.weight", (64, 8, 3, 3))] == ["kernel"]
    without = HyloPolicy(min_compress_numel=4096, rank=None).plan(_model().named_parameters())
    assert isinstance(without["4.weight"].codec, TwoBitQuantizer)


def test_cost_model_keeps_the_cheapest_candidate_within_the_error_budget() -> None:
    model = CostModel(bandwidth=1e6)  # 1 MB/s
    # low rank: 0.01 s + 0.01 s on the wire, error 0.6; 2-bit: 0.05 s + 0.25 s, error 0.4
    model.observe_codec("fc", 0.01, 4e6, 1e4, route="low_rank", error=0.6)
    model.observe_codec("fc", 0.05, 4e6, 2.5e5, route="two_bit", error=0.4)
    agreed = model.measurements(["fc"])
    assert model.decide(["fc"], agreed)["fc"].route == "low_rank"
    assert model.decide(["fc"], agreed, error_budget=0.5)["fc"].route == "two_bit"
    # no candidate within the budget: the least error
    assert model.decide(["fc"], agreed, error_budget=0.1)["fc"].route == "two_bit"
    restored = CostModel()
    restored.load_state_dict(model.state_dict())
    assert torch.equal(restored.measurements(["fc"]), agreed)


def test_two_bit_blocks_of_512_by_default_and_one_scale_per_tensor_on_request() -> None:
    assert HyloPolicy().two_bit_codec.block_size == 512
    assert HyloPolicy(block_size=None).two_bit_codec.block_size is None
    policy = HyloPolicy(min_compress_numel=4096, block_size=64, rank=None)
    codec = policy.plan(_model().named_parameters())["4.weight"].codec
    assert isinstance(codec, TwoBitQuantizer) and codec.block_size == 64


def test_default_thresholds_on_vgg_mini() -> None:
    # vgg_mini's shapes on digits: low rank from 8,192 values (every layer here), kernel top-k
    # and 2-bit codes only from 65,536 (on smaller layers they cost 3 to 4 points of accuracy,
    # docs/hylo.md); a convolution takes kernel top-k first, a linear layer the fewer bytes
    shapes = {
        "conv0": (32, 1, 3, 3),
        "conv1": (32, 32, 3, 3),
        "conv2": (64, 32, 3, 3),
        "conv3": (64, 64, 3, 3),
        "conv4": (128, 64, 3, 3),
        "conv5": (128, 128, 3, 3),
        "fc1": (4096, 2048),
        "fc2": (1024, 4096),
        "out": (10, 1024),
    }
    policy = HyloPolicy()
    routes = {
        name: [p.route for p in policy.candidates(name, shape)] for name, shape in shapes.items()
    }
    assert routes == {
        "conv0": [],
        "conv1": ["low_rank"],
        "conv2": ["low_rank"],
        "conv3": ["low_rank"],
        "conv4": ["kernel", "low_rank"],
        "conv5": ["kernel", "low_rank"],
        "fc1": ["low_rank", "two_bit"],
        "fc2": ["low_rank", "two_bit"],
        "out": ["low_rank"],
    }
    assert policy.assign("conv0", shapes["conv0"]).route == "dense"
    assert policy.assign("conv5", shapes["conv5"]).route == "kernel"
    legacy = HyloPolicy(conv_low_rank=False, low_rank_min_numel=65536)
    assert legacy.assign("conv1", shapes["conv1"]).route == "dense"
    assert legacy.assign("out", shapes["out"]).route == "dense"


def test_fc_bits_32_leaves_linear_layers_uncompressed() -> None:
    plans = HyloPolicy(min_compress_numel=4096, fc_bits=32).plan(_model().named_parameters())
    assert plans["4.weight"].route == "dense"
    assert plans["1.weight"].route == "kernel"


@pytest.mark.parametrize(("codec", "kind"), [("topk", TopK), ("qsgd", QSGD)])
def test_peer_codecs_apply_to_every_large_parameter(codec: str, kind: type) -> None:
    plans = HyloPolicy(codec=codec, min_compress_numel=4096).plan(_model().named_parameters())
    compressed = {name for name, plan in plans.items() if plan.compressed}
    assert compressed == {"1.weight", "4.weight"}
    assert all(isinstance(plans[name].codec, kind) for name in compressed)
    assert {plans[name].route for name in compressed} == {"gather"}


def test_codec_none_compresses_nothing() -> None:
    plans = HyloPolicy(codec="none", min_compress_numel=1).plan(_model().named_parameters())
    assert not any(plan.compressed for plan in plans.values())


def test_frozen_parameters_get_no_plan() -> None:
    model = _model()
    model[0].weight.requires_grad_(False)
    assert "0.weight" not in HyloPolicy().plan(model.named_parameters())


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"codec": "zip"}, "codec must be one of"),
        ({"fc_bits": 8}, "fc_bits must be 2"),
        ({"min_compress_numel": 0}, "min_compress_numel"),
        ({"block_size": 100}, "block_size must be a positive multiple of 16"),
    ],
)
def test_bad_policy_arguments_raise(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        HyloPolicy(**kwargs)  # type: ignore[arg-type]


def test_cost_model_compresses_only_where_the_saving_beats_the_codec_time() -> None:
    model = CostModel()
    model.observe_transfer(bytes_sent=1e6, seconds=1.0)  # 1 MB/s measured
    model.observe_codec("big", seconds=0.5, dense_bytes=1e6, compressed_bytes=1e5)  # saves 0.9 s
    model.observe_codec("big", seconds=0.7, dense_bytes=1e6, compressed_bytes=1e5)  # min kept
    model.observe_codec("small", seconds=0.01, dense_bytes=1e3, compressed_bytes=1e2)  # 0.9 ms
    names = ["big", "small"]
    agreed = model.measurements(names)
    assert agreed.tolist() == pytest.approx([0.5, 0.01, 0.0, 0.0, 1e-6])
    decisions = model.decide(names, agreed)
    assert decisions["big"].compress and not decisions["small"].compress
    assert decisions["big"].saved_seconds == pytest.approx(0.9)

    restored = CostModel()
    restored.load_state_dict(model.state_dict())
    assert restored.decisions == decisions
    assert torch.equal(restored.measurements(names), agreed)


def test_cost_model_with_a_given_bandwidth_and_margin() -> None:
    model = CostModel(bandwidth=1e9, margin=2.0)
    model.observe_codec("layer", seconds=0.001, dense_bytes=4e6, compressed_bytes=0.0)
    decisions = model.decide(["layer"], model.measurements(["layer"]))
    assert decisions["layer"].compress  # 4 ms saved > 2 x 1 ms
    with pytest.raises(ValueError, match="bandwidth"):
        CostModel(bandwidth=0.0)
