"""What one training step of a module costs, as a plain record: what every prediction is built from.

A :class:`StepProfile` holds the figures :mod:`~lightning_parallel.plan.measure` takes in one
process (forward, backward and optimizer times, parameters, optimizer state, activations,
counted operations, codec timings, per-layer costs of the chain a pipeline would split) and
those the Lightning side adds (the trainer's own time a step, peak memory). It is JSON-ready
(:meth:`StepProfile.as_dict`, :meth:`StepProfile.from_dict`), so a plan can be computed again
for another cluster without profiling again, and it can be carried to another device
(:meth:`StepProfile.scaled`, :meth:`StepProfile.on_accelerator`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from lightning_parallel.compression.low_rank import matrix_shape
from lightning_parallel.pipeline.profile import LayerCost, ModelProfile

__all__: list[str] = []

#: the order of a low-rank round trip's products (:mod:`~lightning_parallel.plan.codecs`):
#: torch's PowerSGD (``PLAIN``) or Hylo's blocked one (``BLOCKED``)
PLAIN = "plain"
BLOCKED = "blocked"


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
    #: tensors that several layers use (tied weights: a language model's head that reuses the
    #: embedding): ``(bytes, the indices of the layers using it)`` each. Every such layer's
    #: ``parameter_bytes`` counts the tensor; a pipeline keeps a copy on every stage using it.
    tied: tuple[tuple[int, tuple[int, ...]], ...] = ()

    def model_profile(self) -> ModelProfile:
        """The profile as the partitioner takes it."""
        return ModelProfile(self.layers, self.input_bytes, self.tied)


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
    #: bytes of the module's buffers (BatchNorm's running statistics and counters, masks):
    #: what DDP broadcasts from rank 0 before every training forward (``broadcast_buffers``)
    buffer_bytes: int = 0
    #: the floating-point share of them: what an averaging round averages with the parameters
    float_buffer_bytes: int = 0
    trainer_step_s: float | None = None
    base_rss_bytes: float | None = None
    peak_rss_bytes: float | None = None
    threads: int = 1
    flops: float = 0.0
    codec_seconds: dict[str, float] = field(default_factory=dict)
    hook_seconds: dict[str, float] = field(default_factory=dict)
    #: Hylo's candidates' errors on the first step's gradients, by parameter and candidate
    #: (:func:`~lightning_parallel.compression.trials.first_trial_errors`)
    codec_errors: dict[str, dict[str, float]] = field(default_factory=dict)
    compute_scale: float = 1.0
    layer_profiles: tuple[LayerProfile, ...] = ()
    pipeline_error: str | None = None
    notes: dict[str, Any] = field(default_factory=dict)

    def low_rank_s(self, shape: Sequence[int], rank: int, order: str = PLAIN) -> float:
        """One low-rank round trip's work for a gradient of ``shape`` at ``rank`` with the
        products in ``order``: from the profile
        (:func:`~lightning_parallel.plan.codecs.codec_timings`), else timed now; either at the
        profile's compute scale (:meth:`scaled`)."""
        seconds = self.codec_seconds.get(codec_key(shape, rank, order))
        if seconds is None:
            from lightning_parallel.plan.codecs import blocked_low_rank_seconds, low_rank_seconds

            timer = blocked_low_rank_seconds if order == BLOCKED else low_rank_seconds
            seconds = timer(shape, rank)
        return seconds * self.compute_scale

    def hook_s(self, name: str) -> float | None:
        """What the communication hook ``name`` measured adding to a step
        (:func:`~lightning_parallel.plan.codecs.comm_hook_seconds`), or ``"parameter_server"``:
        one in-process exchange with the shard
        (:func:`~lightning_parallel.plan.measure.parameter_server_exchange_seconds`), at the
        profile's compute scale; ``None`` where not measured."""
        seconds = self.hook_seconds.get(name)
        return None if seconds is None else seconds * self.compute_scale

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

    def slowest_replica_factor(self, replicas: int) -> float:
        """How much longer a step that waits for ``replicas`` replicas lasts than one replica's
        median step, from the spread of the profile's timed steps (``notes["step_seconds"]``).

        Each replica's step is a draw from the same distribution ``F``; the step that waits
        for all of them lasts their maximum, whose median is ``F⁻¹(0.5^(1/R))`` (``P(max ≤ x)
        = F(x)^R``): for 2 replicas the 71st percentile, for 8 the 92nd. The factor is that
        quantile over the median (quantiles interpolated between the sorted steps; past the
        slowest step seen, the slowest). 1 without the steps, for one replica, and for compute
        carried to an accelerator (:meth:`on_accelerator`: this machine's spread says nothing
        of the device's)."""
        steps = sorted(float(s) for s in self.notes.get("step_seconds") or ())
        if replicas < 2 or len(steps) < 2 or "accelerator_flops_per_second" in self.notes:
            return 1.0
        median = _quantile(steps, 0.5)
        return max(1.0, _quantile(steps, 0.5 ** (1.0 / replicas)) / median) if median > 0 else 1.0

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
                deferred_seconds=None
                if cost.deferred_seconds is None
                else cost.deferred_seconds * scale,
                activation_bytes=int(cost.activation_bytes * scale),
                output_bytes=int(cost.output_bytes * scale),
                gradient_bytes=None
                if cost.gradient_bytes is None
                else int(cost.gradient_bytes * scale),
            )
            for cost in nearest.layers
        )
        return LayerProfile(micro_batch, layers, int(nearest.input_bytes * scale), nearest.tied)

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
                p["micro_batch"],
                tuple(LayerCost(**cost) for cost in p["layers"]),
                p["input_bytes"],
                tuple((int(nbytes), tuple(where)) for nbytes, where in p.get("tied", ())),
            )
            for p in values.get("layer_profiles", ())
        )
        return cls(**values)


def _quantile(ordered: Sequence[float], q: float) -> float:
    """The ``q`` quantile of ascending ``ordered``, linear between neighbours."""
    position = q * (len(ordered) - 1)
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def codec_key(shape: Sequence[int], rank: int, order: str = PLAIN) -> str:
    """The key of a low-rank timing: the matrix's ``rows x cols``, the rank, the order of the
    products (the plain order unmarked)."""
    rows, cols = matrix_shape(tuple(int(size) for size in shape))
    key = f"{rows}x{cols}@{min(rank, rows, cols)}"
    return key if order == PLAIN else f"{order}:{key}"
