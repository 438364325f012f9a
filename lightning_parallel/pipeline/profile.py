"""Measure each layer's forward and backward time and its memory on a sample micro-batch.

The partitioner balances stages by these costs (GroPipe's "performance projection"). For each
layer of a layer sequence, in order, on the output of the previous one, after
:data:`WARM_PASSES` forward and backward passes of the whole chain (0.):

0. the warm-up: the process's memory allocator starts where training keeps it. A fresh
   strategy process handed every large temporary (a weight gradient of several MB) straight
   from the kernel and took it back, faulting its pages in again on every backward: in
   GroPipe's setup on torchvision's ResNet-18 (micro-batches of 8) the profile took 71,000
   minor page faults where the same profile after three chained passes took 2,000-11,000, and
   the backward of each 512x512x3x3 convolution measured 5.6-13 ms instead of 3.2-4.1. The
   inflated times moved the cut from 49 to 58 layers, a split that trained at 0.145 s a step
   where the cut at 49 trains at 0.110 (both measured, 80 steps at 100 Mbit/s);
1. forward time: the fastest of ``repeats`` timed forwards (after one warm-up): other
   processes on the machine only ever add time, so the minimum is the layer's own cost;
2. backward time: the fastest of ``repeats`` timed backwards of a fresh forward, with a gradient
   of ones for every floating-point output;
3. activation memory: bytes of the distinct tensor storages autograd saves for the backward
   (``torch.autograd.graph.saved_tensors_hooks``), parameters excluded: what a stage holds per
   micro-batch in flight;
4. output bytes: what crosses a cut placed after the layer (and what a recomputing stage keeps);
5. parameter bytes.

A layer holding deferred-gradient linear layers (:mod:`~lightning_parallel.pipeline.weight_grad`)
is timed the way the runtime runs it: backward computes input gradients only, and the one
weight-gradient product over ``micro_batches`` micro-batches is timed and shared among them.

Profiling leaves the model as it found it: gradients, buffers (BatchNorm running statistics)
and the random-number state are restored.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from lightning_parallel.pipeline.recompute import recomputing
from lightning_parallel.pipeline.stage_entry import stage_inputs
from lightning_parallel.pipeline.tied import tied_layers
from lightning_parallel.pipeline.weight_grad import deferred_linears, deferring_weight_gradients

__all__: list[str] = []


@dataclass(frozen=True)
class LayerCost:
    """Costs of one layer for one micro-batch."""

    forward_seconds: float
    backward_seconds: float
    activation_bytes: int
    output_bytes: int
    parameter_bytes: int
    #: bytes of the output's floating-point tensors: the gradients that come back over a cut
    #: after this layer (an integer output, token ids, gets none). ``None``: not measured (a
    #: profile from before it was), taken as ``output_bytes``
    gradient_bytes: int | None = None
    #: what a no-flush stage does to the layer's weights before a forward when they are
    #: stale (:mod:`~lightning_parallel.pipeline.noflush.weight_pass`). ``None``: not
    #: measured (a profile from before, or not asked for)
    pass_seconds: float | None = None
    #: of ``backward_seconds``, the share of the deferred weight gradients computed once after
    #: the stage's last backward (:mod:`~lightning_parallel.pipeline.weight_grad`); ``None``:
    #: not measured
    deferred_seconds: float | None = None

    @property
    def seconds(self) -> float:
        """Forward plus backward time."""
        return self.forward_seconds + self.backward_seconds

    @property
    def backward_bytes(self) -> int:
        """Bytes of the gradients that cross a cut after this layer, backward."""
        return self.output_bytes if self.gradient_bytes is None else self.gradient_bytes


@dataclass(frozen=True)
class ModelProfile:
    """Per-layer costs of a layer sequence, and the bytes of the model input."""

    layers: tuple[LayerCost, ...]
    input_bytes: int
    #: each tensor that several layers use (tied weights): its bytes and those layers' indices
    #: (:func:`~lightning_parallel.pipeline.tied.tied_layers`); a split that puts its uses on
    #: different stages exchanges it between them
    tied: tuple[tuple[int, tuple[int, ...]], ...] = ()

    def __len__(self) -> int:
        return len(self.layers)


def tensors_of(value: Any) -> list[torch.Tensor]:
    """The tensors of a stage input or output (a tensor or a tuple/list of them)."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for item in value for t in tensors_of(item)]
    if isinstance(value, dict):
        return [t for item in value.values() for t in tensors_of(item)]
    return []


def nbytes(value: Any) -> int:
    """Bytes of the tensors in ``value``."""
    return sum(t.numel() * t.element_size() for t in tensors_of(value))


def floating_nbytes(value: Any) -> int:
    """Bytes of the floating-point tensors in ``value`` (those a gradient can come back to)."""
    return sum(t.numel() * t.element_size() for t in tensors_of(value) if t.is_floating_point())


def received_input(value: Any) -> Any:
    """``value`` detached, floating tensors requiring gradients (a stage's received input)."""
    if isinstance(value, torch.Tensor):
        leaf = value.detach()
        return leaf.requires_grad_(leaf.is_floating_point())
    if isinstance(value, tuple):
        return tuple(received_input(item) for item in value)
    if isinstance(value, list):
        return [received_input(item) for item in value]
    return value


class SavedTensorMeter:
    """Count the bytes autograd saves for backward, each storage once, parameters excluded."""

    def __init__(self, parameters: Sequence[torch.Tensor] = ()) -> None:
        self.excluded = {p.untyped_storage().data_ptr() for p in parameters}
        self.storages: dict[int, int] = {}

    def pack(self, tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        pointer = storage.data_ptr()
        if pointer not in self.excluded:
            self.storages[pointer] = storage.nbytes()
        # an alias, not the tensor: a saved *output* returned as is would reference its own
        # graph node through the hook, a cycle no garbage collector sees (the graph leaks)
        return tensor.detach()

    @staticmethod
    def unpack(tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    @property
    def bytes(self) -> int:
        return sum(self.storages.values())

    def hooks(self) -> torch.autograd.graph.saved_tensors_hooks:
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)


def clock() -> float:
    """The clock, once the GPU's queued work is done (CUDA runs asynchronously: without the
    synchronization a layer would be timed by its kernel launches)."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
    return time.perf_counter()


def fastest_seconds(run: Callable[[], object], repeats: int) -> float:
    samples = []
    for _ in range(repeats):
        start = clock()
        run()
        samples.append(clock() - start)
    return min(samples)


def _shared_flush_seconds(layers: Sequence[Any], micro_batches: int, repeats: int) -> float:
    """Time of one weight-gradient flush over ``micro_batches`` kept pairs, per micro-batch."""
    kept = [layer.pending[:1] for layer in layers]
    samples = []
    for _ in range(repeats):
        for layer, pair in zip(layers, kept):
            layer.pending[:] = pair * micro_batches
        start = clock()
        for layer in layers:
            layer.flush()
        samples.append(clock() - start)
    return min(samples) / micro_batches


def call_layer(layer: nn.Module, inputs: Any, first: bool) -> Any:
    """Call one layer of the chain: the first on the model's positional inputs, a later one on
    its input as a stage receives it."""
    # a later layer gets its input as a stage does (an in-place operation on it is allowed)
    return layer(*inputs) if first else layer(stage_inputs(inputs))


def backward_ones(value: Any) -> None:
    """Backward from every tensor in ``value`` that requires a gradient, with a gradient of
    ones (a timing pass's backward: the values do not matter, the work does)."""
    outputs = [t for t in tensors_of(value) if t.requires_grad]
    if outputs:
        torch.autograd.backward(outputs, [torch.ones_like(t) for t in outputs])


@contextmanager
def timing_passes(layers: Sequence[nn.Module]) -> Iterator[list[nn.Parameter]]:
    """Run timing passes over ``layers`` without leaving a trace: the forwards count as
    recomputations (no deferred BatchNorm statistics kept), the CPU random state is restored,
    and the layers' gradients and buffers are put back afterwards. Yields the parameters, their
    gradients cleared (a backward must not add into the gradients kept)."""
    modules = nn.ModuleList(layers)
    parameters = list(modules.parameters())
    saved_grads = [p.grad for p in parameters]
    saved_buffers = [b.detach().clone() for b in modules.buffers()]
    for parameter in parameters:
        parameter.grad = None
    try:
        with torch.random.fork_rng(devices=[]), recomputing():
            yield parameters
    finally:
        for parameter, grad in zip(parameters, saved_grads):
            parameter.grad = grad
        with torch.no_grad():
            for buffer, saved in zip(modules.buffers(), saved_buffers):
                buffer.copy_(saved)


#: chained forward and backward passes of the whole chain before any layer is timed
WARM_PASSES = 3


def warm_up(layers: Sequence[nn.Module], example_args: tuple[Any, ...], passes: int) -> None:
    """``passes`` chained forward and backward passes of ``layers`` on ``example_args``, each
    pass's gradients dropped at its end (inside :func:`timing_passes`): the large temporaries
    of a backward then come from memory the allocator keeps, as in training, not from fresh
    pages (see the module docstring). A pass holds the chain's gradients until it ends, as a
    training step does. Dropping each gradient as soon as it is accumulated would hold less,
    but it does not warm the allocator: measured in GroPipe's setup on torchvision's ResNet-18,
    114,000 page faults, the last block's backwards 6-7 ms, and the cut at 58 again."""
    parameters = [p for layer in layers for p in layer.parameters()]
    for _ in range(passes):
        value: Any = example_args
        for index, layer in enumerate(layers):
            value = call_layer(layer, value, index == 0)
        backward_ones(value)
        for parameter in parameters:
            parameter.grad = None


def profile_layers(
    layers: Sequence[nn.Module],
    example_args: tuple[Any, ...],
    repeats: int = 3,
    micro_batches: int = 1,
    warm_passes: int = WARM_PASSES,
    weight_passes: bool = False,
) -> ModelProfile:
    """Profile every layer of a layer sequence on ``example_args`` (one micro-batch).

    Args:
        layers: the chain (see :func:`~lightning_parallel.pipeline.stages.layer_sequence`).
        example_args: positional arguments of the first layer, sized like one micro-batch.
        repeats: timed runs per layer; the fastest is kept.
        micro_batches: micro-batches per step (shares deferred weight-gradient work).
        warm_passes: whole-chain passes before the timings (:func:`warm_up`).
        weight_passes: also time each layer's weight pass (``pass_seconds``; a plan's
            prediction of SpecTrain needs it; a strategy's partition does not).
    """
    if repeats < 1 or warm_passes < 0:
        raise ValueError(
            f"repeats must be at least 1 and warm_passes at least 0, got {repeats} and "
            f"{warm_passes}"
        )
    if weight_passes:  # the no-flush runtime's work: imported only when asked for
        from lightning_parallel.pipeline.noflush.weight_pass import weight_pass_seconds
    costs = []
    with timing_passes(layers) as parameters:
        warm_up(layers, example_args, warm_passes)
        current: Any = example_args
        for index, layer in enumerate(layers):
            first = index == 0
            inputs = received_input(current)

            def forward(layer: nn.Module = layer, inputs: Any = inputs, first: bool = first) -> Any:
                return call_layer(layer, inputs, first)

            output = forward()  # warm-up
            forward_seconds = fastest_seconds(forward, repeats)
            meter = SavedTensorMeter(parameters)
            with meter.hooks():
                output = forward()
            backward_samples = []
            deferred = deferred_linears(layer)
            for _ in range(repeats):
                with deferring_weight_gradients(bool(deferred)):
                    fresh = forward()
                start = clock()
                backward_ones(fresh)
                backward_samples.append(clock() - start)
            backward_seconds = min(backward_samples)
            flush_seconds = (
                _shared_flush_seconds(deferred, micro_batches, repeats) if deferred else 0.0
            )
            backward_seconds += flush_seconds
            layer_parameters = list(layer.parameters())
            for parameter in layer_parameters:  # never the whole model's gradients at once
                parameter.grad = None
            costs.append(
                LayerCost(
                    forward_seconds=forward_seconds,
                    backward_seconds=backward_seconds,
                    activation_bytes=meter.bytes,
                    output_bytes=nbytes(output),
                    parameter_bytes=sum(p.numel() * p.element_size() for p in layer_parameters),
                    gradient_bytes=floating_nbytes(output),
                    pass_seconds=weight_pass_seconds(layer_parameters, repeats)
                    if weight_passes
                    else None,
                    deferred_seconds=flush_seconds,
                )
            )
            current = output
    return ModelProfile(tuple(costs), nbytes(example_args), tied_layers(layers))


def _mean_of(values: Sequence[float | None]) -> float | None:
    """The mean of the measured ``values`` (``None`` where none was measured)."""
    measured = [v for v in values if v is not None]
    return sum(measured) / len(measured) if measured else None


def mean_profile(profiles: Sequence[ModelProfile]) -> ModelProfile:
    """Per-layer forward and backward times averaged over ``profiles`` (the bytes of the first).

    The ranks of a pipeline profile the same layers at the same time, each under the load the
    others put on the machine; their mean is the plan every rank then computes alike.
    """
    if not profiles:
        raise ValueError("mean_profile needs at least one profile")
    first = profiles[0]
    if any(len(p) != len(first) for p in profiles):
        raise ValueError("the profiles cover different numbers of layers")
    count = len(profiles)
    layers = tuple(
        LayerCost(
            forward_seconds=sum(p.layers[i].forward_seconds for p in profiles) / count,
            backward_seconds=sum(p.layers[i].backward_seconds for p in profiles) / count,
            activation_bytes=layer.activation_bytes,
            output_bytes=layer.output_bytes,
            parameter_bytes=layer.parameter_bytes,
            gradient_bytes=layer.gradient_bytes,
            pass_seconds=_mean_of([p.layers[i].pass_seconds for p in profiles]),
            deferred_seconds=_mean_of([p.layers[i].deferred_seconds for p in profiles]),
        )
        for i, layer in enumerate(first.layers)
    )
    return ModelProfile(layers, first.input_bytes, first.tied)


#: nominal rates that turn counted floating-point operations and bytes written into seconds
#: in :func:`estimate_layers`; only ratios between layers matter to the partition
ESTIMATE_FLOPS_PER_SECOND = 1e10
ESTIMATE_BYTES_PER_SECOND = 1e10


def _meta_like(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        meta = torch.empty_like(value, device="meta")
        return meta.requires_grad_(meta.is_floating_point())
    if isinstance(value, tuple):
        return tuple(_meta_like(item) for item in value)
    if isinstance(value, list):
        return [_meta_like(item) for item in value]
    return value


def _meta_state(layer: nn.Module) -> tuple[dict[str, torch.Tensor], set[int]]:
    """Meta stand-ins of ``layer``'s parameters and buffers (no data is copied; meta tensors
    stand for themselves), by name, and the ids of the parameters' stand-ins."""
    state: dict[str, torch.Tensor] = {}
    parameters: set[int] = set()
    for name, parameter in layer.named_parameters():
        meta = parameter if parameter.is_meta else _meta_like(parameter.detach())
        meta.requires_grad_(parameter.requires_grad)
        state[name] = meta
        parameters.add(id(meta))
    for name, buffer in layer.named_buffers():
        state[name] = buffer if buffer.is_meta else torch.empty_like(buffer, device="meta")
    return state, parameters


def estimate_layers(layers: Sequence[nn.Module], example_args: tuple[Any, ...]) -> ModelProfile:
    """Costs of every layer from shapes alone: for a model whose weights are on ``meta``, and
    for ``partition="estimate"`` (a partition that does not move with timing noise).

    A model too large to build on one rank exists only as shapes until each rank materializes
    its stage, so its layers cannot be timed. Instead, on meta tensors (a layer with real
    weights runs on meta stand-ins of them, no data copied):

    1. forward time: the floating-point operations of the forward (torch's
       ``FlopCounterMode``: matrix products and convolutions) at
       :data:`ESTIMATE_FLOPS_PER_SECOND`, plus the bytes of its output at
       :data:`ESTIMATE_BYTES_PER_SECOND` (element-wise layers cost memory traffic); backward
       time: twice that (the input and the weight gradient each cost about one forward);
    2. activation memory: bytes of the tensors autograd saves for the backward (each tensor
       once; meta tensors share no storage that could be told apart);
    3. output and parameter bytes from the shapes.

    The exact dynamic-programming split then balances these estimates.
    """
    from torch.utils.flop_counter import FlopCounterMode

    costs = []
    current: Any = _meta_like(example_args)
    for index, layer in enumerate(layers):
        inputs = _meta_like(current)
        saved: dict[int, int] = {}
        state, parameters = _meta_state(layer)

        def pack(
            tensor: torch.Tensor, saved: dict[int, int] = saved, parameters: set[int] = parameters
        ) -> torch.Tensor:
            base = tensor._base if tensor._base is not None else tensor
            if id(base) not in parameters:  # a weight (or its transposed view) is not memory
                saved[id(tensor)] = tensor.numel() * tensor.element_size()
            return tensor.detach()  # an alias: see SavedTensorMeter.pack

        counter = FlopCounterMode(display=False)
        with counter, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            arguments = inputs if index == 0 else (inputs,)
            output = torch.func.functional_call(layer, state, arguments)
        activation = sum(saved.values())
        forward_seconds = (
            counter.get_total_flops() / ESTIMATE_FLOPS_PER_SECOND
            + nbytes(output) / ESTIMATE_BYTES_PER_SECOND
        )
        costs.append(
            LayerCost(
                forward_seconds=forward_seconds,
                backward_seconds=2.0 * forward_seconds,
                activation_bytes=activation,
                output_bytes=nbytes(output),
                parameter_bytes=sum(p.numel() * p.element_size() for p in layer.parameters()),
                gradient_bytes=floating_nbytes(output),
            )
        )
        current = output
    return ModelProfile(tuple(costs), nbytes(example_args), tied_layers(layers))
