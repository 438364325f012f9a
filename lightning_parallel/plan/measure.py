"""Measure one training step of a module in one process: what every prediction is built from.

:func:`profile_step` runs the module's ``training_step`` on one batch, the way a trainer does,
and measures (each the median of ``repeats`` timed runs after ``warmup`` untimed ones; a
machine shared with other work only adds time to a run, and the median keeps a step's typical
cost where the minimum would keep its luckiest):

1. ``forward_s``: ``training_step(batch)`` up to the loss;
2. ``backward_s``: ``loss.backward()``;
3. ``optimizer_s``: ``optimizer.step()`` and ``optimizer.zero_grad()``;
4. the trainable parameters' names, shapes and bytes (gradients are the same bytes), the
   optimizer's state bytes after a step, the activation bytes autograd saves for the
   backward (:class:`~lightning_parallel.pipeline.profile.SavedTensorMeter`), and the bytes
   of the module's buffers (what DDP broadcasts before every training forward);
5. the floating-point operations of the forward and backward (torch's ``FlopCounterMode``:
   matrix products and convolutions), for
   :meth:`~lightning_parallel.plan.profile.StepProfile.on_accelerator`;
6. for the pipelines, per-layer costs of the module the pipeline would split
   (:func:`pipeline_layers`, found the way the pipeline strategies find it), at each
   micro-batch size asked for.

What the trainer adds around these (its loop, hooks and logging) is not plain torch: the
Lightning side measures it with a real one-process ``fit`` and puts it in ``trainer_step_s``
and the memory figures (``base_rss_bytes``, ``peak_rss_bytes``). The figures go into a
:class:`~lightning_parallel.plan.profile.StepProfile`.
"""

from __future__ import annotations

import copy
import statistics
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from lightning_parallel.pipeline.discovery import discover, static_target
from lightning_parallel.pipeline.export_split import split_layers, stage_zero_inputs
from lightning_parallel.pipeline.microbatch import split_microbatches
from lightning_parallel.pipeline.patching import capture_call, patched
from lightning_parallel.pipeline.profile import LayerCost, SavedTensorMeter, clock, profile_layers
from lightning_parallel.plan.profile import LayerProfile, ParameterShape, StepProfile

__all__: list[str] = []


def loss_of(output: Any) -> torch.Tensor:
    """The loss in what ``training_step`` returned: a tensor, or a mapping's ``"loss"``."""
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, dict) and isinstance(output.get("loss"), torch.Tensor):
        return output["loss"]
    raise ValueError(
        "training_step must return the loss (a tensor, or a dict with 'loss') to be profiled; "
        f"it returned {type(output).__name__}"
    )


def _median_seconds(samples: Sequence[float]) -> float:
    return float(statistics.median(samples))


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of the tensors in the optimizer's per-parameter state."""
    return sum(
        value.numel() * value.element_size()
        for state in optimizer.state.values()
        for value in state.values()
        if isinstance(value, torch.Tensor)
    )


def trainable_parameters(module: nn.Module) -> tuple[ParameterShape, ...]:
    """Every trainable parameter, each once, in registration order."""
    return tuple(
        ParameterShape(name, tuple(p.shape), p.element_size())
        for name, p in module.named_parameters()
        if p.requires_grad
    )


def profile_step(
    module: nn.Module,
    batch: Any,
    optimizer: torch.optim.Optimizer,
    *,
    step_args: tuple[Any, ...] = (0,),
    repeats: int = 10,
    warmup: int = 2,
    batch_size: int | None = None,
) -> StepProfile:
    """Time ``module.training_step(batch, *step_args)``, its backward and ``optimizer``'s step.

    The module trains meanwhile (``warmup + repeats`` real steps on one batch): profile a copy
    where the weights matter. ``module.log`` does nothing during the runs.
    """
    if repeats < 1 or warmup < 0:
        raise ValueError(f"repeats must be >= 1 and warmup >= 0, got {repeats} and {warmup}")
    module.train()
    forward: list[float] = []
    backward: list[float] = []
    stepping: list[float] = []
    step = module.training_step
    if not callable(step):
        raise TypeError(f"{type(module).__name__} has no training_step to profile")
    with (
        patched(module, "log", lambda *a, **k: None),
        patched(module, "log_dict", lambda *a, **k: None),
    ):
        for index in range(warmup + repeats):
            start = clock()
            loss = loss_of(step(batch, *step_args))
            middle = clock()
            loss.backward()
            end = clock()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            done = clock()
            if index >= warmup:
                forward.append(middle - start)
                backward.append(end - middle)
                stepping.append(done - end)
        meter = SavedTensorMeter([p for p in module.parameters()])
        counter = FlopCounterMode(display=False)
        with meter.hooks(), counter:
            loss = loss_of(step(batch, *step_args))
            loss.backward()
        optimizer.zero_grad(set_to_none=True)
        del loss
    return StepProfile(
        batch_size=batch_size if batch_size is not None else _batch_size(batch),
        forward_s=_median_seconds(forward),
        backward_s=_median_seconds(backward),
        optimizer_s=_median_seconds(stepping),
        parameters=trainable_parameters(module),
        optimizer_state_bytes=optimizer_state_bytes(optimizer),
        activation_bytes=meter.bytes,
        buffer_bytes=sum(b.numel() * b.element_size() for b in module.buffers()),
        float_buffer_bytes=sum(
            b.numel() * b.element_size() for b in module.buffers() if b.is_floating_point()
        ),
        threads=torch.get_num_threads(),
        flops=float(counter.get_total_flops()),
    )


def _batch_size(batch: Any) -> int:
    from lightning_parallel.pipeline.microbatch import batch_size

    return int(batch_size(batch))


def pipeline_layers(
    module: nn.Module,
    batch: Any,
    micro_batches: Sequence[int],
    *,
    step_args: tuple[Any, ...] = (0,),
    repeats: int = 5,
) -> tuple[tuple[LayerProfile, ...], str | None]:
    """Per-layer costs of the chain a pipeline would split, one profile for each number of
    micro-batches in ``micro_batches`` (the batch split that many ways), found as the pipeline
    strategies find it (:mod:`~lightning_parallel.pipeline.discovery`, then fx or
    torch.export). Returns the profiles and ``None``, or no profile and the reason the model
    cannot be split (the pipelines would refuse it the same way).

    With more than one micro-batch the chain is timed as GroPipe runs it (on a copy): linear
    layers keep their weight gradients for one product over the step's micro-batches
    (:mod:`~lightning_parallel.pipeline.weight_grad`) and BatchNorm defers its statistics
    (:mod:`~lightning_parallel.pipeline.batchnorm`); a weight gradient that does not grow with
    the micro-batch would otherwise be counted once per micro-batch."""
    from lightning_parallel.pipeline.batchnorm import convert_deferred_batch_norm
    from lightning_parallel.pipeline.stages import PipelineSplitError
    from lightning_parallel.pipeline.weight_grad import convert_deferred_weight_gradients

    profiles: list[LayerProfile] = []
    try:
        with torch.enable_grad():
            for count in sorted(set(micro_batches)):
                micro = split_microbatches(batch, count)[0]
                owner = copy.deepcopy(module) if count > 1 else module
                target = static_target(owner, None) or discover(
                    owner, "training_step", micro, step_args
                )
                if count > 1:
                    convert_deferred_batch_norm(target.module)
                    convert_deferred_weight_gradients(target.module)
                args, kwargs = capture_call(owner, target.module, "training_step", micro, step_args)
                call, inputs = stage_zero_inputs(None, False, args, kwargs)
                layers, _, example = split_layers(target.module, inputs, call)
                profile = profile_layers(
                    layers, example, repeats=repeats, micro_batches=count, weight_passes=True
                )
                costs = _to_chain_time(profile.layers, chain_seconds(layers, example, count))
                profiles.append(
                    LayerProfile(_batch_size(micro), costs, profile.input_bytes, profile.tied)
                )
    except (PipelineSplitError, ValueError, RuntimeError) as error:
        return (), f"{type(error).__name__}: {error}"
    return tuple(profiles), None


def chain_seconds(layers: Sequence[nn.Module], example: Any, micro_batches: int) -> float:
    """Forward and backward of the whole chain on one micro-batch, timed as one block (the
    median of 3 after a warm-up), and a ``micro_batches``-th of the deferred weight gradients'
    flush over ``micro_batches`` micro-batches' rows, as a step flushes them.

    Timing layers one by one adds each layer's own call and graph overhead and starts each on
    cold caches: on ``gpt`` at micro-batches of 8 the layers summed 22.6 ms where the chain
    took about 17 (GroPipe measured 16.5 ms a micro-batch for a stage of nearly all of it;
    timed when this machine ran the same steps about 2.5x slower than it does now).

    Each pass starts with the gradients cleared, as a training step does after ``zero_grad``:
    a gradient is then created, not added to, and a deferred linear layer's flush writes its
    product as the gradient instead of adding a temporary copy to one (``vgg_mini``'s
    2048 x 4096 layer: a 32 MiB temporary, above what a process keeps for reuse, see
    :mod:`~lightning_parallel.cpu_memory`). On ``vgg_mini`` at micro-batches of 8 the chain
    took 31.5 ms with the gradients kept between passes and 28.3 ms cleared; GroPipe's two
    stages measured 27.0 and 28.3 ms a micro-batch together in two runs.

    The flush is one product over the rows it is given, so it grows with the micro-batches
    (``vgg_mini``'s, whose cost is writing the 32 MiB gradient, hardly does). Timed over this
    pass's one micro-batch and divided by their count, ``gpt``'s chain at micro-batches of 8
    came to 6.8 ms; over four micro-batches' rows, 8.4. GroPipe's two stages, traced on a
    timeline at 1 Gbit/s, took 3.7 and 4.6 ms a micro-batch, their flushes 0.7 and 1.0 of it
    (the chain's split: 0.7 and 1.0 in one profile, 0.7 and 0.8 in another)."""
    from lightning_parallel.pipeline.profile import (
        backward_ones,
        call_layer,
        received_input,
        timing_passes,
    )
    from lightning_parallel.pipeline.weight_grad import deferred_linears, deferring_weight_gradients

    deferred = [linear for layer in layers for linear in deferred_linears(layer)]
    samples = []
    with timing_passes(layers) as parameters:
        for index in range(4):
            for parameter in parameters:  # each pass is a step's: after zero_grad
                parameter.grad = None
            start = clock()
            with deferring_weight_gradients(bool(deferred)):
                current: Any = received_input(example)
                for position, layer in enumerate(layers):
                    current = call_layer(layer, current, position == 0)
                backward_ones(current)
            # a step's flush takes the pairs of all its micro-batches: one product over their
            # rows, which grows with them (this pass kept one micro-batch's pair)
            for linear in deferred:
                linear.pending[:] = linear.pending[:1] * max(1, micro_batches)
            middle = clock()
            for linear in deferred:
                linear.flush()
            flush = clock() - middle
            if index:
                samples.append(middle - start + flush / max(1, micro_batches))
    return _median_seconds(samples)


def _to_chain_time(costs: Sequence[LayerCost], chain: float) -> tuple[LayerCost, ...]:
    """``costs`` with every layer's times scaled so that they add up to ``chain``."""
    total = sum(cost.seconds for cost in costs)
    if total <= 0 or chain <= 0:
        return tuple(costs)
    scale = chain / total
    return tuple(
        replace(
            cost,
            forward_seconds=cost.forward_seconds * scale,
            backward_seconds=cost.backward_seconds * scale,
            deferred_seconds=None
            if cost.deferred_seconds is None
            else cost.deferred_seconds * scale,
        )
        for cost in costs
    )


def parameter_server_exchange_seconds(optimizer: torch.optim.Optimizer, repeats: int = 4) -> float:
    """One exchange of the worker beside the parameter server's shard, in-process: its
    gradients flattened, applied by the real shard
    (:class:`~lightning_parallel.parameter_server.server.ShardServer`, the optimizer's class
    and hyperparameters), the version's snapshot, the weights copied back; the median of
    ``repeats`` after one untimed. On copies of the optimizer's parameters (the module is not
    changed; on the CPU, where the shards are, whatever the module's device)."""
    from lightning_parallel.parameter_server.layout import copy_flat_to, flatten_gradients
    from lightning_parallel.parameter_server.policies import UpdatePolicy
    from lightning_parallel.parameter_server.protocol import Request, RequestFlag, RequestKind
    from lightning_parallel.parameter_server.server import ShardServer
    from lightning_parallel.parameter_server.shard_optimizer import (
        optimizer_factory,
        trained_parameters,
    )

    parameters = [p.detach().to("cpu", copy=True) for p in trained_parameters(optimizer)]
    server = ShardServer(parameters, optimizer_factory(optimizer, 0), UpdatePolicy(), [0])
    (reply,) = server.handle(Request(RequestKind.BEGIN, 0))
    for parameter in parameters:
        parameter.grad = torch.full_like(parameter, 1e-6)
    flat = torch.zeros(sum(p.numel() for p in parameters), dtype=parameters[0].dtype)
    seconds: list[float] = []
    for index in range(repeats + 1):
        start = clock()
        flatten_gradients(flat, parameters)
        request = Request(
            RequestKind.STEP, 0, reply.version, RequestFlag.HAS_GRADIENT, gradient=flat
        )
        (reply,) = server.handle(request)
        copy_flat_to(reply.weights, parameters)
        if index:
            seconds.append(clock() - start)
    return _median_seconds(seconds)
