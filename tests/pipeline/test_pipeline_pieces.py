"""Single-process pieces: micro-batching, stage splitting and tracing, profiling, deferred
BatchNorm, deferred weight gradients, the hybrid learning rate, the transport header, the
topology, log combining."""

from __future__ import annotations

import copy
import math
from collections import namedtuple

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_parallel.pipeline.batchnorm import (
    DeferredBatchNorm,
    commit_deferred_batch_norm,
    convert_deferred_batch_norm,
    restore_batch_norm,
)
from lightning_parallel.pipeline.hybrid_lr import HybridCosineLinearLR
from lightning_parallel.pipeline.microbatch import (
    merge_microbatches,
    microbatch_sizes,
    split_microbatches,
)
from lightning_parallel.pipeline.profile import profile_layers
from lightning_parallel.pipeline.recompute import recomputing
from lightning_parallel.pipeline.stages import (
    PipelineSplitError,
    even_boundaries,
    layer_sequence,
    split_stages,
)
from lightning_parallel.pipeline.summary import LogRecorder, StepSummary
from lightning_parallel.pipeline.topology import PipelineTopology
from lightning_parallel.pipeline.transport import decode_header, encode_header
from lightning_parallel.pipeline.weight_grad import (
    convert_deferred_weight_gradients,
    deferred_linears,
    deferring_weight_gradients,
    flush_weight_gradients,
    restore_linear,
)

Pair = namedtuple("Pair", ["image", "label"])


def test_split_and_merge_arbitrary_batches() -> None:
    batch = {
        "x": torch.arange(10.0).view(5, 2),
        "pair": Pair(torch.arange(5), [torch.ones(5, 3), "tag"]),
        "weight": 0.5,
    }
    parts = split_microbatches(batch, 3)
    assert microbatch_sizes(batch, 3) == [2, 2, 1] == [len(p["x"]) for p in parts]
    assert isinstance(parts[0]["pair"], Pair) and parts[2]["pair"].label[1] == "tag"
    merged = merge_microbatches(parts)
    torch.testing.assert_close(merged["x"], batch["x"])
    torch.testing.assert_close(merged["pair"].image, batch["pair"].image)
    assert merged["weight"] == 0.5
    assert len(split_microbatches(torch.zeros(2, 1), 8)) == 2  # never an empty micro-batch
    with pytest.raises(ValueError, match="differ in their first dimension"):
        split_microbatches((torch.zeros(4), torch.zeros(3)), 2)
    with pytest.raises(ValueError, match="holds no tensor"):
        split_microbatches(["a"], 2)


class Residual(nn.Module):
    """Not a sequence: a skip connection and a size() call; fx must cut only where tensors flow."""

    def __init__(self) -> None:
        super().__init__()
        self.inp, self.mid, self.out = nn.Linear(4, 8), nn.Linear(8, 8), nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.inp(x))
        h = h + torch.tanh(self.mid(h))
        return self.out(h.view(x.size(0), -1))


def test_traced_stages_compute_the_model_and_share_its_parameters() -> None:
    model, x = Residual(), torch.randn(5, 4)
    layers = layer_sequence(model, (x,))
    assert len(layers) >= 3
    for boundaries in ([1], [2], even_boundaries(len(layers), 3)):
        stages = split_stages(layers, boundaries)
        value = stages[0](x)
        for stage in stages[1:]:
            value = stage(value)
        torch.testing.assert_close(value, model(x))
    stage_parameters = {id(p) for stage in split_stages(layers, [2]) for p in stage.parameters()}
    assert stage_parameters == {id(p) for p in model.parameters()}


def test_untraceable_models_and_bad_boundaries_name_the_fix() -> None:
    class Branchy(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x if x.sum() > 0 else -x

    with pytest.raises(PipelineSplitError, match=r"self\.layers = nn\.Sequential"):
        layer_sequence(Branchy(), (torch.ones(2),))
    layers = layer_sequence(nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 2)))
    with pytest.raises(PipelineSplitError, match="strictly increasing"):
        split_stages(layers, [2, 1])
    with pytest.raises(PipelineSplitError, match="use at most 3"):
        even_boundaries(3, 4)


def test_profile_measures_and_leaves_the_model_untouched() -> None:
    model = nn.Sequential(nn.Linear(16, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 4))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    small = profile_layers(list(model), (torch.randn(8, 16),), repeats=2)
    large = profile_layers(list(model), (torch.randn(32, 16),), repeats=2)
    assert all(p.grad is None for p in model.parameters())
    for key, value in model.state_dict().items():
        torch.testing.assert_close(value, before[key])
    assert small.layers[0].parameter_bytes == (16 * 32 + 32) * 4
    assert small.layers[0].output_bytes == 8 * 32 * 4 and small.input_bytes == 8 * 16 * 4
    assert (
        large.layers[0].activation_bytes == 4 * small.layers[0].activation_bytes
    )  # saves its input
    assert all(c.forward_seconds > 0 and c.backward_seconds >= 0 for c in small.layers)


def test_profile_keeps_the_deferred_share_and_times_weight_passes_when_asked() -> None:
    """A layer of deferred-gradient linears carries its share of the flush apart (inside its
    backward); other layers carry 0. The weight pass is timed only on request, and a layer
    without parameters takes none."""
    model = nn.Sequential(nn.Sequential(nn.Linear(16, 64)), nn.ReLU(), nn.Linear(64, 4))
    convert_deferred_weight_gradients(model[0])
    example = (torch.randn(8, 16),)
    plain = profile_layers(list(model), example, repeats=2, micro_batches=4)
    assert all(c.pass_seconds is None for c in plain.layers)
    deferred, relu, last = plain.layers
    assert deferred.deferred_seconds is not None and deferred.deferred_seconds > 0
    assert deferred.deferred_seconds < deferred.backward_seconds
    assert relu.deferred_seconds == 0.0 and last.deferred_seconds == 0.0
    timed = profile_layers(list(model), example, repeats=2, weight_passes=True)
    assert timed.layers[0].pass_seconds > 0 and timed.layers[2].pass_seconds > 0
    assert timed.layers[1].pass_seconds == 0.0
    assert all(p.grad is None for p in model.parameters())


def test_profile_warms_up_with_chained_passes_before_timing() -> None:
    """Each warm pass runs every layer forward, in chain order, and backward once more than a
    profile without them; the timings follow (see pipeline.profile's step 0)."""

    class Counted(nn.Linear):
        def __init__(self, log: list[tuple[str, int]], index: int) -> None:
            super().__init__(4, 4)
            self.log, self.index = log, index
            self.weight.register_hook(self._backward)

        def _backward(self, grad: torch.Tensor) -> None:
            self.log.append(("backward", self.index))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.log.append(("forward", self.index))
            return super().forward(x)

    counts = {}
    for passes in (0, 3):
        log: list[tuple[str, int]] = []
        layers = [Counted(log, 0), nn.ReLU(), Counted(log, 1)]
        profile_layers(layers, (torch.randn(2, 4),), repeats=1, warm_passes=passes)
        counts[passes] = log
    extra = len(counts[3]) - len(counts[0])
    # a warm pass: forward 0, forward 1, backward 1, backward 0
    assert extra == 3 * 4
    one_pass = [("forward", 0), ("forward", 1), ("backward", 1), ("backward", 0)]
    assert counts[3][: 3 * 4] == one_pass * 3
    assert counts[3][3 * 4 :] == counts[0]
    with pytest.raises(ValueError, match="warm_passes"):
        profile_layers(layers, (torch.randn(2, 4),), warm_passes=-1)


def test_profile_counts_no_gradient_back_over_integer_outputs() -> None:
    class TokenIds(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x.clamp(0, 9).long()

    layers = [TokenIds(), nn.Embedding(10, 8), nn.Linear(8, 2)]
    profile = profile_layers(layers, (torch.randint(0, 10, (4, 6)).float(),), repeats=1)
    ids, embedded = profile.layers[0], profile.layers[1]
    # the ids cross a cut forward; no gradient comes back over them
    assert ids.output_bytes == 4 * 6 * 8 and ids.gradient_bytes == ids.backward_bytes == 0
    assert (
        embedded.gradient_bytes == embedded.backward_bytes == embedded.output_bytes == 4 * 6 * 8 * 4
    )


def test_deferred_batch_norm_has_whole_mini_batch_running_statistics() -> None:
    torch.manual_seed(0)
    plain = nn.Sequential(nn.BatchNorm1d(3, momentum=0.3))
    deferred = nn.Sequential(nn.BatchNorm1d(3, momentum=0.3))
    replaced = convert_deferred_batch_norm(deferred)
    assert isinstance(deferred[0], DeferredBatchNorm)
    for _ in range(2):
        batch = torch.randn(12, 3) * 3 + 1
        plain(batch)
        for micro_batch in batch.split(5):  # 5, 5, 2: uneven
            deferred(micro_batch)
        with recomputing():  # a recomputed forward must not count twice
            deferred(batch[:5])
        commit_deferred_batch_norm(deferred)
    torch.testing.assert_close(deferred[0].running_mean, plain[0].running_mean)
    torch.testing.assert_close(deferred[0].running_var, plain[0].running_var)
    assert int(deferred[0].num_batches_tracked) == 2
    # normalization inside a micro-batch uses that micro-batch's own statistics
    micro_batch = torch.randn(4, 3)
    expected = F.batch_norm(
        micro_batch, None, None, plain[0].weight, plain[0].bias, True, 0.0, 1e-5
    )
    torch.testing.assert_close(deferred(micro_batch), expected)
    restore_batch_norm(deferred, replaced)
    assert type(deferred[0]) is nn.BatchNorm1d
    torch.testing.assert_close(deferred[0].running_mean, plain[0].running_mean)


def test_hybrid_cosine_linear_schedule_follows_its_formula() -> None:
    optimizer = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=2.0)
    scheduler = HybridCosineLinearLR(
        optimizer,
        total_steps=12,
        cosine_fraction=0.5,
        switch_ratio=0.2,
        final_ratio=0.05,
        warmup_steps=2,
    )
    rates = []
    for _ in range(14):
        rates.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    cosine = 5  # round(0.5 * (12 - 2))
    expected = [2.0 * (t + 1) / 2 for t in range(2)]
    expected += [
        2.0 * (0.2 + 0.8 * 0.5 * (1 + math.cos(math.pi * i / cosine))) for i in range(cosine)
    ]
    expected += [2.0 * (0.2 + (0.05 - 0.2) * i / 5) for i in range(5)]
    expected += [2.0 * 0.05] * 2
    assert rates == pytest.approx(expected)
    assert rates[2] == pytest.approx(2.0) and rates[7] == pytest.approx(0.4)  # continuous joins
    with pytest.raises(ValueError, match="final_ratio <= switch_ratio"):
        HybridCosineLinearLR(optimizer, 10, switch_ratio=0.1, final_ratio=0.5)


def test_transport_header_round_trip() -> None:
    tensors = [torch.zeros(2, 3, requires_grad=True), torch.zeros(4, dtype=torch.int64)]
    is_tuple, specs = decode_header(encode_header(tensors, True))
    assert is_tuple is True
    assert specs == [(torch.float32, True, [2, 3]), (torch.int64, False, [4])]
    with pytest.raises(ValueError, match="choose other partition boundaries"):
        encode_header([torch.zeros(1, 1, 1, 1)] * 30, True)


def test_topology_puts_the_last_stage_of_group_zero_on_rank_zero() -> None:
    topology = PipelineTopology(6, 3)
    assert [(topology.group_of(r), topology.stage_of(r)) for r in range(6)] == [
        (0, 2),
        (0, 1),
        (0, 0),
        (1, 2),
        (1, 1),
        (1, 0),
    ]
    assert topology.pipeline_ranks(1) == [5, 4, 3] and topology.data_parallel_ranks(2) == [0, 3]
    with pytest.raises(ValueError, match="multiple of 4"):
        PipelineTopology(6, 4)


def test_stage_placement_puts_the_replicas_of_a_stage_side_by_side() -> None:
    topology = PipelineTopology(6, 3, placement="stage")
    assert [(topology.group_of(r), topology.stage_of(r)) for r in range(6)] == [
        (0, 2),
        (1, 2),
        (0, 1),
        (1, 1),
        (0, 0),
        (1, 0),
    ]
    assert topology.pipeline_ranks(1) == [5, 3, 1] and topology.data_parallel_ranks(0) == [4, 5]
    assert all(topology.rank(topology.group_of(r), topology.stage_of(r)) == r for r in range(6))
    with pytest.raises(ValueError, match="placement must be one of"):
        PipelineTopology(6, 3, placement="diagonal")


def test_logged_values_combine_across_micro_batches() -> None:
    recorder = LogRecorder()
    for weight, loss in ((0.5, 1.0), (0.25, 2.0), (0.25, 4.0)):
        recorder.start_micro_batch(weight)
        recorder.log("loss", torch.tensor(loss), prog_bar=True)
        recorder.log("seen", loss, reduce_fx="sum")
        recorder.log("worst", loss, reduce_fx=torch.max)
    combined = {v.name: v for v in recorder.combined()}
    assert combined["loss"].value == pytest.approx(0.5 + 0.5 + 1.0)
    assert combined["loss"].options == {"prog_bar": True}
    assert combined["seen"].value == 7.0 and combined["worst"].value == 4.0
    summary = StepSummary(stages=1, stage=0, group=None, source_rank=0).exchange(
        loss=1.5, busy_seconds=2.0, step_seconds=4.0, logged=recorder.combined()
    )
    assert summary.loss == 1.5 and [v.name for v in summary.logged] == ["loss", "seen", "worst"]
    assert summary.bubble_fraction == pytest.approx(0.5)


def test_deferred_weight_gradients_are_the_same_sum_computed_once() -> None:
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))
    deferred = copy.deepcopy(plain)
    replaced = convert_deferred_weight_gradients(deferred)
    layers = deferred_linears(deferred)
    assert len(layers) == 2 and set(replaced) == {"0", "2"}
    batches = torch.randn(4, 6, 5).unbind(0)  # four micro-batches of 6 samples
    for x in batches:
        plain(x).square().sum().backward()
        with deferring_weight_gradients():
            deferred(x).square().sum().backward()
    assert all(p.grad is None for p in deferred.parameters())  # nothing computed yet
    assert [len(layer.pending) for layer in layers] == [4, 4]
    flush_weight_gradients(layers)
    for (name, expected), actual in zip(plain.named_parameters(), deferred.parameters()):
        torch.testing.assert_close(actual.grad, expected.grad, msg=f"{name} differs")
    deferred(batches[0]).sum().backward()  # outside the context: an ordinary nn.Linear
    assert not layers[0].pending
    restore_linear(deferred, replaced)
    assert type(deferred[0]) is nn.Linear and deferred[0].weight is layers[0].weight


def test_a_flush_into_a_kept_gradient_adds_the_product_in_place(monkeypatch) -> None:
    """Gradient accumulation: the second flush adds its product to the gradient the first left,
    in place (``addmm_``), without a temporary the size of the weight (``vgg_mini``'s 32 MiB)."""
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(5, 7))
    deferred = copy.deepcopy(plain)
    convert_deferred_weight_gradients(deferred)
    layers = deferred_linears(deferred)
    products: list[tuple[int, ...]] = []
    mm = torch.Tensor.mm

    def spy(self: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
        products.append(tuple(self.shape[:1]) + tuple(other.shape[1:]))
        return mm(self, other)

    monkeypatch.setattr(torch.Tensor, "mm", spy)
    for x in torch.randn(2, 6, 5).unbind(0):  # two accumulated steps of one micro-batch
        plain(x).square().sum().backward()
        with deferring_weight_gradients():
            deferred(x).square().sum().backward()
        flush_weight_gradients(layers)
    # one weight-sized product: the first flush's, which becomes the gradient
    assert products == [(7, 5)]
    for (name, expected), actual in zip(plain.named_parameters(), deferred.parameters()):
        torch.testing.assert_close(actual.grad, expected.grad, msg=f"{name} differs")


def test_deferred_weight_gradients_take_an_autocast_forwards_dtypes() -> None:
    """Forward under bf16 autocast, backward outside it (as a pipeline stage runs them): the
    input gradient comes back in the input's dtype and equals plain autograd's."""
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(8, 4))
    deferred = copy.deepcopy(plain)
    convert_deferred_weight_gradients(deferred)
    x = torch.randn(6, 8)
    inputs = [x.clone().requires_grad_(), x.clone().requires_grad_()]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        reference = plain(inputs[0])
        with deferring_weight_gradients():  # forwards in the block defer
            output = deferred(inputs[1])
    reference.float().square().sum().backward()
    output.float().square().sum().backward()
    flush_weight_gradients(deferred_linears(deferred))
    assert inputs[1].grad is not None and inputs[1].grad.dtype == torch.float32
    torch.testing.assert_close(inputs[1].grad, inputs[0].grad)
    torch.testing.assert_close(deferred[0].weight.grad, plain[0].weight.grad)


def test_a_step_forgets_batch_norm_statistics_of_forwards_before_it() -> None:
    """The partitioner runs a stage's layers before the first step (profiling on real tensors,
    estimation on meta ones): the step's running statistics are its own micro-batches' alone
    (the stray ones were merged in; a meta one made the first step fail)."""
    from lightning_parallel.pipeline.runtime import StageRuntime
    from lightning_parallel.pipeline.schedule import get_schedule

    torch.manual_seed(0)
    reference = nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6))
    stray = copy.deepcopy(reference)
    for model in (reference, stray):
        convert_deferred_batch_norm(model)
    stray(torch.randn(8, 4) * 100 + 50)  # a training-mode forward outside any step
    inputs = [(part,) for part in torch.randn(16, 4).chunk(2)]
    for model in (reference, stray):
        StageRuntime(model, 0, 1).run_step(
            get_schedule("gpipe").table(1, 2)[0], 2, inputs, lambda j, out: out.square().mean()
        )
    torch.testing.assert_close(stray[1].running_mean, reference[1].running_mean)
    torch.testing.assert_close(stray[1].running_var, reference[1].running_var)
