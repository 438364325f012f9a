"""One round of model averaging: what it sends, how it travels, where its result lands.

:class:`RoundExchange` is the part of :class:`~lightning_parallel.averaging.ReplicaAveraging`
that runs a round of one fragment (the whole model when unfragmented), in three steps:

1. **pack** (:meth:`RoundExchange._start_round`): the fragment's trainable parameters, its
   floating-point buffers (``buffers="average"``) and, with ``optimizer_state="average"``, its
   optimizer state, into one flat buffer per dtype; the parameters of a quantized round are
   instead each replica's delta from the fragment's last agreed point, and a compressor
   (:class:`ParameterMean`, Hylo's) may average the parameters by a route of its own;
2. **send**: the buffers are summed over the ranks by the reduction (flat ring or host-shaped
   tree), blocking, or in the background for ``sync_delay`` optimizer steps;
3. **land** (:meth:`RoundExchange._finish_round`): the sums become the mean (divided by the
   ranks that took part: fewer once a replica was lost), the divergence ``‖x_i − x̄‖`` is
   recorded, the fragment's averager turns ``(x_i, x̄)`` into the restart point, and the live
   tensors take it, keeping the steps taken meanwhile
   (:func:`~lightning_parallel.averaging.rounds.land`); the fragment's agreed point is kept for
   streaming and quantized rounds, and ``optimizer_state="reset"`` clears the state.

When rounds happen is :class:`~lightning_parallel.averaging.ReplicaAveraging`'s.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from typing import Protocol

import torch
from torch import Tensor

from lightning_parallel.averaging.averager import Averager
from lightning_parallel.averaging.flat import FlatLayout
from lightning_parallel.averaging.fragments import Fragment, flat_delta
from lightning_parallel.averaging.policies import (
    optimizer_state_tensors,
    reset_optimizer_state,
    round_buffers,
    trainable_parameters,
)
from lightning_parallel.averaging.quantized_gather import QuantizedAllGather
from lightning_parallel.averaging.replica_state import ReplicaState
from lightning_parallel.averaging.rounds import Agreement, Round, add_mean_delta, land
from lightning_parallel.comm.ledger import CommLedger
from lightning_parallel.comm.tree import TreeAllReduce

__all__: list[str] = []


class ParameterMean(Protocol):
    """Averages the replicas' parameters by a route of its own (e.g. a compressed delta).

    ``reset(start)`` is called with the agreed parameters when local training begins;
    ``__call__(local)`` is collective and returns the mean of every rank's ``local`` (new
    tensors, identical on every rank).
    """

    def reset(self, start: Sequence[Tensor]) -> None: ...

    def __call__(self, local: Sequence[Tensor]) -> list[Tensor]: ...


class RoundExchange(ReplicaState):
    """Start and finish the rounds of model averaging (see the module docstring).

    The round runner (:class:`~lightning_parallel.averaging.ReplicaAveraging`) sets the
    attributes below in its constructor.
    """

    optimizer_state: str
    sync_delay: int
    fragment_update_alpha: float | None
    quantized: QuantizedAllGather | None
    error_feedback: bool
    ledger: CommLedger
    last_divergence: float | None
    #: set by a compressor (``HyloCompression``) to average the parameters' round deltas
    #: itself; buffers and optimizer state still go through ``reduction``
    parameter_mean: ParameterMean | None

    def _agreement_replaced(self, index: int, before: Agreement | None) -> None:
        """A round is about to replace fragment ``index``'s agreed point ``before`` (the loss
        rules keep it until a step has shown the new one healthy)."""

    def _delayed_round_agreed(self, point: Sequence[Tensor]) -> None:
        """An unfragmented exact round started with a delay landed: ``point`` (parameters,
        then buffers) is what the replicas agreed on, though none of them holds it if steps
        were taken meanwhile (each keeps its own)."""

    def _fragment_tensors(self, fragment: Fragment) -> tuple[list[Tensor], int, int]:
        """The fragment's live round tensors (parameters, buffers, averaged optimizer state)."""
        parameters = trainable_parameters(self.module)
        buffers = round_buffers(self.module, self.buffers)
        if len(self.fragments) == 1:
            own_parameters, own_buffers = parameters, buffers
        else:
            own_parameters = [parameters[i] for i in fragment.parameters]
            own_buffers = [buffers[i] for i in fragment.buffers]
        tensors = [*own_parameters, *own_buffers]
        if self.optimizer_state == "average":
            only = None if len(self.fragments) == 1 else own_parameters
            tensors += optimizer_state_tensors(self.optimizers, only)
        return tensors, len(own_parameters), len(own_buffers)

    def _start_round(self, index: int, delay: int) -> None:
        fragment = self.fragments[index]
        tensors, num_parameters, num_buffers = self._fragment_tensors(fragment)
        # Blocking rounds apply before anything moves, so the live tensors are the snapshot.
        snapshot = [t.detach().clone() if delay else t.detach() for t in tensors]
        reduced, parameter_means, delta, delta_work = snapshot, None, None, None
        if isinstance(self.reduction, TreeAllReduce):
            self._wait_in_flight()  # one tree reduction at a time (see _wait_in_flight)
        start = time.perf_counter()
        sent = 0.0
        agreement = self.agreements[index]
        if self.parameter_mean is not None and self.world_size > 1:
            if len(self.fragments) > 1 or self.quantized is not None:
                raise ValueError(
                    "HyloCompression averages whole models: remove fragments and outer_dtype "
                    "from the strategy, or the callback"
                )
            # the parameters take their own (blocking) route; the rest the reduction
            parameter_means = self.parameter_mean(snapshot[:num_parameters])
            reduced = snapshot[num_parameters:]
        elif self.quantized is not None and self.world_size > 1 and num_parameters:
            assert agreement is not None  # set when the averagers started
            delta = flat_delta(snapshot[:num_parameters], agreement.anchor)
            residuals = None
            if self.error_feedback:
                if agreement.residual is None:
                    agreement.residual = torch.zeros_like(delta)
                residuals = [agreement.residual]
            sent += self.quantized.bytes_sent([delta])
            delta_work = self.quantized.all_reduce([delta], async_op=delay > 0, residuals=residuals)
            reduced = snapshot[num_parameters:]
        layout = FlatLayout(reduced)
        sums = layout.pack(reduced)
        self.schedule.mark_round()
        sent += self.reduction.bytes_sent(layout.nbytes(sums))
        self.peak_round_bytes = max(self.peak_round_bytes, sent)
        self.ledger.set_gauge("rounds", self.schedule.rounds)
        self.ledger.set_gauge("bytes_per_round", sent)
        self.ledger.set_gauge("peak_round_bytes", self.peak_round_bytes)
        work = None
        if self.world_size > 1 and sums:
            work = self.reduction.all_reduce(sums, async_op=delay > 0)
        steps = self.schedule.optimizer_steps
        current = Round(
            fragment=index,
            snapshot=snapshot,
            layout=layout,
            sums=sums,
            work=work,
            num_parameters=num_parameters,
            num_buffers=num_buffers,
            started_at=steps,
            apply_at=steps + delay,
            delta=delta,
            delta_work=delta_work,
            blocked_seconds=time.perf_counter() - start,
            parameter_means=parameter_means,
        )
        if delay:
            self._rounds.append(current)
        else:
            self._finish_round(current)

    def _finish_round(self, current: Round) -> None:
        """Apply the round's result (waiting for it if needed)."""
        start = time.perf_counter()
        current.wait()
        current.blocked_seconds += time.perf_counter() - start
        self.ledger.set_gauge("round_wait_s", current.blocked_seconds)
        index, count = current.fragment, current.num_parameters
        agreement = self.agreements[index]
        with torch.no_grad():
            for buffer in current.sums:  # the ranks summed: fewer once a replica was lost
                buffer.div_(current.ranks or self.world_size)
            mean = current.layout.unpack(current.sums)
            if current.parameter_means is not None:
                mean = current.parameter_means + mean
            elif current.delta is not None:
                assert agreement is not None
                ranks = current.delta_ranks or self.world_size
                mean = add_mean_delta(agreement.anchor, current.delta, ranks) + mean
            local_parameters = current.snapshot[:count]
            mean_parameters = mean[:count]
            squared = sum(
                float((replica.double() - average.double()).pow(2).sum())
                for replica, average in zip(local_parameters, mean_parameters, strict=True)
            )
            self.last_divergence = math.sqrt(squared)
            self.ledger.set_gauge("divergence", self.last_divergence)
            averager = self.averagers[index]
            moved = self.schedule.optimizer_steps > current.started_at
            if self._watch_round_mean:
                self._round_mean = self._mean_after(current, averager, mean, moved)
            targets = averager.update(local_parameters, mean_parameters) + mean[count:]
            self._gauge_averagers()
            live, _, _ = self._fragment_tensors(self.fragments[index])
            if [t.shape for t in live] != [t.shape for t in current.snapshot]:
                raise RuntimeError(
                    "the model or optimizer state changed shape during a round of averaging; "
                    "do not add parameters or optimizer state while training with averaging"
                )
            land(live, current.snapshot, targets, moved, self.fragment_update_alpha)
            if (
                current.apply_at > current.started_at  # delayed: synchronize does not keep it
                and len(self.fragments) == 1
                and not self._keep_agreement
                and averager.restarts_in_consensus
            ):
                self._delayed_round_agreed(targets[: count + current.num_buffers])
            if self._keep_agreement:
                agreed = targets if averager.restarts_in_consensus else mean
                buffers = mean[count : count + current.num_buffers]
                residual = agreement.residual if agreement is not None else None
                self._agreement_replaced(index, agreement)
                self.agreements[index] = Agreement(
                    [t.detach().clone() for t in agreed[:count]],
                    [t.detach().clone() for t in buffers],
                    residual,
                )
        self._in_consensus = (
            len(self.fragments) == 1 and not moved and self.averager.restarts_in_consensus
        )
        if self.optimizer_state == "reset":
            only = None if len(self.fragments) == 1 else live[:count]
            reset_optimizer_state(self.optimizers, only)

    def _mean_after(
        self, current: Round, averager: Averager, mean: list[Tensor], moved: bool
    ) -> list[Tensor] | None:
        """The replicas' mean (parameters, then round buffers) once ``current`` lands, where it
        follows from the round's ``mean`` alone: an exact whole-model round landing before any
        step was taken (no quantized delta, no compressor's route), whose averager can tell
        (:meth:`~lightning_parallel.averaging.Averager.mean_of_restarts`: EASGD). The buffers
        land as their mean on every replica."""
        if (
            moved
            or len(self.fragments) > 1
            or current.delta is not None
            or current.parameter_means is not None
        ):
            return None
        count = current.num_parameters
        restarts = averager.mean_of_restarts(mean[:count])
        if restarts is None:
            return None
        return restarts + mean[count : count + current.num_buffers]

    def _gauge_averagers(self) -> None:
        """Set the averagers' own gauges, each summed over the fragments
        (:meth:`~lightning_parallel.averaging.Averager.gauges`; DiLoCo's ``outer_steps_capped``)."""
        totals: dict[str, float] = {}
        for averager in self.averagers:
            for name, value in averager.gauges().items():
                totals[name] = totals.get(name, 0.0) + value
        for name, value in totals.items():
            self.ledger.set_gauge(name, value)

    def _finish_rounds(self) -> None:
        """Apply every round in flight now, whatever its delay."""
        while self._rounds:
            self._finish_round(self._rounds.pop(0))

    def _round_of_every_fragment(self) -> None:
        """Apply the rounds in flight, then run a blocking round of every fragment now."""
        self._finish_rounds()
        self._due = []
        for fragment in self.fragments:
            self._start_round(fragment.index, 0)
        # the next rounds are staggered again from here, as a round before a validation moves
        # an unfragmented schedule: the validation's round replaces the ones it anticipates
        self.schedule.phase_origin = self.schedule.optimizer_steps
        self._in_consensus = self.averager.restarts_in_consensus
