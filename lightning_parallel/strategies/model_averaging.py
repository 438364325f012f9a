"""Train one replica per process and average the models every ``H`` optimizer steps.

:class:`ModelAveragingStrategy` is Lightning's multi-process data parallelism without the
per-step gradient allreduce: each process trains its own replica on its own shard of the data
and the replicas are synchronized, as models, once per round of ``period`` optimizer steps
(local SGD, one-shot averaging, BMUF, EASGD, or an outer optimizer such as DiLoCo's). The
algorithms and the round runner are the plain-torch :mod:`lightning_parallel.averaging`.

What it guarantees, where Lightning's ``model_averaging_period`` and torch's
``PeriodicModelAverager`` do not:

1. the period counts training steps: one per batch whose optimizers stepped, however many
   optimizers stepped in it and however many batches were accumulated into it;
2. the first ``warmup_steps`` steps, and the ``synchronous_window`` steps from the one at
   which the training loss leaves its initial plateau, are synchronous data parallelism
   (gradients averaged before every optimizer step, exactly as DDP); otherwise no gradient is
   communicated (the model is never wrapped in ``DistributedDataParallel``); a local step whose
   mean loss spikes, or climbs back to where training started, rolls every replica back to
   their last agreed point (``rollback_on_spike``), and a replica whose own loss falls back
   there while another trains on takes the healthy replicas' mean (``replace_collapsed``);
3. validation runs on averaged models (a round runs first, or the mean of the replicas is
   swapped in and out, or each fragment's last agreed point: ``before_validation``), every
   checkpoint's ``state_dict`` is the mean of the replicas (the replicas are not touched:
   saving never changes training), and at the end of ``fit`` every replica becomes the mean
   (the fragments' agreed points, with streaming or quantized rounds), so that spawn/fork's
   parent process receives the averaged model;
4. checkpoints carry everything needed to resume exactly under the key ``"model_averaging"``:
   the step counter and rounds, the averager's state (global model, block momentum, center
   variable, outer optimizer), every rank's own replica and optimizer state, and a round in
   flight; the rest of the checkpoint is an ordinary Lightning checkpoint that loads under
   ``ddp`` or on one device;
5. BatchNorm buffers (``buffers``) and optimizer state (``optimizer_state``) follow a
   policy chosen by the user; the reduction is a flat allreduce or a host-shaped tree
   (``reduce="tree"``), blocking or running behind training for ``sync_delay`` steps
   (``overlap=True``: one step); streaming rounds (``fragments``) synchronise the model a
   fragment at a time at staggered steps, and ``outer_dtype`` sends the parameters' deltas in
   bf16, int8 or int4 (Streaming DiLoCo, Douillard et al., arXiv 2501.18512);
6. each round sets the gauges ``rounds``, ``divergence`` (``‖x_i − x̄‖`` before averaging),
   ``bytes_per_round``, ``peak_round_bytes`` and ``round_wait_s`` in the process ledger, which
   ``CommStats`` logs (and ``loss_spikes``, ``loss_regressions``, ``rollbacks``,
   ``rollbacks_declined``, ``replicas_replaced``, ``synchronous_window_at`` when the loss
   rules act, ``outer_steps_capped`` when the outer step cap shortens a step);
7. a lost replica (killed, frozen, cut off; not rank 0) ends the run on every rank with an
   error naming it (``worker_loss="stop"``, the default), or is dropped
   (``worker_loss="continue"``): every collective is agreed by the survivors through the
   rendezvous store, one a lost rank left unfinished runs again among them
   (:mod:`lightning_parallel.comm.survivors`), and rounds, Lightning's collectives,
   ``torchmetrics`` and checkpoints go on over the survivors (gauge ``workers_lost``).

Registered names: ``model_averaging`` and ``local_sgd`` (periodic, ``period=8``), ``bmuf``
(Nesterov block momentum 0.5 with block learning rate 0.5, ``period=8``), ``easgd``
(``beta=0.9``, center first, ``period=6``), ``diloco`` (outer Nesterov SGD lr 0.7 momentum
0.5, ``period=16``, each outer step capped at the workers' own: ``outer_step_cap=1``). Their
defaults keep the step of the inner optimizer (tuned as for DDP) rather than multiply it;
docs/model_averaging.md ("Defaults") gives them and the papers' own values, and
docs/averaging_defaults.md the measurements that chose them.

Example::

    trainer = Trainer(
        accelerator="cpu",
        devices=2,
        strategy=ModelAveragingStrategy(algorithm="bmuf", period=8, start_method="fork"),
    )
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import Any, Literal

import pytorch_lightning as pl
import torch.distributed as dist
from pytorch_lightning.trainer.states import TrainerFn
from torch.distributed.constants import default_pg_timeout as DEFAULT_TIMEOUT
from torch.nn import Module
from torch.optim import Optimizer
from typing_extensions import override

from lightning_parallel.averaging import (
    Averager,
    AveragingSchedule,
    ReplicaAveraging,
    build_reduction,
)
from lightning_parallel.averaging.closures import averaging_gradients_after, observing_loss_after
from lightning_parallel.averaging.outer_optimizer import OuterOptimizerFactory
from lightning_parallel.averaging.quantize import BlockQuantizer
from lightning_parallel.averaging.quantized_gather import ROUNDS_LANE, QuantizedAllGather
from lightning_parallel.averaging.survivor_reduction import SurvivorAllReduce, rounds_lane
from lightning_parallel.comm.modules import broadcast_module_states, optimizers_to_device
from lightning_parallel.comm.tree import ranks_per_host_from_environment
from lightning_parallel.compat.private import layer_sync
from lightning_parallel.compat.types import StrPath
from lightning_parallel.strategies.averaging_algorithms import averager_factory
from lightning_parallel.strategies.averaging_checkpoints import (
    CHECKPOINT_KEY as CHECKPOINT_KEY,  # the key's home for users of this module
)
from lightning_parallel.strategies.averaging_checkpoints import AveragingCheckpoints
from lightning_parallel.strategies.averaging_options import (
    loss_rules,
    round_policies,
    schedule_arguments,
    streaming_options,
)
from lightning_parallel.strategies.worker_loss import heartbeat_seconds, resolve_worker_loss

__all__ = ["ModelAveragingStrategy"]


class ModelAveragingStrategy(AveragingCheckpoints):
    """Average models, not gradients: local SGD, one-shot, BMUF, EASGD and outer optimizers.

    Algorithm (``M`` processes, period ``H``, warm-up ``W``):

    1. steps ``1 … W``: synchronous data parallelism, gradients averaged before each step;
    2. afterwards each process takes ``H`` optimizer steps on its own replica ``x_i``;
    3. the replicas are averaged, ``x̄ = (1/M)·Σ_i x_i``, and the ``algorithm`` chooses where
       each replica restarts from: ``x̄`` (``periodic``), a block-momentum-filtered global model
       (``bmuf``), an elastic pull toward a center variable (``easgd``), or one step of an outer
       optimizer on the pseudo-gradient ``x_g − x̄`` (``outer_optimizer``); ``one_shot`` never
       averages until the end of training.

    When it pays: when the per-step gradient allreduce dominates the step (slow network, a
    model with many parameters for little compute such as fully-connected layers). ``H``
    divides the communication by ``H``; the price is the replicas' divergence, which grows with
    ``H``, the learning rate and the spread of the data (see the ``divergence`` gauge).

    Args:
        algorithm: ``"periodic"`` (alias ``"local_sgd"``), ``"one_shot"``, ``"bmuf"``,
            ``"easgd"``, ``"outer_optimizer"`` (alias ``"diloco"``), or an
            :class:`~lightning_parallel.averaging.Averager` instance.
        period: optimizer steps per round ``H`` (ignored by ``one_shot``).
        warmup_steps: synchronous steps ``W`` before local training (post-local SGD).
        synchronous_window: ``S``, synchronous steps run from the step at which the training
            loss leaves its initial plateau (default 0: none). Each local step's loss is
            averaged over the ranks (one scalar); when its smoothed value has fallen
            ``plateau_drop`` below the plateau's level
            (:class:`~lightning_parallel.averaging.plateau.PlateauExit`), every replica takes
            the mean model and optimizer state, the next ``S`` steps average gradients as DDP
            does, and the algorithm restarts afterwards from there (outer or block momentum
            from zero). Costs ``S`` DDP steps' bytes (measured: docs/averaging_defaults.md,
            "Loss spikes roll back").
        plateau_drop: the smoothed loss's relative fall below the plateau's level that ends
            it (default 0.05; larger: later).
        rollback_on_spike: after a local step whose loss, averaged over the ranks, exceeds
            ``spike_ratio`` times its smoothed value and the highest smoothed value so far
            (:class:`~lightning_parallel.averaging.plateau.LossSpike`), or whose smoothed
            loss has climbed back ``spike_regression`` of the way from its lowest to where
            training started for 3 steps in a row, restart every replica from the last point
            they agreed on while the loss was settled, with the optimizers' state cleared and
            the algorithm restarted there (default ``True``). One scalar per step (``2·M`` with
            ``replace_collapsed``), no other communication, two copies of the model kept (the
            point and the one before it; a third while a round inside a climb is held);
            EASGD (whose replicas never agree) goes back to its center, on a regression only
            (whole-model full-precision rounds applied at once; not with
            ``before_validation="global"``). Why and measured: docs/averaging_defaults.md,
            "Loss spikes roll back" and "EASGD goes back to its center on a regression".
        replace_collapsed: a replica whose own smoothed loss falls back to where training
            started (within 7.5%) for 3 local steps, after it had left it, while another
            replica's is still 15% below, takes the healthy replicas' mean model and optimizer
            state (:class:`~lightning_parallel.averaging.collapse.ReplicaCollapse`; default
            ``True``). Costs one scalar a replica each local step and one model exchange a
            replacement: the mean loss hides one dead replica, which the next round would
            average in (docs/averaging_defaults.md, "One dead replica is replaced").
        spike_ratio: the spike rule's ratio (default 2.0; larger: fewer roll-backs).
        spike_regression: the share of the way back to the starting loss that counts as a
            regression (default 1.0, back at the start; smaller: more roll-backs; ``None``:
            spikes only; docs/averaging_defaults.md, "Slow deaths").
        buffers: ``"average"`` (default; BatchNorm statistics averaged with the parameters) or
            ``"local"`` (each replica keeps its own; checkpoints hold rank 0's).
        optimizer_state: ``"keep"`` (default; each replica keeps its momentum or moments),
            ``"average"`` (averaged every round) or ``"reset"`` (cleared every round).
        reduce: ``"flat"`` (default; one ring allreduce) or ``"tree"`` (inside each host, then
            across hosts among one leader per host, then back inside).
        overlap: start each round's reduction asynchronously and apply it one step later,
            keeping that step's progress (default ``False``: block); ``sync_delay=1``.
        fragments: streaming rounds (Streaming DiLoCo): cut the model into ``F`` fragments of
            whole layers, balanced by bytes, each synchronised once per ``period`` at its own
            step, so that a round sends one fragment (default 1: the whole model at once).
        sync_delay: optimizer steps ``τ`` a round's exchange runs in the background before it
            is applied (default 0, or 1 with ``overlap``; less than ``period``).
        fragment_update_alpha: how a delayed round merges with the ``τ`` steps taken
            meanwhile: ``None`` (default) keeps them, ``x ← target + (x − x_start)``; a number
            ``α`` in ``[0, 1]`` mixes as Streaming DiLoCo does, ``x ← α·x + (1 − α)·target``.
        outer_dtype: what a round sends for the parameters: ``"fp32"`` (default; the values,
            exact), or each replica's delta from the last agreed point in ``"bf16"``,
            ``"int8"`` or ``"int4"`` (block-wise scales; lower: fewer bytes, more error).
            Buffers and averaged optimizer state still travel in full precision.
        outer_error_feedback: keep what ``outer_dtype`` dropped and send it with the same
            fragment's next round (default ``False``).
        before_validation: ``"round"`` (default): a validation that follows local steps first
            runs a round (of every fragment), validates the model training continues from
            (EASGD's: the replicas' mean, which an exact round's mean gives; streamed or
            quantized, one more exchange), and the next round comes ``period`` steps later
            (the fragments staggered again from there; no extra communication; how often you
            validate shapes the schedule);
            ``"mean"``: validate the mean of the replicas and restore each replica afterwards
            (one extra full-precision model exchange per validation; training is independent
            of validation); ``"global"``: validate every fragment's last agreed point (the
            restart point: DiLoCo's global model), with no communication at all; fragmented,
            those points are from different steps, and validated worse (docs: Streaming
            rounds).
        worker_loss: what a lost replica (killed, frozen, cut off; not rank 0, which hosts the
            rendezvous store) does to the run: ``"stop"`` (default) ends it on every rank after
            ``timeout``, with an error naming the rank; ``"continue"`` drops it: rank 0 declares
            it lost after ``heartbeat_timeout`` s of silence, every survivor logs it, the round
            or collective it left unfinished runs again over the survivors, and rounds,
            Lightning's collectives, ``torchmetrics`` and checkpoints go on among them; from
            the next epoch on Lightning's sampler divides the data among the survivors, so its
            shard is trained and validated again (the dataloaders are then rebuilt every epoch).
            ``"stop"`` is the default because ``"continue"`` changes what the run computes
            (fewer replicas, longer epochs) and every collective then pays an agreement through
            the store;
            ``"continue"`` needs a gloo default group.
        heartbeat_timeout: seconds of heartbeat silence after which a replica is lost with
            ``worker_loss="continue"`` (default: half of ``timeout``, at most 60).
        ranks_per_host: processes per host for ``reduce="tree"``; default ``LOCAL_WORLD_SIZE``,
            else the trainer's ``devices``.
        block_momentum: BMUF's ``η`` (default 0.5; the paper's ``1 − 1/M`` is 0.5 for 2
            processes, 0.75 for 4).
        block_learning_rate: BMUF's ``ζ`` (default ``1 − η``: the block momentum smooths the
            rounds without enlarging the step; the paper's is 1).
        nesterov: BMUF restarts from ``x_g + η·Δ`` (default ``True``).
        alpha: EASGD's worker moving rate (default ``beta / M``).
        beta: EASGD's center moving rate (default 0.9).
        center_first: EASGD moves the center before pulling the workers (default ``True``;
            ``False`` for the paper's simultaneous update).
        outer_optimizer: name of a ``torch.optim`` class (``"sgd"``, ``"adam"``, ...) or a
            function building an optimizer from a list of tensors (default ``"sgd"``).
        outer_lr: outer learning rate (default 0.7, DiLoCo's).
        outer_momentum: outer momentum for optimizers that take one (default 0.5 for SGD;
            DiLoCo's 0.9 multiplies the step by up to ``outer_lr / (1 − 0.9) = 7``, see
            :func:`~lightning_parallel.averaging.diloco_outer_optimizer`).
        outer_nesterov: Nesterov outer momentum for SGD (default ``True``).
        outer_step_cap: the longest outer step, as a multiple of the round's pseudo-gradient
            norm (default 1.0: the global model moves no further than the workers' mean did;
            ``float("inf")`` for the outer optimizer's step as the papers take it; see
            :class:`~lightning_parallel.averaging.OuterOptimizerAverager`).
        start_method: ``"popen"`` (default; also what externally launched processes need),
            ``"spawn"``, ``"fork"`` or ``"forkserver"``.
        timeout: a ``timedelta`` for every collective, the averaging rounds' included (a dead
            peer raises after it).
        **kwargs: Lightning's strategy arguments (``accelerator``, ``parallel_devices``,
            ``cluster_environment``, ``checkpoint_io``, ``precision_plugin``,
            ``process_group_backend``), passed on by :class:`ParallelStrategyBase`; an unknown
            keyword raises ``TypeError`` naming the accepted ones.

    Attributes:
        averaging: the round runner while fitting (``None`` otherwise).
    """

    reports_communication = True
    wraps_in_ddp = False  # no DistributedDataParallel: its keywords are refused

    def __init__(
        self,
        algorithm: str | Averager = "periodic",
        period: int | None = 8,
        warmup_steps: int = 0,
        synchronous_window: int = 0,
        plateau_drop: float = 0.05,
        rollback_on_spike: bool = True,
        replace_collapsed: bool = True,
        spike_ratio: float = 2.0,
        spike_regression: float | None = 1.0,
        buffers: Literal["average", "local"] = "average",
        optimizer_state: Literal["keep", "average", "reset"] = "keep",
        reduce: Literal["flat", "tree"] = "flat",
        overlap: bool = False,
        before_validation: Literal["round", "mean", "global"] = "round",
        fragments: int = 1,
        sync_delay: int | None = None,
        fragment_update_alpha: float | None = None,
        outer_dtype: Literal["fp32", "bf16", "int8", "int4"] = "fp32",
        outer_error_feedback: bool = False,
        worker_loss: Literal["stop", "continue"] = "stop",
        heartbeat_timeout: float | None = None,
        ranks_per_host: int | None = None,
        block_momentum: float | None = None,
        block_learning_rate: float | None = None,
        nesterov: bool | None = None,
        alpha: float | None = None,
        beta: float | None = None,
        center_first: bool | None = None,
        outer_optimizer: str | OuterOptimizerFactory | None = None,
        outer_lr: float | None = None,
        outer_momentum: float | None = None,
        outer_nesterov: bool | None = None,
        outer_step_cap: float | None = None,
        timeout: timedelta | None = DEFAULT_TIMEOUT,
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
        **kwargs: Any,
    ) -> None:
        super().__init__(
            **kwargs,
            timeout=timeout,
            start_method=start_method,
        )
        self.algorithm, self._make_averager = averager_factory(
            algorithm,
            block_momentum=block_momentum,
            block_learning_rate=block_learning_rate,
            nesterov=nesterov,
            alpha=alpha,
            beta=beta,
            center_first=center_first,
            outer_optimizer=outer_optimizer,
            outer_lr=outer_lr,
            outer_momentum=outer_momentum,
            outer_nesterov=outer_nesterov,
            outer_step_cap=outer_step_cap,
        )
        self._make_averager()  # bad hyperparameters fail here, not in the worker processes
        self.period, self.warmup_steps = schedule_arguments(self.algorithm, period, warmup_steps)
        self.loss_rules = loss_rules(
            synchronous_window,
            plateau_drop,
            rollback_on_spike,
            spike_ratio,
            spike_regression,
            replace_collapsed,
        )
        self.policies = round_policies(
            buffers, optimizer_state, reduce, overlap, before_validation, ranks_per_host
        )
        self.streaming = streaming_options(
            self.algorithm,
            self.period,
            self.policies.overlap,
            fragments,
            sync_delay,
            fragment_update_alpha,
            outer_dtype,
            outer_error_feedback,
        )
        backend = str(kwargs.get("process_group_backend"))
        self.worker_loss = resolve_worker_loss(worker_loss, backend, default="stop")
        self.fault_timeout = heartbeat_seconds(
            heartbeat_timeout, self.collective_timeout.total_seconds()
        )
        self.averaging: ReplicaAveraging | None = None
        self._stepped_this_batch = False
        self._synchronous_batch = False
        self._observed_batch = False
        self._restored: dict[str, Any] | None = None
        self._checkpoint_path: StrPath | None = None

    # ------------------------------------------------------------------ setup

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        assert self.accelerator is not None
        assert self.model is not None
        self.accelerator.setup(trainer)
        fitting = trainer.state.fn == TrainerFn.FITTING
        if fitting and layer_sync(self) is not None:
            raise ValueError(
                "Trainer(sync_batchnorm=True) synchronizes BatchNorm on every step, which model "
                "averaging exists to avoid; remove it (buffers='average' averages BatchNorm "
                "statistics every round)"
            )
        self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        if fitting:
            # No DistributedDataParallel wrapper: gradients are averaged by hand during the
            # warm-up and never afterwards.
            self.setup_optimizers(trainer)
        else:
            broadcast_module_states(self.model)
        self.setup_precision_plugin()
        if fitting:
            optimizers_to_device(self.optimizers, self.root_device)
            self.averaging = self._build_averaging(trainer)
            self.averaging.broadcast_replicas(src=0)

    @override
    def keeps_survivors(self) -> bool:
        return self.worker_loss == "continue"

    def _build_averaging(self, trainer: pl.Trainer) -> ReplicaAveraging:
        assert self.lightning_module is not None
        policies, streaming = self.policies, self.streaming
        ranks_per_host = policies.ranks_per_host
        if ranks_per_host is None and policies.reduce == "tree":
            ranks_per_host = ranks_per_host_from_environment() or self.num_processes
        reduction = build_reduction(policies.reduce, ranks_per_host)
        survivors = None
        if self.worker_loss == "continue" and self.world_size > 1:
            resolve_worker_loss("continue", dist.get_backend())  # the group's real backend
            lanes = {ROUNDS_LANE: rounds_lane(reduction)}
            survivors = self.start_survivors(trainer, lanes, self.fault_timeout, "replica")
            reduction = SurvivorAllReduce(survivors, reduction)
        dtype = streaming.outer_dtype
        quantizer = None if dtype == "fp32" else BlockQuantizer(dtype)
        return ReplicaAveraging(
            module=self.lightning_module,
            optimizers=self.optimizers,
            averager=self._make_averager(),
            schedule=AveragingSchedule(self.period, self.warmup_steps),
            reduction=reduction,
            buffers=policies.buffers,
            optimizer_state=policies.optimizer_state,
            fragments=streaming.fragments,
            sync_delay=streaming.sync_delay,
            fragment_update_alpha=streaming.fragment_update_alpha,
            quantized=None if quantizer is None else QuantizedAllGather(quantizer, survivors),
            error_feedback=streaming.outer_error_feedback,
            keep_agreement=policies.before_validation == "global",
            **self.loss_rules.engine_arguments(),
        )

    @override
    def teardown(self) -> None:
        self.averaging = None
        self._restored = None
        super().teardown()

    # ------------------------------------------------------------------ training

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        super().on_train_batch_start(batch, batch_idx)
        self._stepped_this_batch = False
        if self.averaging is not None:
            self.set_activity("model averaging round (all-reduce of the replicas)")
            self.averaging.synchronize()

    @override
    def optimizer_step(
        self,
        optimizer: Optimizer,
        closure: Callable[[], Any],
        model: pl.LightningModule | Module | None = None,
        **kwargs: Any,
    ) -> Any:
        averaging = self.averaging
        if averaging is not None:
            observe = False
            if not self._stepped_this_batch:
                # One count per training step, whichever optimizer steps first in it.
                self._stepped_this_batch = True
                self._synchronous_batch = averaging.in_warmup
                observe = averaging.observes_loss
                averaging.count_optimizer_step()
            if self._synchronous_batch and averaging.world_size > 1:
                closure = averaging_gradients_after(averaging, optimizer, closure)
            elif observe:
                closure = observing_loss_after(averaging, closure)
        return super().optimizer_step(optimizer, closure, model, **kwargs)

    @override
    def on_validation_start(self) -> None:
        super().on_validation_start()
        if self.averaging is not None:
            self.averaging.prepare_evaluation(policy=self.policies.before_validation)

    @override
    def on_validation_end(self) -> None:
        super().on_validation_end()
        if self.averaging is not None:
            self.averaging.restore_replica()

    @override
    def on_train_end(self) -> None:
        super().on_train_end()
        if self.averaging is not None:
            self.averaging.finish()
