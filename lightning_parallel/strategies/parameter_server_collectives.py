"""Lightning's collectives under the parameter server: local inside an epoch, over the survivors.

:class:`ParameterServerCollectives` is the collective half of
:class:`~lightning_parallel.strategies.ParameterServerStrategy`:

1. between an epoch's first batch and its drain (:attr:`~ParameterServerCollectives._asynchronous`)
   the workers are not in step: ``reduce`` (``self.log(sync_dist=True)`` in ``training_step``)
   returns this worker's value, with a warning once, and ``barrier``, ``broadcast`` and
   ``all_gather`` raise, naming the cause;
2. elsewhere ``reduce``, ``barrier``, ``broadcast``, ``all_gather``,
   ``reduce_boolean_decision``, ``torchmetrics``' synchronisation (:meth:`_gather_for_metrics`)
   and the epoch end's buffers (:meth:`sync_buffers`) run over the ranks still in the run
   (:class:`~lightning_parallel.parameter_server.survivors.LostWorkers`): with
   ``worker_loss="continue"``, a worker lost between two training epochs fails the collective
   on every survivor; each waits for the server's verdict, moves to the survivors' group and
   runs it again. Every collective here needs every member's data (the broadcast is an
   all-gather), so that a lost worker fails it on every survivor alike;
3. nothing of the data is lost with a worker: at the first training epoch's end after a loss,
   Lightning's sampler divides the data among the survivors from the next epoch on
   (:meth:`~ParameterServerCollectives.divide_data_among_survivors`; the dataloaders are then
   rebuilt every epoch).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import pytorch_lightning as pl
import torch
from pytorch_lightning.utilities.rank_zero import rank_zero_warn
from torch import Tensor
from torch.distributed import ReduceOp
from torchmetrics.utilities.distributed import gather_all_tensors
from typing_extensions import override

from lightning_parallel.comm.devices import all_reduce_
from lightning_parallel.parameter_server.runtime import ParameterServerRuntime
from lightning_parallel.parameter_server.survivors import LostWorkers
from lightning_parallel.strategies.worker_loss import DividedData, rebuild_loaders_for

__all__: list[str] = []

_T = TypeVar("_T")


class ParameterServerCollectives(DividedData):
    """Lightning's collectives in and between asynchronous epochs (see the module docstring)."""

    #: this rank's share of the parameter server while fitting (else ``None``)
    runtime: ParameterServerRuntime | None = None
    #: ``"continue"``: collectives go on over the survivors of a lost worker; ``"stop"``: not
    worker_loss: str = "continue"
    #: seconds of heartbeat silence after which the server declares a worker lost
    fault_timeout: float
    #: the ranks still in the run and their group (set by the strategy's constructor)
    lost_workers: LostWorkers
    #: inside an epoch's training, where the workers are not in step
    _asynchronous: bool = False
    _warned_sync_dist: bool = False

    @property
    def survivors(self) -> list[int] | None:
        """The ranks still in the run, once a worker was lost (``None`` before)."""
        return self.lost_workers.survivors

    # ------------------------------------------------------------------ lost workers

    def _adopt_losses(self, count: int) -> None:
        """The server went on without ``count`` workers in all: say so, and move Lightning's
        collectives to a group of the survivors (:meth:`ParameterServerRuntime.lost_workers`
        gives every rank the same list)."""
        if self.runtime is not None:
            self.lost_workers.adopt(self.runtime, count, self.world_size)

    def divide_data_among_survivors(self, trainer: pl.Trainer) -> None:
        """At a training epoch's end, after the drain (every survivor knows the same losses
        there): if a worker was lost since the data were last divided, Lightning's sampler
        divides them among the survivors from the next epoch on, for training and validation
        (the lost worker's shard would otherwise never be trained or validated again)."""
        members = self.lost_workers.survivors
        if members is None or members == self.data_members:
            return
        self.data_members = list(members)
        rebuild_loaders_for(trainer, self.data_members, self.global_rank)

    def _collective(self, run: Callable[[Any], _T]) -> _T:
        """``run(group)``: a collective over the ranks still in the run (``group`` is ``None``,
        the default group, until a worker is lost).

        A worker lost between two training epochs (in validation, a checkpoint, logging) is
        noticed here: every survivor's collective fails, since each needs every member's data
        (the broadcast too, see :meth:`broadcast`). Each survivor then waits for the server to
        declare the loss (at once for a dead process, ``heartbeat_timeout`` for a frozen one),
        moves to the survivors' group and runs the collective again.
        """
        return self.lost_workers.call(run, self._moved_past_loss)

    def _moved_past_loss(self, error: Exception) -> bool:
        runtime = self.runtime
        if runtime is None or self.worker_loss != "continue" or self.failed:
            return False  # not going on, or the run is already ending (its teardown's calls)
        return self.lost_workers.await_verdict(
            runtime,
            error,
            self.world_size,
            self.fault_timeout,
            self._liveness,
            self.set_activity,
        )

    def _gather_for_metrics(self, tensor: Tensor, group: Any = None) -> list[Tensor]:
        # torchmetrics' ``dist_sync_fn``: its all-gather, over the ranks still in the run
        return self._collective(lambda survivors: gather_all_tensors(tensor, group=survivors))

    def sync_buffers(self) -> None:
        """Give every rank rank 0's buffers (BatchNorm statistics) at an epoch end.

        The server trains parameters only; buffers follow rank 0's at every epoch end, as
        DDP's ``broadcast_buffers`` does at every step. A sum in which every other rank adds
        zeros, not a broadcast: every rank then needs every other, so a lost worker fails it on
        every survivor alike (:meth:`_collective`); the sum is exact.
        """
        assert self.model is not None
        buffers = [buffer for buffer in self.model.buffers() if buffer.dtype != torch.bool]
        if not buffers or self.world_size < 2:
            return

        def rank_zeros(group: Any) -> None:
            for buffer in buffers:
                if self.global_rank != 0:  # again at a retry: a failed sum may have left some
                    buffer.zero_()
                all_reduce_(buffer, group)  # on the model's device: no copy

        self._collective(rank_zeros)

    # ------------------------------------------------------------------ collectives

    @override
    def reduce(
        self, tensor: Tensor, group: Any | None = None, reduce_op: ReduceOp | str | None = "mean"
    ) -> Tensor:
        if self._asynchronous:
            if not self._warned_sync_dist:
                self._warned_sync_dist = True
                rank_zero_warn(
                    "ParameterServerStrategy: values logged with sync_dist=True during training "
                    "steps are this worker's own (workers are not in step inside an epoch); "
                    "epoch-level and validation values are synchronised"
                )
            return tensor
        if group is not None or not isinstance(tensor, Tensor):
            return super().reduce(tensor, group=group, reduce_op=reduce_op)
        return self._collective(
            lambda survivors: super(ParameterServerCollectives, self).reduce(
                tensor.clone(), group=survivors, reduce_op=reduce_op
            )
        )

    def _forbid_collective(self, name: str) -> None:
        if self._asynchronous:
            raise RuntimeError(
                f"{name} was called inside an asynchronous training epoch of "
                "ParameterServerStrategy, where workers are not in step (it would hang or mix "
                "up ranks). Move it to an epoch-end or validation hook"
            )

    @override
    def barrier(self, name: str | None = None) -> None:
        self._forbid_collective("barrier")
        if not torch.distributed.is_initialized():
            return
        self.set_activity(f"barrier {name or ''}".rstrip())
        self._collective(lambda survivors: torch.distributed.barrier(group=survivors))

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        """Rank ``src``'s ``obj`` on every rank, as an all-gather of objects: every rank then
        needs every other, so that a lost worker fails the call on every survivor at once
        (:meth:`_collective`); Lightning broadcasts only small objects (paths, decisions)."""
        self._forbid_collective("broadcast")
        if not torch.distributed.is_initialized():
            return obj

        def gather(survivors: Any) -> Any:
            members = self.lost_workers.members(self.world_size)
            gathered: list[Any] = [None] * len(members)
            torch.distributed.all_gather_object(gathered, obj, group=survivors)
            return gathered[members.index(src)]

        return self._collective(gather)

    @override
    def all_gather(
        self, tensor: Tensor, group: Any | None = None, sync_grads: bool = False
    ) -> Tensor:
        self._forbid_collective("all_gather")
        if group is not None:
            return super().all_gather(tensor, group=group, sync_grads=sync_grads)
        return self._collective(
            lambda survivors: super(ParameterServerCollectives, self).all_gather(
                tensor, group=survivors, sync_grads=sync_grads
            )
        )

    @override
    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        if self.lost_workers.group is None and self.runtime is None:
            return super().reduce_boolean_decision(decision, all=all)
        votes = self.reduce(torch.tensor(int(decision), device=self.root_device), reduce_op="sum")
        members = len(self.lost_workers.members(self.world_size))
        return bool(votes == members) if all else bool(votes)
