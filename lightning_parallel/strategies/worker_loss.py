"""Lightning's collectives over the ranks still in the run: the strategies' half of lost workers.

:class:`SurvivorCollectives` is a strategy base whose ``reduce``, ``all_gather``, ``barrier``,
``broadcast``, ``reduce_boolean_decision`` and ``torchmetrics``' synchronisation run as agreed
collectives of :class:`~lightning_parallel.comm.survivors.Survivors` (its ``"lightning"`` lane)
once :meth:`SurvivorCollectives.start_survivors` was called: a rank that is lost during
training, validation or a checkpoint is declared by rank 0's watchdog, every survivor logs it,
and the collective runs again over the survivors. Lightning's per-step broadcast of rank 0's
SIGTERM flag becomes a local check (each rank reads its own signal: a SIGTERM sent to every
process, as cluster schedulers do, still stops every rank at the same step).

Nothing of the data is lost with a rank: at the end of every training epoch the survivors agree
on who is left (one barrier), and after a loss Lightning's distributed sampler divides the data
among them from the next epoch on (``distributed_sampler_kwargs``; the dataloaders are rebuilt
every epoch from then, ``Trainer.reload_dataloaders_every_n_epochs = 1``, the user's value
coming back at teardown). A dataloader that brings its own sampler keeps it. The parameter
server's collectives divide the data the same way (:class:`DividedData`,
:func:`rebuild_loaders_for`).

After a fit that lost a rank, a later run in the same processes (``validate``, ``test``,
``predict``, another ``fit``) is refused at its start, naming the lost rank: the default process
group still counts it, so that run's first collective would fail, or wait for a frozen rank.

The argument rules every strategy with a ``worker_loss`` shares live here too
(:func:`resolve_worker_loss`, :func:`heartbeat_seconds`).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any

import pytorch_lightning as pl
import torch
import torch.distributed as dist
from pytorch_lightning.callbacks import Callback
from pytorch_lightning.utilities.exceptions import SIGTERMException
from torch import Tensor
from torch.distributed import ReduceOp
from torchmetrics import Metric
from torchmetrics.utilities.distributed import gather_all_tensors
from typing_extensions import override

from lightning_parallel.comm.ledger import process_ledger
from lightning_parallel.comm.liveness import default_store
from lightning_parallel.comm.survivors import Survivors, View
from lightning_parallel.compat.private import attached_trainer, replace_sigterm_broadcast
from lightning_parallel.strategies.arguments import optional_float
from lightning_parallel.strategies.base import ParallelStrategyBase

__all__: list[str] = []

log = logging.getLogger(__name__)

#: the lane of :class:`~lightning_parallel.comm.survivors.Survivors` Lightning's collectives use
LIGHTNING_LANE = "lightning"

CONTINUE_NEEDS_GLOO = (
    "worker_loss='continue' needs a gloo default process group: an NCCL communicator does not "
    "survive a lost peer, so Lightning's collectives could not go on among the survivors; use "
    "worker_loss='stop' (the default over NCCL) or process_group_backend='gloo'"
)


def resolve_worker_loss(setting: str | None, backend: str, default: str = "continue") -> str:
    """``setting``, or the default for the default group's ``backend``: ``"stop"`` where NCCL
    carries it (``"nccl"``, ``"cpu:gloo,cuda:nccl"``), else ``default``.

    Raises:
        ValueError: a setting other than ``"continue"``/``"stop"``, or ``"continue"`` over NCCL.
    """
    if setting not in ("continue", "stop", None):
        raise ValueError(f"worker_loss must be 'continue' or 'stop', got {setting!r}")
    nccl = "nccl" in str(backend)
    if setting == "continue" and nccl:
        raise ValueError(CONTINUE_NEEDS_GLOO)
    return setting or ("stop" if nccl else default)


def heartbeat_seconds(value: object, limit: float) -> float:
    """The heartbeat silence after which a rank is lost: ``value`` seconds, or by default half
    of the collective timeout ``limit``, at most 60.

    Raises:
        ValueError: not a positive number, or not shorter than ``limit`` (a frozen rank must be
            declared lost before the others' collectives time out).
    """
    seconds = optional_float("heartbeat_timeout", value)
    if seconds is None:
        return min(60.0, limit / 2)
    if not seconds > 0:
        raise ValueError(f"heartbeat_timeout must be > 0 seconds, got {value!r}")
    if seconds >= limit:
        raise ValueError(
            f"heartbeat_timeout={value!r} s must be shorter than timeout ({limit:g} s): a frozen "
            "worker must be declared lost before the others' collectives time out; use "
            f"heartbeat_timeout={limit / 2:g} or raise timeout"
        )
    return seconds


class DividedData(ParallelStrategyBase):
    """Lightning's distributed sampler over the ranks the data are divided among: all of them,
    or once a loss divided the data again, the survivors (:attr:`data_members`)."""

    #: the ranks the data are divided among, once a loss changed them (else ``None``: all)
    data_members: list[int] | None = None

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        """Lightning's, or this rank's share among :attr:`data_members` (a rank no longer among
        them keeps Lightning's: it is leaving the run)."""
        kwargs: dict[str, Any] = super().distributed_sampler_kwargs
        members, rank = self.data_members, self.global_rank
        if members is None or rank not in members:
            return kwargs
        return {**kwargs, "num_replicas": len(members), "rank": members.index(rank)}


def rebuild_loaders_for(trainer: pl.Trainer, members: list[int], rank: int) -> None:
    """Have Lightning rebuild the dataloaders every epoch from the next one on, so that its
    sampler divides the data among ``members`` (:class:`DividedData`); the first says so.

    The caller puts the user's ``reload_dataloaders_every_n_epochs`` back at teardown.
    """
    trainer.reload_dataloaders_every_n_epochs = 1  # type: ignore[attr-defined]
    if rank == members[0]:
        log.warning(
            "rank %d: from the next epoch on, the data are divided among the %d remaining "
            "ranks %s (the dataloaders are rebuilt every epoch)",
            rank,
            len(members),
            members,
        )


def local_sigterm(trainer: pl.Trainer) -> None:
    """Stop this rank if it received SIGTERM (instead of rank 0's flag, broadcast every step)."""
    if getattr(trainer, "received_sigterm", False):
        raise SIGTERMException()


class SurvivorCollectives(DividedData):
    """Lightning's collectives over the survivors once :meth:`start_survivors` ran (module doc)."""

    #: the agreed collectives while fitting with ``worker_loss="continue"`` (else ``None``)
    survivors: Survivors | None = None
    #: the ranks a fit of these processes lost, and why (a later run here is refused)
    lost_in_fit: tuple[tuple[int, str], ...] = ()
    _undo_survivors: list[Callable[[], None]]

    def start_survivors(
        self, trainer: pl.Trainer, lanes: dict[str, Any], timeout: float, what: str
    ) -> Survivors:
        """Route Lightning's collectives through agreed ones over the ranks still in the run.

        Args:
            lanes: more lanes (name: their group over every rank), after Lightning's own.
            timeout: seconds of heartbeat silence after which a rank is lost.
            what: how the log names a rank (``"replica"``, ``"worker"``).
        """
        store = default_store()
        if store is None or self._liveness is None:
            raise RuntimeError(
                "worker_loss='continue' needs the process group's store and this strategy's "
                "heartbeats; neither is there (one process?)"
            )
        survivors = Survivors(
            store,
            self._liveness.store,
            self.global_rank,
            self.world_size,
            {LIGHTNING_LANE: None, **lanes},
            timeout=timeout,
            device=self.root_device,
            on_loss=functools.partial(self._log_loss, what),
        )
        self.survivors = survivors
        reload_every = getattr(trainer, "reload_dataloaders_every_n_epochs", 0)
        self._undo_survivors = [
            replace_sigterm_broadcast(trainer, lambda: local_sigterm(trainer)),
            survivors.close,
            functools.partial(setattr, trainer, "reload_dataloaders_every_n_epochs", reload_every),
        ]
        for metric in trainer.lightning_module.modules():
            if isinstance(metric, Metric) and metric.dist_sync_fn is None:
                metric.dist_sync_fn = self._gather_for_metrics
                undo = functools.partial(setattr, metric, "dist_sync_fn", None)
                self._undo_survivors.append(undo)
        return survivors

    @override
    def setup_environment(self) -> None:
        """Refuse a run (``validate``, ``test``, ``predict``, another ``fit``) in processes
        whose last fit lost a rank: the default process group still counts it, so the run's
        first collective would fail, or wait for a frozen rank until the timeout."""
        if self.lost_in_fit:
            ranks = sorted(rank for rank, _ in self.lost_in_fit)
            trainer = attached_trainer(self.lightning_module)
            run = getattr(getattr(trainer, "state", None), "fn", None)
            raise RuntimeError(
                f"rank(s) {ranks} were lost during the last fit of these processes "
                f"(worker_loss='continue'), and the process group still counts them: "
                f"{'this run' if run is None else repr(str(run.value))} would fail or hang on "
                "its first collective. Run it in a new job (a checkpoint written after the "
                f"loss resumes on {self.world_size - len(ranks)} processes), or on one process "
                "(Trainer(devices=1), loading the checkpoint)"
            )
        super().setup_environment()

    def _log_loss(self, what: str, view: View) -> None:
        rank, reason = view.lost[-1]
        members = view.members
        log.warning(
            "rank %d: %s rank %d was lost (%s); training continues on the %d remaining %s%s "
            "(ranks %s)",
            self.global_rank,
            what,
            rank,
            reason,
            len(members),
            what,
            "" if len(members) == 1 else "s",
            members,
        )
        process_ledger().set_gauge("workers_lost", float(len(view.lost)))

    @override
    def strategy_callbacks(self, trainer: pl.Trainer) -> list[Callback]:
        # a no-op until start_survivors ran (worker_loss="continue" while fitting)
        return [*super().strategy_callbacks(trainer), _DivideAmongSurvivors(self)]

    def divide_data_among_survivors(self, trainer: pl.Trainer) -> None:
        """At a training epoch's end (every rank): agree who is left, and if a rank was lost
        since the data were last divided, divide them among the survivors from the next epoch
        on (the lost rank's shard would otherwise never be trained or validated again)."""
        if self.survivors is None:
            return
        members = self.survivors.call(LIGHTNING_LANE, _agreed_members)
        if members == (self.data_members or list(range(self.world_size))):
            return
        self.data_members = members
        rebuild_loaders_for(trainer, members, self.global_rank)

    def member_index(self) -> int:
        """This rank's place among the ranks still in the run (its global rank before a loss)."""
        if self.survivors is None:
            return self.global_rank
        return self.survivors.members.index(self.global_rank)

    def gather_objects(self, obj: Any) -> list[Any]:
        """Every rank's ``obj`` still in the run, in rank order, on every rank."""

        def gather(group: Any, members: list[int]) -> list[Any]:
            gathered: list[Any] = [None] * len(members)
            dist.all_gather_object(gathered, obj, group=group)
            return gathered

        if self.survivors is None:
            return gather(None, list(range(self.world_size)))
        return self.survivors.call(LIGHTNING_LANE, gather)

    def _gather_for_metrics(self, tensor: Tensor, group: Any = None) -> list[Tensor]:
        # torchmetrics' ``dist_sync_fn``: its all-gather, over the ranks still in the run
        assert self.survivors is not None
        return self.survivors.call(
            LIGHTNING_LANE, lambda survivors, _: gather_all_tensors(tensor, group=survivors)
        )

    # ------------------------------------------------------------------ collectives

    @override
    def reduce(
        self, tensor: Tensor, group: Any | None = None, reduce_op: ReduceOp | str | None = "mean"
    ) -> Tensor:
        if self.survivors is None or group is not None or not isinstance(tensor, Tensor):
            return super().reduce(tensor, group=group, reduce_op=reduce_op)
        base = super().reduce

        def reduced(survivors: Any, _: list[int]) -> Tensor:
            return base(tensor.clone(), group=survivors, reduce_op=reduce_op)

        return self.survivors.call(LIGHTNING_LANE, reduced)

    @override
    def all_gather(
        self, tensor: Tensor, group: Any | None = None, sync_grads: bool = False
    ) -> Tensor:
        if self.survivors is None or group is not None:
            return super().all_gather(tensor, group=group, sync_grads=sync_grads)
        base = super().all_gather

        def gathered(survivors: Any, _: list[int]) -> Tensor:
            return base(tensor, group=survivors, sync_grads=sync_grads)

        return self.survivors.call(LIGHTNING_LANE, gathered)

    @override
    def barrier(self, name: str | None = None) -> None:
        if self.survivors is None:
            super().barrier(name)
            return
        self.set_activity(f"barrier {name or ''}".rstrip())
        self.survivors.call(LIGHTNING_LANE, lambda survivors, _: dist.barrier(group=survivors))

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        """Rank ``src``'s ``obj``, as an all-gather of objects: every rank needs every other,
        so a lost rank fails the call on every survivor alike (Lightning broadcasts only small
        objects: paths, decisions)."""
        if self.survivors is None:
            return super().broadcast(obj, src=src)
        gathered = self.gather_objects(obj)
        return gathered[self.survivors.members.index(src)]

    @override
    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        if self.survivors is None:
            return super().reduce_boolean_decision(decision, all=all)

        def votes(group: Any, members: list[int]) -> tuple[int, int]:
            total = torch.tensor([int(decision)], device=self.root_device)
            dist.all_reduce(total, group=group)
            return int(total.item()), len(members)

        count, members = self.survivors.call(LIGHTNING_LANE, votes)
        return count == members if all else count > 0

    @override
    def teardown(self) -> None:
        if self.survivors is not None and self.survivors.view.lost:
            self.lost_in_fit = tuple(self.survivors.view.lost)
        while getattr(self, "_undo_survivors", None):
            self._undo_survivors.pop()()
        self.survivors = None
        self.data_members = None
        super().teardown()


def _agreed_members(group: Any, members: list[int]) -> list[int]:
    """A barrier of the ranks still in the run; who they are (the same list on each)."""
    dist.barrier(group=group)
    return list(members)


class _DivideAmongSurvivors(Callback):
    """Calls :meth:`SurvivorCollectives.divide_data_among_survivors` at each training epoch's
    end (after that epoch's validation), where every rank is, in the callbacks' order."""

    def __init__(self, strategy: SurvivorCollectives) -> None:
        self.strategy = strategy

    @override
    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.strategy.divide_data_among_survivors(trainer)
