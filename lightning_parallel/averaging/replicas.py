"""Run the rounds of model averaging for one model replica per rank, in plain torch."""

from __future__ import annotations

import copy
from collections.abc import Sequence

import torch
from torch import nn
from torch.optim import Optimizer

from lightning_parallel.averaging.averager import Averager
from lightning_parallel.averaging.collapse import ReplicaCollapse
from lightning_parallel.averaging.fragments import (
    due_fragments,
    plan_fragments,
)
from lightning_parallel.averaging.loss_responses import LossResponses
from lightning_parallel.averaging.plateau import LossSpike, PlateauExit
from lightning_parallel.averaging.policies import (
    BUFFER_POLICIES,
    OPTIMIZER_STATE_POLICIES,
    check_choice,
    round_buffers,
    trainable_parameters,
)
from lightning_parallel.averaging.quantized_gather import QuantizedAllGather
from lightning_parallel.averaging.reduction import Reduction
from lightning_parallel.averaging.rounds import (
    Agreement,
    check_alpha,
    check_sync_delay,
)
from lightning_parallel.averaging.schedule import AveragingSchedule
from lightning_parallel.comm.ledger import CommLedger, process_ledger

__all__: list[str] = []


class ReplicaAveraging(LossResponses):
    """Average the replicas of one model across ranks on a schedule, with buffer and state policies.

    Each rank holds a replica ``x_i`` of ``module`` trained by its own ``optimizers``. At the
    end of every round (see :class:`~lightning_parallel.averaging.AveragingSchedule`):

    1. the trainable parameters, the floating-point buffers (``buffers="average"``) and the
       optimizer state (``optimizer_state="average"``) are packed into one flat buffer per dtype
       and summed over the ranks by ``reduction`` (flat allreduce or host-shaped tree);
    2. the divergence ``‖x_i − x̄‖`` is recorded, then the ``averager`` turns ``(x_i, x̄)`` into the
       point the parameters restart from; buffers and averaged optimizer state take the mean;
       ``optimizer_state="reset"`` clears the optimizer state;
    3. with ``sync_delay=τ`` (``overlap=True`` is ``τ = 1``) step 1 runs asynchronously while
       the next ``τ`` optimizer steps compute, and step 2 is applied ``τ`` steps later, merging
       those steps' progress (:func:`~lightning_parallel.averaging.rounds.land`:
       ``x_i ← target + (x_i − x_i^snapshot)``, or Streaming DiLoCo's
       ``x_i ← α·x_i + (1 − α)·target`` with ``fragment_update_alpha=α``).

    Streaming rounds (``fragments=F > 1``) cut the model into ``F`` fragments of whole layers
    (:mod:`~lightning_parallel.averaging.fragments`), each with its own averager state,
    synchronised at staggered steps. Quantized rounds (``quantized``) send each replica's
    parameter delta from the fragment's last agreed point in low precision
    (:class:`~lightning_parallel.averaging.quantized_gather.QuantizedAllGather`), with optional
    error feedback; buffers and optimizer state still travel as values through ``reduction``.

    During the warm-up the caller averages gradients with :meth:`average_gradients` (synchronous
    data parallelism). All state needed to resume exactly is in :meth:`state_dict` (identical on
    every rank) and :meth:`local_state_dict` (this rank's replica, optimizer state, residuals and
    the rounds in flight).

    A training loop uses it like this (every rank runs the same calls)::

        averaging.broadcast_replicas()
        for batch in loader:
            averaging.synchronize()              # rounds due at this step boundary
            loss_fn(model(batch)).backward()
            if averaging.in_warmup:
                averaging.average_gradients()
            optimizer.step()
            optimizer.zero_grad()
            averaging.count_optimizer_step()
        averaging.finish()                       # every replica becomes the consensus

    Args:
        module: this rank's replica.
        optimizers: the optimizers that train it (their state follows ``optimizer_state``).
        averager: the algorithm (periodic, BMUF, EASGD, outer optimizer, one-shot); each
            fragment runs a copy of it.
        schedule: the period and warm-up; counts optimizer steps.
        reduction: sums buffers over the ranks (``FlatAllReduce`` or ``TreeAllReduce``).
        buffers: ``"average"`` or ``"local"``.
        optimizer_state: ``"keep"``, ``"average"`` or ``"reset"``.
        overlap: the same as ``sync_delay=1`` (kept for existing code).
        ledger: where gauges go (``rounds``, ``divergence``, ``bytes_per_round``,
            ``peak_round_bytes``, and ``round_wait_s``: seconds training waited for the round's
            exchange, all of it when blocking, only what the next steps did not hide when
            delayed); the process ledger by default.
        fragments: ``F``, fragments synchronised at staggered steps (1: the whole model).
        sync_delay: ``τ``, optimizer steps a round's exchange runs behind training before it
            is applied (0: blocking; less than the period).
        fragment_update_alpha: how a delayed round merges with the steps taken meanwhile
            (``None``: keep them; ``α``: Streaming DiLoCo's mixing).
        quantized: sends the parameters' deltas in low precision (``None``: values, exact).
        error_feedback: keep what quantization dropped and send it with the fragment's next
            round.
        keep_agreement: keep each fragment's last agreed point even without streaming or
            quantization (for :meth:`prepare_evaluation` ``policy="global"``).
        plateau: the rule that says when the loss leaves its initial plateau
            (:class:`~lightning_parallel.averaging.plateau.PlateauExit`; ``None``: never). The
            caller passes every local step's loss to :meth:`observe_loss` until it fires; at
            the next step boundary every replica takes the mean of the replicas and of the
            optimizer state, the next ``window_steps`` steps are synchronous (gradients
            averaged, as in the warm-up), and the averagers restart afterwards from the point
            the replicas then share (their outer or block momentum restarts from zero).
        window_steps: the synchronous window's length (positive with ``plateau``).
        spike: the rule that says when a local step's loss spikes
            (:class:`~lightning_parallel.averaging.plateau.LossSpike`; ``None``: never). The
            caller passes every local step's loss to :meth:`observe_loss`; after a spike every
            replica restarts from the last point the replicas agreed on (the last round's
            restart point, each fragment's agreed point when streaming), the optimizers' state
            is cleared and the averagers restart there (outer or block momentum from zero); the
            next round is ``period`` steps later. EASGD, whose replicas never agree after a
            round, rolls back to its center on a regression and trains through a spike;
            EASGD rounds that keep each fragment's agreement or land late keep no center to go
            back to and ignore it.
        collapse: the rule that says which replicas fell back to the starting loss while
            another trains on (:class:`~lightning_parallel.averaging.collapse.ReplicaCollapse`;
            ``None``: never). The caller passes every local step's loss to
            :meth:`observe_loss` (then all-reduced as one slot per replica); at the next step
            boundary the collapsed replicas take the healthy replicas' mean model and
            optimizer state, the rounds in flight applied first; the schedule goes on.
    """

    def __init__(
        self,
        module: nn.Module,
        optimizers: Sequence[Optimizer],
        averager: Averager,
        schedule: AveragingSchedule,
        reduction: Reduction,
        buffers: str = "average",
        optimizer_state: str = "keep",
        overlap: bool = False,
        ledger: CommLedger | None = None,
        fragments: int = 1,
        sync_delay: int | None = None,
        fragment_update_alpha: float | None = None,
        quantized: QuantizedAllGather | None = None,
        error_feedback: bool = False,
        keep_agreement: bool = False,
        plateau: PlateauExit | None = None,
        window_steps: int = 0,
        spike: LossSpike | None = None,
        collapse: ReplicaCollapse | None = None,
    ) -> None:
        buffers = check_choice("buffers", buffers, BUFFER_POLICIES)
        if fragments != 1 and schedule.period is None:
            raise ValueError("fragments > 1 needs a period (one-shot averaging has no rounds)")
        plan = plan_fragments(
            module,
            trainable_parameters(module),
            round_buffers(module, buffers),
            fragments,
            schedule.period or 1,
        )
        self.streaming = len(plan) > 1 or quantized is not None
        super().__init__(
            module,
            optimizers,
            [averager] + [copy.deepcopy(averager) for _ in plan[1:]],
            schedule,
            reduction,
            buffers,
            plan,
            keep_agreement=self.streaming or keep_agreement,
        )
        self.optimizer_state = check_choice(
            "optimizer_state", optimizer_state, OPTIMIZER_STATE_POLICIES
        )
        self.sync_delay = check_sync_delay(sync_delay, overlap, schedule.period)
        self.overlap = self.sync_delay > 0
        self.fragment_update_alpha = check_alpha(fragment_update_alpha)
        self.quantized = quantized
        self.error_feedback = bool(error_feedback)
        if self.error_feedback and quantized is None:
            raise ValueError("error_feedback applies to quantized rounds; set outer_dtype too")
        self.ledger = ledger if ledger is not None else process_ledger()
        self.last_divergence: float | None = None
        self.parameter_mean = None
        self.watch_loss(plateau, window_steps, spike, collapse)

    # ------------------------------------------------------------------ schedule

    @property
    def in_warmup(self) -> bool:
        """Whether the next optimizer step is synchronous (its gradients must be averaged)."""
        return self.schedule.in_warmup

    @property
    def rounds(self) -> int:
        """Rounds started so far (one per fragment synchronised; restored from checkpoints)."""
        return self.schedule.rounds

    @property
    def in_consensus(self) -> bool:
        """Whether the replicas are known to be identical right now."""
        return self._in_consensus

    def count_optimizer_step(self) -> None:
        """Count one optimizer step (once per training step, however many optimizers stepped)."""
        self._in_consensus = False
        ends_round = self.schedule.count_step()
        if not self.averager.averages_during_training:
            return
        if len(self.fragments) == 1:
            if ends_round:
                self._due = [0]
            return
        period = self.schedule.period
        assert period is not None
        if self.schedule.phase_step > 0:
            self._due += due_fragments(self.fragments, self.schedule.phase_step, period)

    def synchronize(self) -> None:
        """Do the work due at this step boundary; call it before every step and before reading.

        Applies the rounds in flight whose delay has passed, starts the averagers when local
        training begins (the replicas agree then), and starts the rounds that the last counted
        step ended.
        """
        if self._swapped is not None:
            return  # evaluation in progress: no step has been taken since it started
        self._respond_to_loss()
        steps = self.schedule.optimizer_steps
        while self._rounds and self._rounds[0].apply_at <= steps:
            self._finish_round(self._rounds.pop(0))
        if not self.averager.started and not self.schedule.in_warmup:
            self._start_averagers()
            self._keep_safe_point()  # the replicas agree when local training starts
            self._forget_earlier_points()
        due, self._due = self._due, []
        for fragment in due:
            self._start_round(fragment, self.sync_delay)
        if due and self._in_consensus:
            self._keep_safe_point()
        elif due and self._rolls_back_to_center:
            self._keep_safe_point(self._center_point())  # EASGD: the center the round moved

    def _start_averagers(self) -> None:
        parameters = [parameter.detach() for parameter in trainable_parameters(self.module)]
        for fragment, averager in zip(self.fragments, self.averagers, strict=True):
            # unfragmented: whatever trains now, as _fragment_tensors takes it
            start = (
                parameters
                if len(self.fragments) == 1
                else [parameters[i] for i in fragment.parameters]
            )
            averager.reset(start, self.world_size)
            if self._keep_agreement:
                self.agreements[fragment.index] = Agreement([t.clone() for t in start])
        if self.parameter_mean is not None:
            self.parameter_mean.reset(parameters)

    def finish(self) -> None:
        """End training: apply every pending round, then make every replica the consensus.

        Unfragmented exact rounds end on the replicas' mean (one more exchange, unless they
        agree already); streaming or quantized rounds end with a round of every fragment, and
        every replica takes the fragments' agreed points.
        """
        self.synchronize()
        self._finish_rounds()
        self.restore_replica()
        if self._in_consensus:
            return
        if self.streaming and self.averager.started and self.world_size > 1:
            self._round_of_every_fragment()
            self._put_agreement()
            self._in_consensus = True
            return
        tensors = self._model_tensors()
        with torch.no_grad():
            for tensor, mean in zip(tensors, self._mean(tensors), strict=True):
                tensor.copy_(mean)
        self._in_consensus = True

    # ------------------------------------------------------------------ evaluation

    def prepare_evaluation(self, average_first: bool = True, policy: str | None = None) -> None:
        """Make the model the replicas' consensus for evaluation; undo with :meth:`restore_replica`.

        Args:
            average_first: the same as ``policy="round"`` (``True``) or ``"mean"`` (``False``).
            policy: ``"round"``: run a round now if local steps were taken since the last one
                (every fragment's, when fragmented; the evaluated model is then the model
                training continues from, and the round's exchange is the only communication;
                EASGD's replicas do not agree after a round: their mean is evaluated, which
                follows from the round's mean without another exchange, unless the model is
                streamed or quantized); ``"mean"``: evaluate the mean of the replicas without
                changing them (one extra exchange, none for EASGD when a round landed at this
                step boundary; training is unaffected); ``"global"``: evaluate every fragment's last
                agreed point (the replicas' restart point: DiLoCo's global model; EASGD's: the
                round's mean before the pull, not the replicas' mean after it),
                with no communication; before every fragment has had a round, the mean.
        """
        policy = policy if policy is not None else ("round" if average_first else "mean")
        self._watch_round_mean, self._round_mean = True, None
        try:
            self.synchronize()
            if policy == "global" and self._swap_in_agreement():
                return
            if policy == "round":
                self._round_before_evaluation()
            known = self._round_mean  # EASGD right after its round: the mean without exchange
        finally:
            self._watch_round_mean, self._round_mean = False, None
        if not self._in_consensus:
            self.swap_in_mean(known)

    def _swap_in_agreement(self) -> bool:
        """Swap every fragment's agreed point in for evaluation, if every fragment has one and
        the replicas do not agree already; whether it did."""
        agreed = self.averager.started and all(
            agreement is not None and agreement.buffers is not None for agreement in self.agreements
        )
        if not agreed or self._swapped is not None or self._in_consensus:
            return False
        tensors = self._model_tensors()
        self._swapped = [(tensor, tensor.detach().clone()) for tensor in tensors]
        self._swapped_mean = False
        self._put_agreement()
        return True

    def _round_before_evaluation(self) -> None:
        """Run a round (of every fragment) if local steps were taken since the last one."""
        if len(self.fragments) > 1 and self.averager.started:
            if self.schedule.phase_step > 0 or self._rounds:
                self._round_of_every_fragment()
            return
        self._finish_rounds()  # nothing moved since they started: applied as they are
        if (
            self.averager.averages_during_training
            and self.averager.started
            and self.schedule.local_steps > 0
        ):
            self._due = []
            # not a point to go back to (_keep_safe_point): a short round at the epoch's end,
            # not the schedule's (diloco on vgg_mini, seed 4: its loss blew up again from
            # there and the run ended at 0.775, from the schedule's round before at 0.900)
            self._start_round(0, 0)
