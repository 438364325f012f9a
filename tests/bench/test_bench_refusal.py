"""A strategy that declines a model is a refusal with its reason, not a crash; ``-s all``."""

import json

import pytest
import torch
from torch import nn

from lightning_parallel.bench.peers.layers import peer_layers
from lightning_parallel.bench.specs import available, expand_specs
from lightning_parallel.bench.worker import _is_refusal, _Progress
from lightning_parallel.cluster import netns_unavailable_reason
from lightning_parallel.compat.registration import registered_names
from lightning_parallel.demo.resnet import resnet


def test_all_expands_to_every_name_of_the_package_ddp_and_the_peers_once():
    specs = expand_specs(["hylo:x=1", "all", "ddp"])
    assert specs[:2] == ["hylo:x=1", "ddp"]
    assert set(registered_names()) <= set(specs)
    assert {"torch_gpipe", "torch_1f1b", "deepspeed_pipe", "torchgpipe"} <= set(specs)
    assert len(specs) == len(set(specs)) and set(specs) - {"hylo:x=1"} <= set(available())
    assert expand_specs(["ddp", "hylo"]) == ["ddp", "hylo"]


@pytest.mark.parametrize(
    ("error", "progress", "refused"),
    [
        (ValueError("needs micro_batches dividing the batch"), _Progress(True, 0), True),
        (TypeError("forward() takes 2 positional arguments"), _Progress(True, 0), True),
        (ImportError("needs DeepSpeed"), _Progress(True, 0), True),
        (ValueError("bad model option"), _Progress(False, 0), False),  # the bench's settings
        (ValueError("late"), _Progress(True, 3), False),  # after training began: a failure
        (RuntimeError("Connection closed by peer"), _Progress(True, 0), False),
    ],
)
def test_a_refusal_is_a_clean_error_from_the_strategy_before_the_first_step(
    error, progress, refused
):
    assert _is_refusal(error, progress) is refused


def test_the_peers_take_a_resnet_as_its_users_write_it_and_refuse_other_networks():
    network = resnet("resnet18", width=4, depth=1, in_channels=3, num_classes=10).eval()
    layers = peer_layers(network, "deepspeed_pipe")
    x = torch.randn(2, 3, 32, 32)
    assert torch.equal(layers(x), network(x))
    assert {id(p) for p in layers.parameters()} == {id(p) for p in network.parameters()}
    sequential = nn.Sequential(nn.Linear(2, 2))
    assert peer_layers(sequential, "torchgpipe") is sequential
    with pytest.raises(ValueError, match="gropipe, spectrain, torch_gpipe"):
        peer_layers(nn.LSTM(2, 2), "torchgpipe")


REASON = netns_unavailable_reason()


@pytest.mark.netns
@pytest.mark.slow
@pytest.mark.skipif(REASON is not None, reason=REASON or "")
def test_a_peer_that_declines_a_model_is_recorded_as_refused_and_the_bench_goes_on(tmp_path):
    from lightning_parallel.bench.command import main as bench_main

    out = tmp_path / "out.json"
    code = bench_main(
        ["-s", "torch_gpipe", "-s", "ddp", "--hosts", "2", "--latency", "0",
         "--model", "recommender", "--max-steps", "2", "--warmup-steps", "0",
         "--json", str(out), "--timeout", "240"]
    )  # fmt: skip
    assert code == 1
    result = json.loads(out.read_text())
    assert result["config"]["data"] == "interactions"  # the model's kind, without --data
    refused, ddp = result["runs"]
    assert not refused["ok"] and refused["refused"]
    assert refused["error"].startswith("ValueError: torch_gpipe feeds one input tensor")
    assert ddp["ok"] and not ddp["refused"] and ddp["steps"] == 2
