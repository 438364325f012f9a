"""Profile one training step of a module in one process: what every prediction is built from.

:func:`profile_step` runs the module's ``training_step`` on one batch, the way a trainer does,
and measures (each the median of ``repeats`` timed runs after ``warmup`` untimed ones; a
machine shared with other work only adds time to a run, and the median keeps a step's typical
cost where the minimum would keep its luckiest):

1. ``forward_s``: ``training_step(batch)`` up to the loss;
2. ``backward_s``: ``loss.backward()``;
3. ``optimizer_s``: ``optimizer.step()`` and ``optimizer.zero_grad()``;
4. the trainable parameters' names, shapes and bytes (gradients are the same bytes), the
   optimizer's state bytes after a step, and the activation bytes autograd saves for the
   backward (:class:`~lightning_parallel.pipeline.profile.SavedTensorMeter`);
5. the floating-point operations of the forward and backward (torch's ``FlopCounterMode``:
   matrix products and convolutions), for :meth:`StepProfile.on_accelerator`;
6. for the pipelines, per-layer costs of the module the pipeline would split
   (:func:`pipeline_layers`, found the way the pipeline strategies find it), at each
   micro-batch size asked for.

What the trainer adds around these (its loop, hooks and logging) is not plain torch: the
Lightning side measures it with a real one-process ``fit`` and puts it in ``trainer_step_s``
and the memory figures (``base_rss_bytes``, ``peak_rss_bytes``). A profile is a plain,
JSON-ready record (:meth:`StepProfile.as_dict`, :meth:`StepProfile.from_dict`), so a plan
can be computed again for another cluster without profiling again.
"""

from __future__ import annotations

import copy
import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from lightning_parallel.pipeline.discovery import discover, static_target
from lightning_parallel.pipeline.export_split import split_layers, stage_zero_inputs
from lightning_parallel.pipeline.microbatch import split_microbatches
from lightning_parallel.pipeline.patching import capture_call, patched
from lightning_parallel.pipeline.profile import (
    LayerCost,
    ModelProfile,
    SavedTensorMeter,
    clock,
    profile_layers,
)

__all__: list[str] = []


@dataclass(frozen=True)
class ParameterShape:
    """One trainable parameter: its name, shape and bytes per element."""

    name: str
    shape: tuple[int, ...]
    element_bytes: int = 4

    @property
    def numel(self) -> int:
        count = 1
        for size in self.shape:
            count *= size
        return count

    @property
    def nbytes(self) -> int:
        return self.numel * self.element_bytes


@dataclass(frozen=True)
class LayerProfile:
    """Per-layer costs of the pipeline's layer chain at one micro-batch size."""

    micro_batch: int
    layers: tuple[LayerCost, ...]
    input_bytes: int

    def model_profile(self) -> ModelProfile:
        """The profile as the partitioner takes it."""
        return ModelProfile(self.layers, self.input_bytes)


@dataclass(frozen=True)
class StepProfile:
    """One training step of a module, measured in one process (see the module docstring)."""

    batch_size: int
    forward_s: float
    backward_s: float
    optimizer_s: float
    parameters: tuple[ParameterShape, ...]
    optimizer_state_bytes: int
    activation_bytes: int
    trainer_step_s: float | None = None
    base_rss_bytes: float | None = None
    peak_rss_bytes: float | None = None
    threads: int = 1
    flops: float = 0.0
    codec_seconds: dict[str, float] = field(default_factory=dict)
    compute_scale: float = 1.0
    layer_profiles: tuple[LayerProfile, ...] = ()
    pipeline_error: str | None = None
    notes: dict[str, Any] = field(default_factory=dict)

    def low_rank_s(self, shape: Sequence[int], rank: int) -> float:
        """One low-rank round trip's work for a gradient of ``shape`` at ``rank``: from the
        profile (:func:`codec_timings`), else timed now; either at the profile's compute
        scale (:meth:`scaled`)."""
        key = codec_key(shape, rank)
        seconds = self.codec_seconds.get(key)
        if seconds is None:
            seconds = low_rank_seconds(shape, rank)
        return seconds * self.compute_scale

    @property
    def parameter_bytes(self) -> int:
        return sum(p.nbytes for p in self.parameters)

    @property
    def compute_s(self) -> float:
        """Forward, backward and optimizer step."""
        return self.forward_s + self.backward_s + self.optimizer_s

    @property
    def overhead_s(self) -> float:
        """What the trainer adds per step around the compute (0 where not measured)."""
        if self.trainer_step_s is None:
            return 0.0
        return max(0.0, self.trainer_step_s - self.compute_s)

    @property
    def step_s(self) -> float:
        """One process's step: compute and the trainer's overhead."""
        return self.compute_s + self.overhead_s

    def scaled(self, factor: float) -> StepProfile:
        """This profile with its compute (forward, backward, optimizer, every layer) ``factor``
        times as long; memory and the trainer's own time kept."""
        layers = tuple(
            replace(
                profile,
                layers=tuple(
                    replace(
                        cost,
                        forward_seconds=cost.forward_seconds * factor,
                        backward_seconds=cost.backward_seconds * factor,
                    )
                    for cost in profile.layers
                ),
            )
            for profile in self.layer_profiles
        )
        trainer = None if self.trainer_step_s is None else self.overhead_s + self.compute_s * factor
        return replace(
            self,
            forward_s=self.forward_s * factor,
            backward_s=self.backward_s * factor,
            optimizer_s=self.optimizer_s * factor,
            trainer_step_s=trainer,
            layer_profiles=layers,
            compute_scale=self.compute_scale * factor,
        )

    def on_accelerator(
        self, flops_per_second: float, overhead_s: float | None = None
    ) -> StepProfile:
        """This profile with its compute on a device that runs the counted operations at
        ``flops_per_second`` (its peak times the utilization the user expects): compute scaled
        by one factor (:meth:`scaled`), the counted operations' time over the measured time;
        ``overhead_s``: the trainer's own time a step on that host (default: as measured
        here). A prediction from it is a prediction, not a calibration: the factor holds only
        where the device's speed on this model's operations is what is given."""
        if self.flops <= 0 or flops_per_second <= 0:
            raise ValueError("on_accelerator needs counted operations and a positive rate")
        factor = self.flops / flops_per_second / max(1e-12, self.forward_s + self.backward_s)
        faster = self.scaled(factor)
        trainer = faster.trainer_step_s
        if overhead_s is not None:
            trainer = faster.compute_s + overhead_s
        return replace(
            faster,
            trainer_step_s=trainer,
            notes={**self.notes, "accelerator_flops_per_second": flops_per_second},
        )

    def layers_at(self, micro_batch: int) -> LayerProfile | None:
        """The layer profile at ``micro_batch`` samples, or the nearest one scaled to it
        (times and activation/output bytes in proportion to the samples)."""
        if not self.layer_profiles:
            return None
        nearest = min(self.layer_profiles, key=lambda p: abs(p.micro_batch - micro_batch))
        if nearest.micro_batch == micro_batch:
            return nearest
        scale = micro_batch / nearest.micro_batch
        layers = tuple(
            replace(
                cost,
                forward_seconds=cost.forward_seconds * scale,
                backward_seconds=cost.backward_seconds * scale,
                activation_bytes=int(cost.activation_bytes * scale),
                output_bytes=int(cost.output_bytes * scale),
            )
            for cost in nearest.layers
        )
        return LayerProfile(micro_batch, layers, int(nearest.input_bytes * scale))

    def as_dict(self) -> dict[str, Any]:
        """A JSON-ready record."""
        return asdict(self)

    @classmethod
    def from_dict(cls, record: dict[str, Any]) -> StepProfile:
        """The profile :meth:`as_dict` wrote."""
        values = dict(record)
        values["parameters"] = tuple(
            ParameterShape(p["name"], tuple(p["shape"]), p["element_bytes"])
            for p in values["parameters"]
        )
        values["layer_profiles"] = tuple(
            LayerProfile(
                p["micro_batch"], tuple(LayerCost(**cost) for cost in p["layers"]), p["input_bytes"]
            )
            for p in values.get("layer_profiles", ())
        )
        return cls(**values)


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
                profile = profile_layers(layers, example, repeats=repeats, micro_batches=count)
                costs = _to_chain_time(profile.layers, chain_seconds(layers, example, count))
                profiles.append(LayerProfile(_batch_size(micro), costs, profile.input_bytes))
    except (PipelineSplitError, ValueError, RuntimeError) as error:
        return (), f"{type(error).__name__}: {error}"
    return tuple(profiles), None


def chain_seconds(layers: Sequence[nn.Module], example: Any, micro_batches: int) -> float:
    """Forward and backward of the whole chain on one micro-batch, timed as one block (the
    median of 3 after a warm-up), deferred weight gradients' flush shared by ``micro_batches``.

    Timing layers one by one adds each layer's own call and graph overhead and starts each on
    cold caches: on ``gpt`` at micro-batches of 8 the layers summed 22.6 ms where the chain
    took about 17 (GroPipe measured 16.5 ms a micro-batch for a stage of nearly all of it)."""
    from lightning_parallel.pipeline.profile import (
        backward_ones,
        call_layer,
        received_input,
        timing_passes,
    )
    from lightning_parallel.pipeline.weight_grad import deferred_linears, deferring_weight_gradients

    deferred = [linear for layer in layers for linear in deferred_linears(layer)]
    samples = []
    with timing_passes(layers):
        for index in range(4):
            start = clock()
            with deferring_weight_gradients(bool(deferred)):
                current: Any = received_input(example)
                for position, layer in enumerate(layers):
                    current = call_layer(layer, current, position == 0)
                backward_ones(current)
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
        )
        for cost in costs
    )


def low_rank_seconds(shape: Sequence[int], rank: int, repeats: int = 3) -> float:
    """Time of one low-rank round trip of a gradient of ``shape`` at ``rank`` on this process
    (PowerSGD's and Hylo's work per layer and step, the allreduces aside): ``M = g + e``,
    ``P = M Q``, orthonormalize ``P``, ``Q = M^T P``, ``P Q^T`` and the residual ``M - P Q^T``.
    The median of ``repeats`` runs after one warm-up."""
    rows = int(shape[0])
    cols = 1
    for size in shape[1:]:
        cols *= int(size)
    r = max(1, min(rank, rows, cols))
    grad, error = torch.randn(rows, cols), torch.zeros(rows, cols)
    q = torch.randn(cols, r)
    samples = []
    for index in range(repeats + 1):
        start = clock()
        matrix = grad + error
        p = torch.linalg.qr(matrix @ q).Q
        q = matrix.T @ p
        error = matrix - p @ q.T
        if index:
            samples.append(clock() - start)
    return _median_seconds(samples)


def codec_key(shape: Sequence[int], rank: int) -> str:
    """The key of a low-rank timing: the matrix's ``rows x cols`` and the rank."""
    rows = int(shape[0])
    cols = 1
    for size in shape[1:]:
        cols *= int(size)
    return f"{rows}x{cols}@{min(rank, rows, cols)}"


def codec_timings(
    parameters: Sequence[ParameterShape], ranks: Sequence[int] = (2, 8)
) -> dict[str, float]:
    """:func:`low_rank_seconds` of every distinct matrix shape among ``parameters`` (two or
    more dimensions) at each of ``ranks`` (PowerSGD's default 2, Hylo's 8)."""
    timings: dict[str, float] = {}
    for parameter in parameters:
        if len(parameter.shape) < 2:
            continue
        for rank in ranks:
            key = codec_key(parameter.shape, rank)
            if key not in timings:
                timings[key] = low_rank_seconds(parameter.shape, rank)
    return timings
