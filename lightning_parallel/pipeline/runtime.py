"""The stage runtime: run one stage's forward and backward actions, micro-batch by micro-batch.

A :class:`StageRuntime` owns one stage of one pipeline. A schedule drives it action by action
(:meth:`~StageRuntime.forward` and :meth:`~StageRuntime.backward`), or with a whole row of a
flushing schedule table (:meth:`~StageRuntime.run_step`). Per step:

1. :meth:`begin_step` with the number of micro-batches ``m``;
2. ``F j``: take the micro-batch's input (stage 0: the model arguments; others: receive from
   the previous stage), run the stage, send the output on, or, on the last stage, call the
   loss function on it. With recomputation the forward runs without autograd and keeps only
   the input and the random-number state. After the ``m``-th forward, deferred BatchNorm starts
   committing the step's statistics;
3. ``B j``: recompute if needed, receive the output gradient (last stage: back-propagate the
   loss), back-propagate (gradients accumulate in ``.grad`` over the micro-batches), send the
   input gradient to the previous stage. After the ``m``-th backward, the deferred weight
   gradients of the stage's linear layers are computed in one product each
   (:mod:`~lightning_parallel.pipeline.weight_grad`, when the stage holds such layers) and the
   stage's gradient allreduce across groups starts (:class:`~.grad_sync.PartitionGradientSync`);
4. :meth:`end_step`: complete pending sends and the BatchNorm commit, return the step's
   statistics (busy and waiting time, activation memory peak, events). The bytes a micro-batch
   holds between its forward and backward (the tensors autograd saves, parameters excluded)
   are measured with saved-tensor hooks on the first forward (and recomputation) of each input
   shape and reused for later micro-batches of that shape: the hooks cost a Python call per
   saved tensor, and the bytes follow from the shapes;
5. :meth:`finish_gradient_sync`, when the caller needs the averaged gradients.

Whoever calls the loss function decides its weight: for a loss that is a mean over samples,
weighting micro-batch ``j`` by ``n_j/N`` makes the accumulated gradient that of the mini-batch.

The runtime makes no assumption that the step flushes: a no-flush schedule can call
:meth:`forward`/:meth:`backward` across step boundaries, keyed by any integer micro-batch id.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lightning_parallel.pipeline.batchnorm import BatchNormCommit, deferred_layers
from lightning_parallel.pipeline.grad_sync import PartitionGradientSync, SyncTiming
from lightning_parallel.pipeline.profile import SavedTensorMeter, nbytes, tensors_of
from lightning_parallel.pipeline.recompute import (
    RandomState,
    check_recompute_mode,
    recomputing,
    should_recompute,
)
from lightning_parallel.pipeline.schedule import Action
from lightning_parallel.pipeline.stage_entry import stage_inputs
from lightning_parallel.pipeline.timeline import Clock, TimelineEvent
from lightning_parallel.pipeline.transport import StageTransport, stage_output_tensors
from lightning_parallel.pipeline.weight_grad import (
    deferred_linears,
    deferring_weight_gradients,
    discard_weight_gradients,
    flush_weight_gradients,
)

__all__: list[str] = []

LossFunction = Callable[[int, Any], torch.Tensor]
"""``loss_fn(micro_batch, last_stage_output) -> scalar loss to back-propagate``."""


@dataclass
class _Slot:
    """What a stage keeps for one micro-batch between its forward and its backward."""

    inputs: Any
    received: list[torch.Tensor]
    outputs: list[torch.Tensor] = field(default_factory=list)
    loss: torch.Tensor | None = None
    random_state: RandomState | None = None
    held_bytes: int = 0


@dataclass
class StepStatistics:
    """What one stage measured during one step."""

    losses: dict[int, torch.Tensor] = field(default_factory=dict)
    outputs: dict[int, Any] = field(default_factory=dict)
    busy_seconds: float = 0.0
    wait_seconds: float = 0.0
    step_seconds: float = 0.0
    peak_activation_bytes: int = 0
    events: list[TimelineEvent] = field(default_factory=list)


class StageRuntime:
    """Run one pipeline stage (see the module docstring for the step it performs).

    Args:
        module: the stage's module (stage 0 is called with the model arguments, other stages
            with what the previous stage returned).
        stage: index ``k`` of this stage.
        stages: number of stages ``p``.
        transport: point-to-point transport to the neighbours (``None`` only when ``p == 1``).
        recompute: ``"never"``, ``"except_last"`` or ``"always"``.
        gradient_sync: averages this stage's gradients across groups (``None``: one group).
        batch_norm_group: data-parallel group to reduce deferred BatchNorm statistics over.
        reduce_batch_norm: reduce them (set when there is more than one group).
        rank: global rank, for the timeline.
        record_events: keep timeline events (cheap; off to save memory on long runs).
    """

    def __init__(
        self,
        module: nn.Module,
        stage: int,
        stages: int,
        transport: StageTransport | None = None,
        recompute: str = "never",
        gradient_sync: PartitionGradientSync | None = None,
        batch_norm_group: dist.ProcessGroup | None = None,
        reduce_batch_norm: bool = False,
        rank: int = 0,
        record_events: bool = True,
    ) -> None:
        if not 0 <= stage < stages:
            raise ValueError(f"stage must be in 0..{stages - 1}, got {stage}")
        if stages > 1 and transport is None:
            raise ValueError("a pipeline of more than one stage needs a StageTransport")
        self.module = module
        self.stage, self.stages = stage, stages
        self.transport = transport
        self.recompute = check_recompute_mode(recompute)
        self.gradient_sync = gradient_sync
        self.batch_norm_group = batch_norm_group
        self.reduce_batch_norm = reduce_batch_norm
        self.rank = rank
        self.record_events = record_events
        self.parameters = [p for p in module.parameters() if p.requires_grad]
        self.batch_norms = deferred_layers(module)
        self.deferred_linears = deferred_linears(module)
        self.clock = Clock()
        self.micro_batches = 0
        self._slots: dict[int, _Slot] = {}
        self._forwards = self._backwards = 0
        self._commit: BatchNormCommit | None = None
        self._stats = StepStatistics()
        self._started = 0.0
        self._live_bytes = 0
        self._saved_bytes: dict[tuple[Any, ...], int] = {}  # by pass and input shapes

    @property
    def is_first(self) -> bool:
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        return self.stage == self.stages - 1

    @property
    def device(self) -> torch.device:
        if self.parameters:
            return self.parameters[0].device
        return self.transport.device if self.transport is not None else torch.device("cpu")

    # -- bookkeeping -------------------------------------------------------------------------

    def _event(self, kind: str, micro_batch: int, start: float, end: float) -> None:
        if self.record_events:
            self._stats.events.append(
                TimelineEvent(
                    self.rank,
                    self.stage,
                    kind,
                    micro_batch,
                    self.clock.wall(start),
                    self.clock.wall(end),
                )
            )

    def _hold(self, amount: int, transient: int = 0) -> None:
        self._live_bytes += amount
        peak = self._live_bytes + transient
        self._stats.peak_activation_bytes = max(self._stats.peak_activation_bytes, peak)

    def _meter(self, key: tuple[Any, ...]) -> SavedTensorMeter | None:
        """A meter for a pass whose saved bytes are not known yet (``None``: known)."""
        return SavedTensorMeter(self.parameters) if key not in self._saved_bytes else None

    def _metered_bytes(self, key: tuple[Any, ...], meter: SavedTensorMeter | None) -> int:
        if meter is not None:
            self._saved_bytes[key] = meter.bytes
        return self._saved_bytes[key]

    def begin_step(self, micro_batches: int) -> None:
        """Start a step of ``micro_batches`` micro-batches."""
        if micro_batches < 1:
            raise ValueError(f"micro_batches must be at least 1, got {micro_batches}")
        self.micro_batches = micro_batches
        self._forwards = self._backwards = 0
        discard_weight_gradients(self.deferred_linears)
        for layer in self.batch_norms:  # a step's statistics are its own micro-batches'
            layer.discard()
        self._stats = StepStatistics()
        self._started = time.perf_counter()

    def _run_module(self, inputs: Any) -> Any:
        with deferring_weight_gradients(bool(self.deferred_linears)):
            return self.module(*inputs) if self.is_first else self.module(stage_inputs(inputs))

    # -- forward -----------------------------------------------------------------------------

    def _receive(self, micro_batch: int, inputs: Any) -> tuple[Any, list[torch.Tensor]]:
        if self.is_first:
            if not isinstance(inputs, tuple):
                inputs = (inputs,)
            return inputs, []
        assert self.transport is not None
        start = time.perf_counter()
        value, waited = self.transport.recv_activations()
        self._stats.wait_seconds += waited
        self._event("wait", micro_batch, start, time.perf_counter())
        received = [t for t in tensors_of(value) if t.requires_grad]
        return value, received

    def forward(
        self, micro_batch: int, inputs: Any = None, loss_fn: LossFunction | None = None
    ) -> Any:
        """Run ``F micro_batch``: returns the stage output (the loss on the last stage)."""
        if self.is_last and loss_fn is None:
            raise ValueError("the last stage needs a loss_fn to run a training forward")
        value, received = self._receive(micro_batch, inputs)
        # a no-flush schedule numbers micro-batches across steps: the position in the step counts
        position = micro_batch % self.micro_batches
        recompute = should_recompute(self.recompute, position, self.micro_batches)
        slot = _Slot(value, received)
        start = time.perf_counter()
        if recompute:
            slot.random_state = RandomState.capture(self.device)
            with torch.no_grad():
                output = self._run_module(value)
                if self.is_last:
                    assert loss_fn is not None
                    slot.loss = loss_fn(micro_batch, output).detach()
            slot.held_bytes = nbytes(value)
        else:
            key = ("F", _shapes(value))
            meter = self._meter(key)
            with meter.hooks() if meter is not None else nullcontext():
                output = self._run_module(value)
                if self.is_last:
                    assert loss_fn is not None
                    slot.loss = loss_fn(micro_batch, output)
            if not self.is_last:
                slot.outputs = _floating(stage_output_tensors(output, self.stage)[0])
            slot.held_bytes = self._metered_bytes(key, meter)
        end = time.perf_counter()
        self._stats.busy_seconds += end - start
        self._event("F", micro_batch, start, end)
        self._hold(slot.held_bytes)
        self._slots[micro_batch] = slot
        if self.is_last:
            assert slot.loss is not None
            self._stats.losses[micro_batch] = slot.loss.detach()
        else:
            assert self.transport is not None
            self.transport.send_activations(_mark_floating(output))
        self._forwards += 1
        if self._forwards == self.micro_batches and self.batch_norms and self.module.training:
            self._commit = BatchNormCommit(
                self.module, self.batch_norm_group, self.reduce_batch_norm
            )
        return slot.loss if self.is_last else output

    # -- backward ----------------------------------------------------------------------------

    def _recompute(self, micro_batch: int, slot: _Slot, loss_fn: LossFunction | None) -> int:
        assert slot.random_state is not None
        key = ("R", _shapes(slot.inputs))
        meter = self._meter(key)
        with (
            recomputing(),
            slot.random_state.replay(self.device),
            meter.hooks() if meter is not None else nullcontext(),
            torch.enable_grad(),
        ):
            output = self._run_module(slot.inputs)
            if self.is_last:
                assert loss_fn is not None
                slot.loss = loss_fn(micro_batch, output)
            else:
                slot.outputs = _floating(stage_output_tensors(output, self.stage)[0])
        return self._metered_bytes(key, meter)

    def backward(self, micro_batch: int, loss_fn: LossFunction | None = None) -> None:
        """Run ``B micro_batch`` (``loss_fn`` is needed again on a recomputing last stage)."""
        slot = self._slots.pop(micro_batch, None)
        if slot is None:
            raise RuntimeError(
                f"stage {self.stage}: backward of micro-batch {micro_batch} before its forward"
            )
        transient = 0
        if slot.random_state is not None:
            start = time.perf_counter()
            transient = self._recompute(micro_batch, slot, loss_fn)
            end = time.perf_counter()
            self._stats.busy_seconds += end - start
            self._event("R", micro_batch, start, end)
        self._hold(0, transient)
        gradients: list[torch.Tensor] = []
        if not self.is_last:
            assert self.transport is not None
            start = time.perf_counter()
            # one gradient per floating-point output, as the next stage was told in the header
            gradients, waited = self.transport.recv_gradients(slot.outputs)
            self._stats.wait_seconds += waited
            self._event("wait", micro_batch, start, time.perf_counter())
        start = time.perf_counter()
        if self.is_last:
            assert slot.loss is not None
            if slot.loss.requires_grad:
                slot.loss.backward()
        else:
            pairs = [(t, g) for t, g in zip(slot.outputs, gradients) if t.requires_grad]
            if pairs:
                torch.autograd.backward([t for t, _ in pairs], [g for _, g in pairs])
        end = time.perf_counter()
        self._stats.busy_seconds += end - start
        self._event("B", micro_batch, start, end)
        if not self.is_first:
            assert self.transport is not None
            self.transport.send_gradients(
                [t.grad if t.grad is not None else torch.zeros_like(t) for t in slot.received]
            )
        self._hold(-slot.held_bytes)
        self._backwards += 1
        if self._backwards == self.micro_batches:
            if self.deferred_linears:
                start = time.perf_counter()
                flush_weight_gradients(self.deferred_linears)
                end = time.perf_counter()
                self._stats.busy_seconds += end - start
                self._event("W", -1, start, end)
            if self.gradient_sync is not None:
                self.gradient_sync.launch()

    # -- whole steps -------------------------------------------------------------------------

    def end_step(self) -> StepStatistics:
        """Complete sends and the BatchNorm commit; return the step's statistics."""
        if self.transport is not None:
            start = time.perf_counter()
            self.transport.wait_sends()
            self._event("wait", -1, start, time.perf_counter())
        if self._commit is not None:
            self._commit.finish()
            self._commit = None
        if self._slots:
            missing = sorted(self._slots)
            self._slots.clear()
            raise RuntimeError(
                f"stage {self.stage} ended a step with micro-batches {missing} not back-propagated"
            )
        self._live_bytes = 0
        self._stats.step_seconds = time.perf_counter() - self._started
        return self._stats

    def run_step(
        self,
        actions: Sequence[Action],
        micro_batches: int,
        inputs: Sequence[Any] | None = None,
        loss_fn: LossFunction | None = None,
    ) -> StepStatistics:
        """Run one row of a flushing schedule table (``inputs``: stage 0's per micro-batch)."""
        if self.is_first and (inputs is None or len(inputs) != micro_batches):
            raise ValueError(f"stage 0 needs the inputs of all {micro_batches} micro-batches")
        self.begin_step(micro_batches)
        for action in actions:
            if action.kind == "F":
                given = inputs[action.micro_batch] if self.is_first and inputs is not None else None
                self.forward(action.micro_batch, given, loss_fn)
            elif action.kind == "B":
                self.backward(action.micro_batch, loss_fn)
            else:
                raise ValueError(f"unknown action {action!r}; expected kind 'F' or 'B'")
        return self.end_step()

    def run_forward_only(
        self, micro_batches: int, inputs: Sequence[Any] | None = None
    ) -> StepStatistics:
        """Forward every micro-batch without autograd (evaluation); the last stage's outputs
        are in the returned statistics' ``outputs``."""
        self.begin_step(micro_batches)
        with torch.no_grad():
            for micro_batch in range(micro_batches):
                given = inputs[micro_batch] if self.is_first and inputs is not None else None
                value, _ = self._receive(micro_batch, given)
                start = time.perf_counter()
                output = self._run_module(value)
                end = time.perf_counter()
                self._stats.busy_seconds += end - start
                self._event("F", micro_batch, start, end)
                if self.is_last:
                    self._stats.outputs[micro_batch] = output
                else:
                    assert self.transport is not None
                    self.transport.send_activations(output)
        return self.end_step()

    def finish_gradient_sync(self) -> SyncTiming:
        """Wait for this stage's gradient allreduce and write the averages into ``.grad``."""
        if self.gradient_sync is None:
            return SyncTiming()
        timing = self.gradient_sync.finish()
        if timing.duration > 0:
            launched = timing.launched_at
            self._event("allreduce", -1, launched, launched + timing.duration)
        return timing


def _shapes(value: Any) -> tuple[tuple[torch.Size, torch.dtype], ...]:
    return tuple((t.shape, t.dtype) for t in tensors_of(value))


def _floating(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    return [t for t in tensors if t.is_floating_point()]


def _mark_floating(output: Any) -> Any:
    """Make every floating-point tensor of a stage output advertise ``requires_grad``.

    The header tells the next stage which inputs need a gradient back. Under recomputation the
    forward runs without autograd, so ``requires_grad`` is ``False`` everywhere; the rule
    "every floating-point tensor gets a gradient" is the same with and without recomputation.
    """
    if isinstance(output, torch.Tensor):
        return _flag(output)
    return tuple(_flag(t) for t in output)


def _flag(tensor: torch.Tensor) -> torch.Tensor:
    if tensor.is_floating_point() and not tensor.requires_grad:
        return tensor.detach().requires_grad_(True)
    return tensor
