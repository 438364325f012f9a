"""Run one stage of a pipeline that never flushes: the forward of one micro-batch, the backward
of another, and a weight update after every backward (SpecTrain, PipeDream).

Every micro-batch is one update unit, numbered ``u = 0, 1, 2, ...`` across ``step`` calls. At
unit ``u`` stage ``k`` of ``N`` runs ``F(u)`` then ``B(u - (N-k-1))`` and this stage's
optimizer update. Micro-batches stay in flight from one ``step`` call to the next; only
:meth:`NoFlushPipeline.drain` (epoch end, before validation or a checkpoint) runs the pending
backwards without new forwards. Between two drains the order of every stage is the 1F1B table
of :mod:`lightning_parallel.pipeline.schedule` over all the units, one long pipeline with a
single fill and a single drain instead of one per step. ``render`` of 3 stages, 6 units
(``U`` marks this stage's update, which follows each ``B``)::

    stage 0 | F0 F1 F2 .. .. B0 F3 B1 F4 B2 F5 B3 .. B4 .. B5
    stage 1 | .. F0 F1 .. B0 F2 B1 F3 B2 F4 B3 F5 B4 .. B5 ..
    stage 2 | .. .. F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5 .. ..

In steady state no stage idles. The price: between ``F(u)`` and ``B(u)`` stage ``k`` applies
the updates of ``N-k-1`` other units, so ``u``'s gradient is ``N-k-1`` updates stale (measured
in :attr:`NoFlushPipeline.staleness`); a :class:`~.predictors.WeightPredictor` chooses the
weights each pass uses to correct it.

How a pass runs on chosen weights:

1. ``forward_weights(u)`` is loaded into the parameters (``parameter.data``, no copy) for the
   forward, the live weights are put back after it;
2. during the forward a saved-tensor hook replaces every saved view of a parameter by a
   reference to the parameter slot, so the graph holds no weight copy and the optimizer's
   in-place updates of the live weights do not invalidate it;
3. ``backward_weights(u)`` is loaded for the backward: the references resolve to those weights.

With ``track_norms`` each update's gradient norm over all stages is estimated without waiting,
for gradient clipping by norm (:class:`~.norms.GlobalNormEstimate`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_parallel.comm.devices import to_group
from lightning_parallel.pipeline.noflush.norms import GlobalNormEstimate
from lightning_parallel.pipeline.noflush.predictors import WeightPredictor
from lightning_parallel.pipeline.stage_entry import stage_inputs
from lightning_parallel.pipeline.timeline import Clock, TimelineEvent
from lightning_parallel.pipeline.transport import StageTransport, stage_output_tensors

__all__: list[str] = []

LossFunction = Callable[[Callable[..., Any], int], Tensor]
"""``loss_fn(forward, i)``: call ``forward(*model_inputs)`` once (the inputs are ignored on a
stage that receives activations) and return the loss of micro-batch ``i`` of the step."""


@dataclass
class _InFlight:
    inputs: list[Tensor]  # received activations (leaves) or the model inputs on stage 0
    outputs: list[Tensor]  # stage outputs, or the loss on the last stage
    updates_at_forward: int


@dataclass
class StageTelemetry:
    """What a stage measured since the last :meth:`NoFlushPipeline.pop_telemetry`."""

    staleness_mean: float | None
    staleness_max: int | None
    prediction_error: float | None
    stale_error: float | None
    bubble_fraction: float | None
    weight_bytes_peak: int
    units: int


class NoFlushPipeline:
    """One stage of the asynchronous 1F1B pipeline; call :meth:`step` on every stage alike.

    Args:
        module: this stage's layers.
        stage: this stage's index k (0-based).
        stages: the number of stages N.
        optimizer: updates this stage's parameters (parameters of other stages it holds have no
            gradient and are skipped).
        predictor: weight correction (default: none, the stale weights).
        transport: point-to-point link to the neighbouring stages (None when ``stages == 1``).
        data_parallel_group: the same stage of every pipeline replica; gradients are averaged
            over it before every update (None: one replica).
        before_update: called with this stage's parameters after the gradient is final and
            before the update (gradient clipping).
        record_timeline: keep :class:`~lightning_parallel.pipeline.timeline.TimelineEvent` s
            (kinds F, B, U for the update, wait) for
            :func:`~lightning_parallel.pipeline.timeline.plot_timeline`.
        rank: global rank, for the timeline.
        parameters: the parameters this stage updates (default: the module's); add those used
            only by the loss on the last stage.
        track_norms: estimate the norm of each update's gradient over all stages, for gradient
            clipping by norm (:attr:`global_norm`, see :class:`~.norms.GlobalNormEstimate`).

    Example::

        # on every rank of a 2-stage pipeline (torch.distributed initialised)
        stage = dist.get_rank()
        module = split_stages(layers, [2])[stage]
        optimizer = torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.9)
        pipeline = NoFlushPipeline(
            module, stage=stage, stages=2, optimizer=optimizer,
            predictor=make_weight_predictor("v2", list(module.parameters()), optimizer,
                                            stage=stage, stages=2),
            transport=StageTransport(stage, [0, 1]),
        )
        for x, y in loader:  # micro-batches stay in flight across these calls
            pipeline.step(1, inputs=[(x,)] if stage == 0 else None,
                          loss_fn=(lambda forward, i: F.cross_entropy(forward(x), y))
                          if stage == 1 else None)
        pipeline.drain()  # epoch end: every micro-batch applied exactly once
    """

    def __init__(
        self,
        module: nn.Module,
        *,
        stage: int,
        stages: int,
        optimizer: Optimizer,
        predictor: WeightPredictor | None = None,
        transport: StageTransport | None = None,
        data_parallel_group: dist.ProcessGroup | None = None,
        before_update: Callable[[list[nn.Parameter]], None] | None = None,
        record_timeline: bool = False,
        rank: int = 0,
        parameters: Sequence[nn.Parameter] | None = None,
        track_norms: bool = False,
    ) -> None:
        if not 0 <= stage < stages:
            raise ValueError(f"stage must be in [0, {stages}), got {stage}")
        if stages > 1 and transport is None:
            raise ValueError(
                f"a pipeline of {stages} stages needs a StageTransport between them; pass "
                "transport=StageTransport(stage, stage_ranks)"
            )
        self.module = module
        self.stage = stage
        self.stages = stages
        self.optimizer = optimizer
        chosen = module.parameters() if parameters is None else parameters
        self.parameters = [p for p in chosen if p.requires_grad]
        self.predictor = predictor or WeightPredictor(self.parameters, stage=stage, stages=stages)
        self.transport = transport
        self.data_parallel_group = data_parallel_group
        self.before_update = before_update
        self.record_timeline = record_timeline
        self.lag = stages - stage - 1
        self.next_unit = 0  # the unit the next forward runs
        self.fill_start = 0  # the first unit since the last drain
        self.in_flight: dict[int, _InFlight] = {}
        self.staleness: list[int] = []  # per applied unit, updates between its F and its update
        self.forward_units: list[int] = []
        self.backward_units: list[int] = []
        self.timeline: list[TimelineEvent] = []
        self.rank = rank
        self._clock = Clock()
        self._accumulated: list[int] = []  # updates_at_forward of units whose gradient waits
        self.track_norms = track_norms
        self.norms = GlobalNormEstimate(stage, stages, transport)
        self.losses: list[Tensor] = []
        self._busy = 0.0
        self._waiting = 0.0
        self._telemetry_from = 0

    @property
    def first(self) -> bool:
        return self.stage == 0

    @property
    def last(self) -> bool:
        return self.stage == self.stages - 1

    @property
    def updates(self) -> int:
        """Optimizer updates applied at this stage so far."""
        return self.predictor.updates

    @property
    def global_norm(self) -> float:
        """The estimated norm of the gradient of the update being applied, over all stages
        (``track_norms``; nan before the first update)."""
        return self.norms.global_norm

    @property
    def norm_history(self) -> list[tuple[float, float]]:
        """Per update, this stage's squared gradient norm and the estimated squared norm over
        all stages (``track_norms``)."""
        return self.norms.history

    # ----------------------------------------------------------------------------- weights
    def _load(self, weights: list[Tensor] | None) -> list[Tensor] | None:
        if weights is None:
            return None
        live = [p.data for p in self.parameters]
        for p, w in zip(self.parameters, weights):
            p.data = w
        return live

    def _restore(self, live: list[Tensor] | None) -> None:
        if live is not None:
            for p, w in zip(self.parameters, live):
                p.data = w

    @contextmanager
    def _weights(self, weights: list[Tensor] | None) -> Iterator[None]:
        live = self._load(weights)
        try:
            yield
        finally:
            self._restore(live)

    @contextmanager
    def _parameter_references(self) -> Iterator[None]:
        """Save parameter views in the graph as references to the parameter slots."""
        slots = {p.untyped_storage().data_ptr(): i for i, p in enumerate(self.parameters)}
        params = self.parameters

        def pack(tensor: Tensor) -> Any:
            # an alias, never the tensor itself: a saved *output* returned as is references
            # its own graph node through the hook, a cycle no garbage collector sees (every
            # micro-batch's activations would leak)
            if tensor.numel() == 0:
                return tensor.detach()
            slot = slots.get(tensor.untyped_storage().data_ptr())
            if slot is None:
                return tensor.detach()
            offset = tensor.storage_offset() - params[slot].storage_offset()
            return (slot, tuple(tensor.shape), tensor.stride(), offset)

        def unpack(saved: Any) -> Tensor:
            if isinstance(saved, Tensor):
                return saved
            slot, shape, stride, offset = saved
            parameter = params[slot].detach()
            return parameter.as_strided(shape, stride, parameter.storage_offset() + offset)

        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            yield

    # ----------------------------------------------------------------------------- passes
    def _event(self, kind: str, unit: int, start: float) -> float:
        end = time.perf_counter()
        if self.record_timeline:
            wall = self._clock.wall
            self.timeline.append(
                TimelineEvent(self.rank, self.stage, kind, unit, wall(start), wall(end))
            )
        if kind == "wait":
            self._waiting += end - start
        else:
            self._busy += end - start
        return end

    def _forward(self, unit: int, index: int, inputs: Any, loss_fn: LossFunction | None) -> None:
        received: list[Tensor] = []
        arrived: tuple[Any, ...] = ()
        if not self.first:
            assert self.transport is not None
            start = time.perf_counter()
            activation, _ = self.transport.recv_activations()
            if self.track_norms:
                self.norms.receive_total()
            self._event("wait", unit, start)
            received = list(activation) if isinstance(activation, tuple) else [activation]
            # one argument (a tuple where a cut carries several tensors), changeable in place
            arrived = (stage_inputs(activation),)
        start = time.perf_counter()
        weights = self.predictor.forward_weights(unit)
        outputs: list[Tensor]
        with self._weights(weights), self._parameter_references():
            if self.last:
                if loss_fn is None:
                    raise ValueError("the last stage needs loss_fn to turn its output into a loss")
                calls = 0

                def forward(*model_inputs: Any) -> Any:
                    nonlocal calls
                    calls += 1
                    arguments = tuple(model_inputs) if self.first else arrived
                    return self.module(*arguments)

                loss = loss_fn(forward, index)
                if calls != 1:
                    raise RuntimeError(
                        f"loss_fn must call the model forward exactly once per micro-batch, it "
                        f"called it {calls} times"
                    )
                if not isinstance(loss, Tensor) or loss.dim() != 0:
                    raise TypeError("loss_fn must return a scalar tensor (the micro-batch loss)")
                outputs = [loss]
                self.losses.append(loss.detach())
            else:
                arguments = inputs if self.first else arrived
                output = self.module(*arguments)
                outputs, _ = stage_output_tensors(output, self.stage)
        if not self.last:
            assert self.transport is not None
            self.transport.send_activations(output)
            if self.track_norms:
                self.norms.send_total()
        self.in_flight[unit] = _InFlight(received, outputs, self.updates)
        self.forward_units.append(unit)
        self._event("F", unit, start)

    def _backward(self, unit: int) -> None:
        flight = self.in_flight.pop(unit)
        needing = [o for o in flight.outputs if o.requires_grad]
        gradients: list[Tensor] | None = None
        if not self.last:
            assert self.transport is not None
            start = time.perf_counter()
            gradients, _ = self.transport.recv_gradients(needing)
            self._event("wait", unit, start)
        start = time.perf_counter()
        weights = self.predictor.backward_weights(unit)
        with self._weights(weights):
            if needing:
                torch.autograd.backward(needing, gradients)
        if not self.first:
            assert self.transport is not None
            inputs = [t for t in flight.inputs if t.requires_grad]
            self.transport.send_gradients(
                [t.grad if t.grad is not None else torch.zeros_like(t) for t in inputs]
            )
        self.predictor.release(unit)
        self.backward_units.append(unit)
        start = self._event("B", unit, start)
        self._accumulated.append(flight.updates_at_forward)
        if len(self._accumulated) == self.predictor.update_period:
            self._update()
            self._event("U", unit, start)

    def _update(self) -> None:
        # staleness of each unit applied now: updates between its forward and this update
        self.staleness += [self.updates - at_forward for at_forward in self._accumulated]
        scale = 1.0 / len(self._accumulated)
        self._accumulated = []
        grads = [p.grad for p in self.parameters if p.grad is not None]
        if scale != 1.0:
            torch._foreach_mul_(grads, scale)
        if self.data_parallel_group is not None and grads:
            flat = to_group(torch.cat([g.reshape(-1) for g in grads]), self.data_parallel_group)
            dist.all_reduce(flat, group=self.data_parallel_group)
            flat /= dist.get_world_size(self.data_parallel_group)
            offset = 0
            for g in grads:
                g.copy_(flat[offset : offset + g.numel()].view_as(g))
                offset += g.numel()
        if self.track_norms:
            self.norms.exchange(self.updates, self.parameters)
        if self.before_update is not None:
            self.before_update(self.parameters)
        self.predictor.before_update()
        self.optimizer.step()
        self.predictor.after_update()
        for p in self.parameters:
            p.grad = None

    # ----------------------------------------------------------------------------- driving
    def step(
        self,
        micro_batches: int,
        *,
        inputs: Sequence[Any] | None = None,
        loss_fn: LossFunction | None = None,
    ) -> list[Tensor]:
        """Run ``micro_batches`` units: per unit the forward of a new micro-batch, then the
        backward (and update) of the one ``N-k-1`` units older, if any.

        Args:
            micro_batches: units of this step; every stage must pass the same number.
            inputs: stage 0 only (unless it is also the last stage): the positional model inputs
                of each micro-batch, as tuples.
            loss_fn: the last stage only: see :data:`LossFunction`.

        Returns:
            On the last stage the (detached) loss of every micro-batch of this step, else [].
        """
        if micro_batches < 1:
            raise ValueError(f"micro_batches must be at least 1, got {micro_batches}")
        if self.first and not self.last and (inputs is None or len(inputs) != micro_batches):
            raise ValueError(f"stage 0 needs the model inputs of all {micro_batches} micro-batches")
        self.losses = []
        if self.transport is not None:
            # the previous step's sends: they had the time between steps to complete
            self.transport.wait_sends()
        for index in range(micro_batches):
            unit = self.next_unit
            model_inputs = inputs[index] if inputs is not None else ()
            if not isinstance(model_inputs, tuple):
                model_inputs = (model_inputs,)
            self._forward(unit, index, model_inputs, loss_fn)
            self.next_unit += 1
            older = unit - self.lag
            if older >= self.fill_start:
                self._backward(older)
        return self.losses

    def drain(self) -> None:
        """Run every pending backward (and its update) without new forwards; afterwards no
        micro-batch is in flight. Call it on every stage at the same point."""
        for unit in sorted(self.in_flight):
            self._backward(unit)
        if self._accumulated:
            self._update()  # a partial 2BW accumulation is applied, not dropped
        if self.transport is not None:
            self.transport.wait_sends()
        self.fill_start = self.next_unit

    @property
    def pending(self) -> int:
        """Micro-batches whose forward ran here and whose backward has not."""
        return len(self.in_flight)

    def pop_telemetry(self) -> StageTelemetry:
        """Staleness, prediction error, bubble and memory since the last call."""
        recent = self.staleness[self._telemetry_from :]
        self._telemetry_from = len(self.staleness)
        errors = self.predictor.meter.pop_means() if self.predictor.meter is not None else None
        total = self._busy + self._waiting
        telemetry = StageTelemetry(
            staleness_mean=sum(recent) / len(recent) if recent else None,
            staleness_max=max(recent) if recent else None,
            prediction_error=errors[0] if errors else None,
            stale_error=errors[1] if errors else None,
            bubble_fraction=self._waiting / total if total > 0 else None,
            weight_bytes_peak=self.predictor.peak_bytes(),
            units=len(recent),
        )
        self._busy = self._waiting = 0.0
        return telemetry

    def state_dict(self) -> dict[str, Any]:
        """Counters and predictor state (drain first: in-flight micro-batches are not saved)."""
        if self.in_flight:
            raise RuntimeError("drain() the pipeline before saving its state")
        return {"next_unit": self.next_unit, "predictor": self.predictor.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.next_unit = self.fill_start = int(state["next_unit"])
        self.predictor.load_state_dict(state["predictor"])
