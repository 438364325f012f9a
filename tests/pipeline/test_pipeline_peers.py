"""The benchmark's pipeline peers train exactly what one device trains, so that the benchmark
compares engines and partitions, not different mathematics."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "strategies"))

from test_gropipe import BATCH, Net, assert_same_weights, loader, trainer

from lightning_parallel.bench.specs import build_strategy
from lightning_parallel.callbacks.comm_stats import CommStats


class CrossEntropyNet(Net):
    """DeepSpeed's engine computes the loss itself: cross-entropy, as in the demo models."""

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", F.cross_entropy(self(x), y))


@pytest.mark.parametrize("name", ["torch_gpipe", "torch_1f1b"])
def test_torch_pipelining_peers_match_single_device(name: str) -> None:
    reference = Net()
    trainer("auto", 1).fit(reference, loader(shuffled=True), loader())
    model = Net()
    strategy = build_strategy(f"{name}:stages=2,micro_batches=4,start_method=fork")
    # CommStats counts sends through dist.isend; torch's P2POp must still tell sends from receives
    trainer(strategy, 2, callbacks=[CommStats(log=False)]).fit(model, loader(), loader())
    assert_same_weights(reference, model)


def test_torch_pipelining_peer_with_two_groups() -> None:
    reference = Net()
    trainer("auto", 1).fit(reference, loader(2 * BATCH, shuffled=True))
    model = Net()
    trainer(build_strategy("torch_1f1b:stages=2,micro_batches=2,start_method=fork"), 4).fit(
        model, loader(BATCH)
    )
    assert_same_weights(reference, model)


def test_gropipe_is_a_benchmark_name() -> None:
    strategy = build_strategy("gropipe:stages=2,micro_batches=8")
    assert (strategy.stages, strategy.micro_batches) == (2, 8)  # type: ignore[attr-defined]


@pytest.mark.skipif(
    importlib.util.find_spec("deepspeed") is None,
    reason="DeepSpeed is not installed: pip install 'lightning-parallel[bench]' (the refusal "
    "without it: tests/bench/test_bench_deepspeed_peer.py)",
)
def test_deepspeed_pipeline_engine_peer() -> None:
    reference = CrossEntropyNet()
    trainer("auto", 1).fit(reference, loader(shuffled=True), loader())
    model = CrossEntropyNet()
    strategy = build_strategy("deepspeed_pipe:stages=2,micro_batches=4,start_method=fork")
    run = trainer(strategy, 2)
    run.fit(model, loader(), loader())
    assert_same_weights(reference, model)
    torch.testing.assert_close(
        run.callback_metrics["val_loss"], reference.trainer.callback_metrics["val_loss"]
    )


def test_torchgpipe_peer_replicas_match_single_device() -> None:
    """torchgpipe pipelines each process's batch over 2 partitions; 2 replicas = batch 2B."""
    pytest.importorskip("torchgpipe")
    reference = Net()
    trainer("auto", 1).fit(reference, loader(2 * BATCH, shuffled=True))
    model = Net()
    strategy = build_strategy("torchgpipe:stages=2,micro_batches=4,start_method=fork")
    run = trainer(strategy, 2)
    run.fit(model, loader(BATCH))
    assert_same_weights(reference, model)
    assert run.callback_metrics["torchgpipe/partitions"].item() == 2
    # each rank pipelines its half of the batches, for 2 epochs
    assert run.callback_metrics["torchgpipe/pipelined_batches"].item() == len(loader(BATCH))
    assert "forward" not in vars(model.layers)  # the model is handed back unchanged


class LateNormNet(Net):
    """A BatchNorm in the second stage, where torch infers shapes on uninitialised tensors."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = torch.nn.Sequential(
            torch.nn.Linear(6, 12), torch.nn.Tanh(), torch.nn.Linear(12, 12),
            torch.nn.BatchNorm1d(12), torch.nn.Tanh(), torch.nn.Linear(12, 3),
        )  # fmt: skip


def test_torch_peers_keep_the_second_stages_batch_norm_statistics_finite() -> None:
    """torch's first-step shape inference ran the second stage on uninitialised memory: its
    running statistics read NaN for good and evaluation scored chance."""
    reference = LateNormNet()
    trainer("auto", 1, max_epochs=1).fit(reference, loader(shuffled=True))
    model = LateNormNet()
    strategy = build_strategy("torch_gpipe:stages=2,micro_batches=4,start_method=fork")
    trainer(strategy, 2, max_epochs=1).fit(model, loader())
    norm = model.layers[3]
    assert torch.isfinite(norm.running_mean).all() and torch.isfinite(norm.running_var).all()
    # one update per micro-batch (4 per step), the first step's left out, no more
    steps = int(reference.layers[3].num_batches_tracked)
    assert int(norm.num_batches_tracked) == 4 * steps - 4


@pytest.mark.parametrize(
    ("name", "weight_actions"),
    [
        ("torch_interleaved_1f1b", False),
        ("torch_zb", True),
        ("torch_zbv", True),
        ("torch_dualpipev", True),
    ],
)
def test_virtual_stage_peers_match_single_device(name: str, weight_actions: bool) -> None:
    """Two virtual stages per rank (four cuts of a five-layer net), torch's schedule order,
    zero-bubble weight-gradient actions where the schedule has them: the weights of single-
    process training after two epochs, and the evaluation that follows sees them too."""
    reference = CrossEntropyNet()
    trainer("auto", 1).fit(reference, loader(shuffled=True), loader())
    model = CrossEntropyNet()
    strategy = build_strategy(f"{name}:stages=2,micro_batches=4,start_method=fork")
    run = trainer(strategy, 2, callbacks=[CommStats(gauges_every_n_steps=1)])
    run.fit(model, loader(), loader())
    assert_same_weights(reference, model)
    torch.testing.assert_close(
        run.callback_metrics["val_loss"], reference.trainer.callback_metrics["val_loss"]
    )
    assert run.callback_metrics["comm/virtual_stages_per_rank"].item() == 2
    assert (run.callback_metrics["comm/weight_gradient_actions"].item() > 0) == weight_actions


@pytest.mark.parametrize("name", ["torch_zb", "torch_dualpipev"])
def test_virtual_stage_peers_with_two_groups(name: str) -> None:
    """Both rank orders (looped: natural, V: last stage first) with a data-parallel axis: each
    virtual stage's gradients averaged across the two groups."""
    reference = CrossEntropyNet()
    trainer("auto", 1).fit(reference, loader(2 * BATCH, shuffled=True))
    model = CrossEntropyNet()
    trainer(build_strategy(f"{name}:stages=2,micro_batches=4,start_method=fork"), 4).fit(
        model, loader(BATCH)
    )
    assert_same_weights(reference, model)


@pytest.mark.slow
@pytest.mark.parametrize("peer", ["torch_interleaved_1f1b", "deepspeed_pipe"])
def test_whole_model_peers_validate_after_fit_in_the_same_processes(
    tmp_path: Path, peer: str
) -> None:
    """The benchmark validates after ``fit`` in the processes that trained (launched apart):
    the next run starts from rank 0's model, which must hold every stage's weights by then
    (it held only its own: chance accuracy)."""
    from lightning_parallel.bench.command import main as bench_main

    out = tmp_path / "out.json"
    code = bench_main(
        ["-s", "torch_1f1b:stages=2", "-s", f"{peer}:stages=2", "--network", "local",
         "--hosts", "2", "--model", "mlp", "--max-steps", "12", "--warmup-steps", "1",
         "--json", str(out), "--timeout", "300"]
    )  # fmt: skip
    assert code == 0
    one_stage, whole_model = json.loads(out.read_text())["runs"]
    assert one_stage["ok"] and whole_model["ok"]
    assert whole_model["val_loss"] == pytest.approx(one_stage["val_loss"], rel=1e-4)


def test_torch_peers_refuse_cuda_tensors_over_gloo() -> None:
    """torch's schedules send CUDA tensors through the process group as they are; gloo cannot
    (every torch peer aborted with 'writev: Bad address' on one GPU shared over gloo): the peer
    refuses at setup, naming NCCL, while CUDA over NCCL and the CPU over gloo go on."""
    from lightning_parallel.bench.peers.torch_pipelining import check_peer_transport

    with pytest.raises(ValueError, match=r"torch_zbv .*gloo cannot send CUDA tensors.*nccl"):
        check_peer_transport("torch_zbv", torch.device("cuda", 0), "gloo")
    check_peer_transport("torch_zbv", torch.device("cuda", 0), "nccl")
    check_peer_transport("torch_zbv", torch.device("cpu"), "gloo")
