"""Asynchronous, staleness-aware parameter-server training for any LightningModule.

``Trainer(strategy=ParameterServerStrategy(staleness="inverse"))``: every rank is a worker that
computes gradients on its own batches; the optimizer runs on server shards (threads of ordinary
ranks, on a gloo process group of their own); the user's module and optimizer are unchanged.

Supported: one optimizer, automatic optimization, validation at epoch ends, CPU or GPU workers
(the server keeps its weights and its messages on the CPU, over gloo; GPU workers ran on one
GPU shared by two ranks over gloo, not yet over NCCL, see ``docs/gpu.md``), any
``torch.optim`` optimizer and learning-rate scheduler, checkpoints that load under ``ddp``
and on one device. How a step goes:

1. Lightning's closure runs ``training_step``, backward, gradient clipping and the
   ``on_before_optimizer_step`` hooks as usual;
2. instead of ``optimizer.step()``, the worker pushes the gradient with the version of the
   weights it used and pulls the shards' current weights (:class:`ParameterClient`); a fast
   worker does not wait for a slow one unless SSP or n-softsync says so;
3. an epoch is a budget of batches shared by all workers
   (:mod:`~lightning_parallel.parameter_server.data`): fast workers take more of it; when it
   is spent every worker *drains*: its last step returns once every gradient is applied, so
   all ranks leave the epoch with the server's weights and meet Lightning's collectives
   (validation, checkpoint, logging) together;
4. between the first batch and the drain, ranks are not in step: ``self.log(sync_dist=True)``
   in ``training_step`` logs the local value (a warning says so), and a collective there
   (``barrier``, ``broadcast``, ``all_gather``) raises, naming the cause;
5. a worker that dies, freezes or is cut off during an epoch (not rank 0, not a shard host) is
   *lost*: the server goes on without it (``worker_loss="continue"``), the others finish the
   epoch's budget, and at the drain every rank logs the loss and moves Lightning's collectives
   (validation metrics, checkpoints, ``torchmetrics``) to a group of the survivors; from the
   next epoch on Lightning's sampler divides the data among them, for training and validation
   (the dataloaders are then rebuilt every epoch). A worker lost between two training epochs
   (in validation, a checkpoint) fails the next collective, which runs again over the
   survivors. A lost rank 0 or shard host ends the run on every rank with an error naming it.

The strategy is thin: the server, its client, the epoch budget and the survivors of a lost
worker (:mod:`~lightning_parallel.parameter_server.survivors`) are plain torch; its bases
:class:`~lightning_parallel.strategies.parameter_server_checkpoints.ParameterServerCheckpoints`
(the shards' optimizer state and counters in checkpoints, saved and resumed) and
:class:`~lightning_parallel.strategies.parameter_server_collectives.ParameterServerCollectives`
route Lightning's checkpoints and collectives (steps 4 and 5), and
:mod:`~lightning_parallel.strategies.parameter_server_fit` holds the configurations a fit
refuses and the epoch hooks that drain.

Example::

    trainer = Trainer(accelerator="cpu", devices=4, max_epochs=3,
                      strategy=ParameterServerStrategy(staleness="inverse", max_staleness=4))
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from datetime import timedelta
from typing import Any, Literal

import pytorch_lightning as pl
import torch
import torch.distributed as dist
from pytorch_lightning.callbacks import Callback
from pytorch_lightning.trainer.states import RunningStage, TrainerFn
from torch.optim import Optimizer
from torchmetrics import Metric
from typing_extensions import override

from lightning_parallel.comm.ledger import process_ledger
from lightning_parallel.comm.modules import broadcast_module_states
from lightning_parallel.compat import register_strategy
from lightning_parallel.compat.private import replace_sigterm_broadcast
from lightning_parallel.parameter_server.data import BudgetedLoader
from lightning_parallel.parameter_server.faults import WorkerFailure
from lightning_parallel.parameter_server.policies import UpdatePolicy
from lightning_parallel.parameter_server.protocol import parse_wire_dtype
from lightning_parallel.parameter_server.runtime import ParameterServerRuntime, check_overlap
from lightning_parallel.parameter_server.shard_optimizer import mark_stepped
from lightning_parallel.parameter_server.survivors import LostWorkers
from lightning_parallel.strategies.arguments import as_bool, as_float, as_int
from lightning_parallel.strategies.parameter_server_checkpoints import ParameterServerCheckpoints
from lightning_parallel.strategies.parameter_server_fit import ParameterServerHooks, check_fit
from lightning_parallel.strategies.worker_loss import (
    heartbeat_seconds,
    local_sigterm,
    resolve_worker_loss,
)

__all__: list[str] = []


class ParameterServerStrategy(ParameterServerCheckpoints):
    """Train asynchronously against a parameter server with staleness control.

    Args:
        staleness: learning-rate scaling by staleness τ (updates missed; 0 = fresh):
            ``"inverse"`` (default, η/(τ+1), Zhang et al.'s η/τ), ``"none"``, ``"sqrt"``
            (η/√(τ+1)), ``"exp"`` (η·e^(−staleness_decay·τ)).
        softsync: n-softsync: each server update averages n gradients (default 1: apply each
            on arrival; must not exceed the number of workers).
        max_staleness: SSP bound s: no gradient is applied more than s updates stale; a fast
            worker blocks instead (default ``None``: unbounded; ``0``: synchronous SGD).
        dc: DC-ASGD delay-compensation λ (default 0.0: off; the paper uses about 0.04).
        lr_scale: factor on the user's learning rate for every server update; ``"auto"``
            (default): ``softsync / world_size``, the step per sample of synchronous training
            (each update applies ``softsync`` gradients, not the mean of all workers'; 1 with
            ``max_staleness=0``, where every update averages one gradient per worker); a
            number: that factor (1.0: the user's rate for every gradient). The defaults,
            ``staleness="inverse"`` with ``lr_scale="auto"``, trained on every seed measured
            where ``"none"`` with 1.0 diverged on two of three (``docs/parameter_server.md``).
        overlap: compute the next batch while the step's gradient and the fresh weights are
            on the wire (default ``False``): hides the exchange at the cost of one exchange of
            staleness per gradient; needs ``max_staleness=None``.
        wire_dtype: ``"bfloat16"`` or ``"float16"``: gradients and weights travel between ranks
            in half precision (half the bytes; the server keeps and updates full-precision
            weights; default ``None``: the parameters' dtype).
        drop_staleness: drop gradients staler than this (default ``None``: keep all).
        staleness_decay: decay c of ``"exp"`` scaling (default 0.5).
        server_rank: global rank hosting the first shard (default 0; shard k is on
            ``(server_rank + k) % world_size``).
        shards: number of server shards (default 1), each owning whole parameters.
        worker_loss: what a lost worker does to the run (step 5 above): ``"continue"`` goes on
            without it; ``"stop"`` ends the run on every rank with
            :class:`~lightning_parallel.parameter_server.WorkerFailure` naming it. Default
            ``None``: ``"continue"`` over a gloo default group, ``"stop"`` over NCCL (an NCCL
            communicator does not survive a lost peer: Lightning's collectives could not go on
            among the survivors), where ``"continue"`` is refused.
        heartbeat_timeout: seconds of heartbeat silence after which a worker counts as lost
            (default: half of ``timeout``, at most 60); a worker whose process dies is detected
            at once. Must be shorter than ``timeout``, so that a frozen worker is declared lost
            before the others' transfers time out.
        start_method: how Lightning starts the processes: ``"popen"`` (default, like ``ddp``),
            ``"spawn"``, ``"fork"``, ``"forkserver"``; ignored when the processes are started
            by an outside launcher (torchrun, SLURM, the benchmark's cluster).
        **kwargs: Lightning's strategy arguments (``accelerator``, ``parallel_devices``,
            ``cluster_environment``, ``checkpoint_io``, ``precision_plugin``,
            ``process_group_backend``), passed on by :class:`ParallelStrategyBase`.
    """

    #: CommStats must not add DDP's analytic allreduce bytes: this strategy reports its own.
    reports_communication = True
    wraps_in_ddp = False  # no DistributedDataParallel: its keywords are refused

    def __init__(
        self,
        staleness: str = "inverse",
        softsync: int = 1,
        softsync_wait: bool = True,
        max_staleness: int | float | None = None,
        dc: float = 0.0,
        lr_scale: float | Literal["auto"] = "auto",
        overlap: bool = False,
        wire_dtype: str | None = None,
        drop_staleness: int | float | None = None,
        staleness_decay: float = 0.5,
        server_rank: int = 0,
        shards: int = 1,
        worker_loss: Literal["continue", "stop"] | None = None,
        heartbeat_timeout: float | None = None,
        timeout: timedelta | None = None,
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
        **kwargs: Any,
    ) -> None:
        self.policy = UpdatePolicy(
            staleness=str(staleness),
            staleness_decay=as_float("staleness_decay", staleness_decay),
            drop_staleness=drop_staleness,  # type: ignore[arg-type]
            softsync=softsync,
            softsync_wait=as_bool("softsync_wait", softsync_wait),
            max_staleness=max_staleness,  # type: ignore[arg-type]
            delay_compensation=as_float("dc", dc),
            lr_scale=1.0 if lr_scale == "auto" else as_float("lr_scale", lr_scale),
        )
        self.lr_scale_auto = lr_scale == "auto"
        self.overlap = as_bool("overlap", overlap)
        self.wire_dtype = parse_wire_dtype(wire_dtype)
        check_overlap(self.overlap, self.policy)
        if as_int("server_rank", server_rank) < 0:
            raise ValueError(f"server_rank must be a global rank >= 0, got {server_rank!r}")
        if as_int("shards", shards) < 1:
            raise ValueError(f"shards must be an integer >= 1, got {shards!r}")
        # an explicit NCCL backend refuses "continue" now; otherwise setup resolves the default
        resolve_worker_loss(worker_loss, str(kwargs.get("process_group_backend")))
        super().__init__(
            start_method=start_method,
            timeout=timeout,
            **kwargs,
        )
        self.server_rank = int(server_rank)
        self.shards = int(shards)
        self.worker_loss_setting = worker_loss
        self.worker_loss: str = worker_loss or "continue"  # resolved at setup (the backend)
        self.fault_timeout = heartbeat_seconds(
            heartbeat_timeout, self.collective_timeout.total_seconds()
        )
        self.runtime: ParameterServerRuntime | None = None
        self._asynchronous = False
        self._skipped = False
        #: prefetched batches not trained because a faster worker took their grant
        self.skipped_batches = 0
        self._bytes_sent = 0.0
        self._warned_sync_dist = False
        self._restore: list[Callable[[], None]] = []
        self._hooks = ParameterServerHooks(self.drain, self.divide_data_among_survivors)
        self._limit: int | float = 1.0
        #: the ranks still in the run and their group, once a worker was lost
        self.lost_workers = LostWorkers()

    # ------------------------------------------------------------------ launch and setup

    @override
    def keeps_survivors(self) -> bool:
        return self.worker_loss == "continue"  # before setup: the setting, or the gloo default

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        assert self.accelerator is not None and self.model is not None
        self.accelerator.setup(trainer)
        fitting = trainer.state.fn == TrainerFn.FITTING
        if fitting:
            self._check_configuration(trainer)
        self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        # every worker starts from rank 0's weights, like DDP
        broadcast_module_states(self.model, group=self.lost_workers.group)
        if fitting:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        if fitting:
            self._start(trainer)

    def _check_configuration(self, trainer: pl.Trainer) -> None:
        self.worker_loss = resolve_worker_loss(self.worker_loss_setting, dist.get_backend())
        self.policy = check_fit(
            trainer,
            self.policy,
            lr_scale_auto=self.lr_scale_auto,
            shards=self.shards,
            server_rank=self.server_rank,
        )

    def _start(self, trainer: pl.Trainer) -> None:
        if len(self.optimizers) != 1:
            raise ValueError(
                f"ParameterServerStrategy runs exactly one optimizer on the server; "
                f"configure_optimizers returned {len(self.optimizers)}"
            )
        epoch_loop = trainer.fit_loop.epoch_loop
        accumulate = trainer.accumulate_grad_batches
        run_batches = None
        max_steps = epoch_loop.max_steps
        if max_steps >= 0:
            # a step budget is global: fast workers take more of it (see the module docstring)
            run_batches = max_steps * accumulate * trainer.world_size
            epoch_loop.max_steps = -1
            self._restore.append(lambda: setattr(epoch_loop, "max_steps", max_steps))
        self._limit = trainer.limit_train_batches
        if self._limit != 1.0:
            # the limit becomes this rank's contribution to the epoch budget (process_dataloader)
            limit = trainer.limit_train_batches
            trainer.limit_train_batches = 1.0
            self._restore.append(lambda: setattr(trainer, "limit_train_batches", limit))
        # Lightning broadcasts a SIGTERM flag from rank 0 before every training batch, which
        # would put the workers back in lockstep; each rank checks its own signal instead.
        self._restore.append(replace_sigterm_broadcast(trainer, lambda: local_sigterm(trainer)))
        # a lost worker's data are divided among the survivors by rebuilding the loaders
        reload_every = getattr(trainer, "reload_dataloaders_every_n_epochs", 0)
        self._restore.append(
            functools.partial(setattr, trainer, "reload_dataloaders_every_n_epochs", reload_every)
        )
        self.runtime = ParameterServerRuntime(
            self.optimizers[0],
            self.policy,
            shards=self.shards,
            server_rank=self.server_rank,
            timeout=self.fault_timeout,
            run_batches=run_batches,
            lookahead=accumulate + 1,
            overlap=self.overlap,
            lends=accumulate == 1,
            wire_dtype=self.wire_dtype,
            continue_without_lost=self.worker_loss == "continue",
        )
        for metric in trainer.lightning_module.modules():
            if isinstance(metric, Metric) and metric.dist_sync_fn is None:
                # torchmetrics synchronises over the ranks still in the run (_collective)
                metric.dist_sync_fn = self._gather_for_metrics
                self._restore.append(functools.partial(setattr, metric, "dist_sync_fn", None))

    @override
    def strategy_callbacks(self, trainer: pl.Trainer) -> list[Callback]:
        return [self._hooks]

    @override
    def process_dataloader(self, dataloader: object) -> object:
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        if self.runtime is None or trainer is None or trainer.state.stage != RunningStage.TRAINING:
            return dataloader
        limit: int | None = None
        if isinstance(self._limit, int):
            limit = self._limit
        elif self._limit != 1.0 and hasattr(dataloader, "__len__"):
            limit = max(1, int(len(dataloader) * self._limit))
        runtime = self.runtime
        return BudgetedLoader(
            dataloader,  # type: ignore[arg-type]
            lambda: runtime.client,
            limit=limit,
            deferred=True,  # Lightning fetches one batch ahead: spend grants at training_step
        )

    # ------------------------------------------------------------------ the step

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        self._asynchronous = self.runtime is not None

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        # The batch's grant is spent now, not when the loader fetched it one batch earlier: a
        # faster worker may have taken it meanwhile (the epoch's tail). Then the batch is not
        # trained: the module's training_step is not called, a constant zero stands in for the
        # loss (Lightning refuses None in distributed training) and nothing is pushed.
        runtime = self.runtime
        self._skipped = runtime is not None and not runtime.client.start_batch()
        if self._skipped:
            self.skipped_batches += 1
            process_ledger().set_gauge("ps_skipped_batches", float(self.skipped_batches))
            return torch.zeros((), device=self.root_device, requires_grad=True)
        return super().training_step(*args, **kwargs)

    @override
    def optimizer_step(
        self,
        optimizer: Optimizer,
        closure: Callable[[], Any],
        model: pl.LightningModule | torch.nn.Module | None = None,
        **kwargs: Any,
    ) -> Any:
        runtime = self.runtime
        if runtime is None:
            return super().optimizer_step(optimizer, closure, model, **kwargs)
        trainer = self.lightning_module.trainer  # type: ignore[union-attr]

        def push_and_pull(closure: Callable[[], Any] | None = None, **_: Any) -> Any:
            # the precision plugin's closure: training_step, backward, clipping, hooks
            loss = closure() if closure is not None else None
            if self._skipped:
                return loss  # the batch went to a faster worker: nothing to push
            has_gradient = any(p.grad is not None for p in runtime.parameters)
            drain = bool(trainer.fit_loop.epoch_loop.batch_progress.is_last_batch)
            self.set_activity("push of the gradient to the server, pull of its weights")
            runtime.client.step(has_gradient, drain=drain)
            mark_stepped(optimizer)  # for torch's schedulers: the server stepped in its place
            self._after_exchange(trainer, drained=drain)
            return loss

        previous = optimizer.__dict__.get("step")
        optimizer.step = push_and_pull  # type: ignore[method-assign]
        try:
            module = model if isinstance(model, pl.LightningModule) else self.lightning_module
            assert module is not None
            return self.precision_plugin.optimizer_step(
                optimizer, model=module, closure=closure, **kwargs
            )
        finally:
            if previous is None:
                del optimizer.step
            else:
                optimizer.step = previous  # type: ignore[method-assign]

    @override
    def barrier(self, name: str | None = None) -> None:
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        if self._asynchronous and trainer is not None and trainer.validating:
            # Lightning's validation rebuilds its dataloader (every epoch after a lost worker)
            # and meets at a barrier before on_validation_start, whose drain then comes first
            self.drain(trainer)
        super().barrier(name)

    def drain(self, trainer: pl.Trainer) -> None:
        """End the epoch now if this worker has not drained yet (no gradient sent)."""
        if self.runtime is not None and self.runtime.client.in_epoch:
            self.runtime.client.drain()
            self._after_exchange(trainer, drained=True)

    def _after_exchange(self, trainer: pl.Trainer, drained: bool) -> None:
        assert self.runtime is not None
        ledger = process_ledger()
        # The point-to-point messages are counted by ``track_collectives`` (as every
        # collective is, under ``CommStats``); the runtime's own count is a gauge, not added
        # to the ledger's bytes a second time.
        self._bytes_sent += self.runtime.take_bytes()
        ledger.set_gauge("ps_bytes_sent", self._bytes_sent)
        for name, value in self.runtime.gauges().items():
            ledger.set_gauge(name, value)
        if drained:
            self._asynchronous = False
            self._adopt_losses(self.runtime.client.lost)
            self.sync_buffers()
            if self.runtime.client.run_over:
                trainer.should_stop = True

    # ------------------------------------------------------------------ end

    @override
    def on_exception(self, exception: BaseException) -> None:
        failure = self.runtime.failure if self.runtime is not None else None
        if failure is not None and not isinstance(exception, WorkerFailure) and exception.args:
            rank, reason = failure
            exception.args = (
                f"{exception.args[0]}\n[parameter server] worker rank {rank} failed: {reason}",
                *exception.args[1:],
            )
        super().on_exception(exception)

    @override
    def teardown(self) -> None:
        self._asynchronous = False
        runtime, self.runtime = self.runtime, None
        if runtime is not None:
            if not self.failed and runtime.failure is None:
                # the user's optimizer never stepped: give it the server's state, so that
                # `trainer.optimizers` and later checkpoints hold the trained state
                gathered = runtime.gather_state()
                if gathered is not None:
                    runtime.optimizer.load_state_dict(gathered[0])
            runtime.close(failed=self.failed)
        while self._restore:
            self._restore.pop()()
        self.data_members = None
        super().teardown()


register_strategy(
    "parameter_server",
    ParameterServerStrategy,
    "asynchronous parameter server with staleness control (scaling, softsync, SSP, DC-ASGD)",
)
register_strategy(
    "async_ps",
    ParameterServerStrategy,
    "alias of parameter_server: asynchronous SGD on a parameter server",
)
