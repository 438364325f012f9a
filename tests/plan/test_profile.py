"""The plan's profile: what one step of a module costs, measured in one process."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_parallel.plan.codecs import low_rank_seconds
from lightning_parallel.plan.measure import pipeline_layers, profile_step
from lightning_parallel.plan.profile import StepProfile


class _Net(nn.Module):
    """A module with a Lightning-like ``training_step`` and ``log`` (plain torch)."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
        self.logged = 0
        self.steps = 0

    def forward(self, x: Tensor) -> Tensor:
        return self.layers(x)

    def log(self, *args: object, **kwargs: object) -> None:
        self.logged += 1

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        self.steps += 1
        self.log("loss", 0.0)
        x, y = batch
        return F.cross_entropy(self(x), y)


def _batch() -> tuple[Tensor, Tensor]:
    generator = torch.Generator().manual_seed(0)
    return torch.randn(8, 16, generator=generator), torch.randint(0, 4, (8,), generator=generator)


def test_profile_step_times_each_part_and_counts_the_state() -> None:
    net = _Net()
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    profile = profile_step(net, _batch(), optimizer, repeats=3, warmup=1)
    assert net.steps == 3 + 1 + 1  # warm-up, timed runs, the activation meter's forward
    assert net.logged == 0  # log does nothing while profiling
    assert profile.batch_size == 8
    assert min(profile.forward_s, profile.backward_s, profile.optimizer_s) > 0
    parameters = sum(p.numel() * 4 for p in net.parameters())
    assert profile.parameter_bytes == parameters
    assert profile.optimizer_state_bytes == parameters  # one momentum buffer per parameter
    assert profile.activation_bytes > 0
    assert profile.overhead_s == 0.0  # no trainer measured
    assert profile.step_s == pytest.approx(profile.compute_s)


def test_a_profile_survives_json_and_scales_its_layers() -> None:
    net = _Net()
    layers, error = pipeline_layers(net, _batch(), [1, 2], step_args=(0,), repeats=1)
    assert error is None
    assert [p.micro_batch for p in layers] == [8, 4]
    profile = StepProfile(
        batch_size=8, forward_s=0.1, backward_s=0.2, optimizer_s=0.05,
        parameters=(), optimizer_state_bytes=0, activation_bytes=0, trainer_step_s=0.5,
        layer_profiles=layers, codec_errors={"w": {"low_rank@8": 0.95, "two_bit": 0.46}},
    )  # fmt: skip
    again = StepProfile.from_dict(json.loads(json.dumps(profile.as_dict())))
    assert again == profile
    # a profile written before the trial's errors were kept loads without them
    older = profile.as_dict()
    del older["codec_errors"]
    assert StepProfile.from_dict(older).codec_errors == {}
    assert again.overhead_s == pytest.approx(0.15)
    assert again.layers_at(4) == layers[1]
    doubled = again.layers_at(16)
    assert doubled is not None and doubled.micro_batch == 16
    first = layers[0].layers[0]
    assert doubled.layers[0].forward_seconds == pytest.approx(2 * first.forward_seconds)
    assert doubled.layers[0].output_bytes == 2 * first.output_bytes
    assert doubled.layers[0].parameter_bytes == first.parameter_bytes


def test_each_chain_pass_starts_as_a_step_does_with_no_gradient(monkeypatch) -> None:
    from lightning_parallel.pipeline import weight_grad

    found: list[bool] = []  # a flush into a gradient left by the pass before, or a fresh one
    accumulate = weight_grad._accumulate

    def spy(parameter: Tensor, gradient: Tensor) -> None:
        found.append(parameter.grad is not None)
        accumulate(parameter, gradient)

    monkeypatch.setattr(weight_grad, "_accumulate", spy)
    net = _Net()
    kept = [torch.full_like(p, 7.0) for p in net.parameters()]
    for parameter, grad in zip(net.parameters(), kept):
        parameter.grad = grad
    layers, error = pipeline_layers(net, _batch(), [2], step_args=(0,), repeats=1)
    assert error is None and [p.micro_batch for p in layers] == [4]
    # the micro-batched chain's deferred linear layers (weight and bias, two layers) flush once
    # in each of the chain's 4 passes (and in the layers' own timing), every time into
    # cleared gradients
    assert len(found) >= 4 * 2 * 2 and not any(found)
    # and the module's own gradients are left as they were
    assert all(p.grad is g for p, g in zip(net.parameters(), kept))


def test_the_chain_s_flush_takes_every_micro_batch_s_rows_as_a_step_s_does(monkeypatch) -> None:
    # a step's flush is one product over the rows of all its micro-batches, which grows with
    # them: timed over one micro-batch's rows and divided by their count, gpt's chain at
    # micro-batches of 8 came to 6.8 ms where GroPipe's two stages took 8.3 together
    from lightning_parallel.pipeline import weight_grad

    pairs: list[int] = []
    flush = weight_grad.DeferredGradLinear.flush

    def spy(self: weight_grad.DeferredGradLinear) -> None:
        pairs.append(len(self.pending))
        flush(self)

    monkeypatch.setattr(weight_grad.DeferredGradLinear, "flush", spy)
    layers, error = pipeline_layers(_Net(), _batch(), [2], step_args=(0,), repeats=1)
    assert error is None and [p.micro_batch for p in layers] == [4]
    # the layers' own timing and the chain's 4 passes, two deferred layers each
    assert len(pairs) >= 4 * 2 and set(pairs) == {2}


def test_a_model_that_cannot_be_split_gives_the_reason() -> None:
    class Opaque(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.ones(3))

        def training_step(self, batch: Tensor, batch_idx: int) -> Tensor:
            return (batch * self.weight).sum()  # never calls a module

    layers, error = pipeline_layers(Opaque(), torch.ones(4, 3), [1])
    assert layers == () and error is not None and "called neither" in error


def test_low_rank_work_grows_with_the_matrix() -> None:
    small = low_rank_seconds((64, 64), 2, repeats=3)
    large = low_rank_seconds((1024, 1024), 2, repeats=3)
    assert 0 < small < large


def test_the_layer_profile_names_the_layers_sharing_a_tensor() -> None:
    """A language model's head reusing its embedding: both layers count the matrix, and the
    profile says they share it (the plans count it once for DDP, once a stage for a pipeline)."""
    from torch import nn

    from lightning_parallel.pipeline.tied import tied_layers

    embedding, head = nn.Embedding(16, 8), nn.Linear(8, 16, bias=False)
    head.weight = embedding.weight
    layers = [embedding, nn.Linear(8, 8), head]
    assert tied_layers(layers) == ((16 * 8 * 4, (0, 2)),)
    assert tied_layers(layers[:2]) == ()


def test_the_profile_s_fit_runs_until_its_timed_steps_add_up() -> None:
    """At least ``steps`` steps, and on until the steps after the first two add up to
    ``seconds``: a fit of 8 steps of 40 ms timed 0.25 s and its median moved by 50% between
    runs."""
    import time
    from types import SimpleNamespace

    import pytorch_lightning as pl

    from lightning_parallel.bench.plan_profile import _step_probe

    probe = _step_probe(pl.Callback, steps=3, seconds=0.05)
    trainer = SimpleNamespace(should_stop=False)
    steps = 0
    while not trainer.should_stop:
        probe.on_train_batch_start(trainer)
        time.sleep(0.01)
        probe.on_train_batch_end(trainer)
        steps += 1
    timed = sum(probe.step_seconds[2:])
    assert steps >= 3 and timed >= 0.05 and timed - probe.step_seconds[-1] < 0.05
    probe = _step_probe(pl.Callback, steps=3, seconds=0.0)
    trainer = SimpleNamespace(should_stop=False)
    for _ in range(3):
        assert not trainer.should_stop
        probe.on_train_batch_start(trainer)
        probe.on_train_batch_end(trainer)
    assert trainer.should_stop


def test_the_profile_s_fit_tries_hylo_s_candidates_on_its_first_gradients() -> None:
    """After the first backward, as a run's first calibration step: a 256 x 256 layer has two
    candidates (rank-8 factors and 2-bit codes), its bias none; later backwards change nothing."""
    import pytorch_lightning as pl

    from lightning_parallel.bench.plan_profile import _step_probe

    probe = _step_probe(pl.Callback, steps=1, seconds=0.0)
    layer = nn.Linear(256, 256)
    layer(torch.randn(4, 256)).square().sum().backward()
    probe.on_after_backward(None, layer)
    first = probe.codec_errors
    assert set(first) == {"weight"} and set(first["weight"]) == {"low_rank@8", "two_bit"}
    layer.weight.grad = torch.zeros_like(layer.weight)
    probe.on_after_backward(None, layer)
    assert probe.codec_errors is first
