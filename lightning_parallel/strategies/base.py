"""The base of every strategy here: one launcher rule, checked arguments, timeouts on every group.

:class:`ParallelStrategyBase` is Lightning's ``DDPStrategy`` with what every strategy of this
package shares, written once:

1. **arguments**: Lightning's strategy arguments (``accelerator``, ``parallel_devices``,
   ``cluster_environment``, ``checkpoint_io``, ``precision_plugin``, ``process_group_backend``,
   ``start_method``, ``timeout``) pass through ``**kwargs``; a keyword nothing accepts fails at
   construction, naming the ones that are accepted. ``DistributedDataParallel`` keywords are
   accepted only by strategies that wrap the model in it (:attr:`wraps_in_ddp`).
2. **one meaning of timeout**: a ``datetime.timedelta``, as Lightning's; it is the default
   group's timeout and, through :func:`lightning_parallel.comm.groups.set_group_timeout`, that
   of every subgroup the strategy and the cores create (pipeline, data-parallel, averaging,
   tree-reduce and parameter-server groups), so a dead peer raises after it everywhere.
3. **launcher**: ``start_method="popen"`` (Lightning's default, and what torchrun, SLURM or the
   simulated cluster need) or a ``multiprocessing`` start method; processes started by someone
   else are recognised the same way for every strategy.
4. **world-size checks** (:meth:`check_world_size`): run when the ``Trainer`` is built, before
   any process starts, so ``GroPipeStrategy(stages=3)`` on 2 devices fails in ``Trainer(...)``.
5. **a checkpoint asked for after the run raised** (Lightning's ``OnExceptionCheckpoint``)
   that needs every rank (a gather, an average) is written only if every rank asks for it:
   :meth:`ParallelStrategyBase.check_every_rank_saves` asks through the rendezvous store
   first and raises :class:`~lightning_parallel.files.PartialCheckpointError` after
   :data:`FAILED_RUN_WAIT` (or half the group's timeout) instead of waiting in a collective
   for a peer that is lost or stuck inside the step that failed;
6. **a failure names the lost peer**: every rank keeps a heartbeat in the rendezvous store and
   records what it is doing (:mod:`lightning_parallel.comm.liveness`); when a collective fails
   (a peer killed: at once; frozen or cut off: after ``timeout``), :meth:`on_exception` finds
   the ranks whose heartbeat stopped, logs one line naming them, their last activity and this
   rank's, and adds it to the exception as a note (shown under the traceback). Lightning's
   per-step broadcast of rank 0's SIGTERM flag swallows a failed broadcast and goes on to wait
   a second ``timeout`` in the next collective; here that broadcast raises instead.
"""

from __future__ import annotations

import inspect
import logging
import os
from collections.abc import Callable
from contextlib import suppress
from datetime import timedelta
from typing import Any, ClassVar

import pytorch_lightning as pl
import torch
import torch.distributed as dist
from pytorch_lightning.callbacks import Callback
from pytorch_lightning.strategies import DDPStrategy
from pytorch_lightning.utilities.exceptions import SIGTERMException
from pytorch_lightning.utilities.rank_zero import rank_zero_warn
from torch import Tensor
from torch.distributed.constants import default_pg_timeout
from torch.nn.parallel import DistributedDataParallel
from typing_extensions import override

from lightning_parallel.comm.arrival import ranks_missing
from lightning_parallel.comm.devices import to_group
from lightning_parallel.comm.groups import set_group_timeout
from lightning_parallel.comm.liveness import (
    Liveness,
    default_store,
    is_communication_error,
    set_activity,
)
from lightning_parallel.compat import check
from lightning_parallel.compat.private import (
    attached_trainer,
    check_start_method,
    make_launcher,
    replace_sigterm_broadcast,
    set_launcher,
    start_method,
)
from lightning_parallel.compat.types import StrPath
from lightning_parallel.files import PartialCheckpointError

__all__ = ["FAILED_RUN_WAIT", "ParallelStrategyBase", "as_timeout"]

log = logging.getLogger(__name__)

# Lightning's ParallelStrategy/DDPStrategy arguments that every strategy here passes through
LIGHTNING_ARGUMENTS = (
    "accelerator",
    "parallel_devices",
    "cluster_environment",
    "checkpoint_io",
    "precision_plugin",
    "process_group_backend",
)
# DDPStrategy's own arguments beyond those, for the strategies that wrap the model in DDP
_DDP_STRATEGY_ARGUMENTS = ("ddp_comm_state", "ddp_comm_hook", "ddp_comm_wrapper")


def as_timeout(value: Any) -> timedelta:
    """``value`` as a collective timeout, or a ``TypeError``/``ValueError`` naming the fix.

    Raises:
        TypeError: a number or anything else than a ``timedelta`` (the message shows the call
            to write instead).
        ValueError: a timeout that is not positive.
    """
    if value is None:
        return default_pg_timeout
    if isinstance(value, bool) or not isinstance(value, timedelta):
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            raise TypeError(
                f"timeout is a datetime.timedelta, as in Lightning's strategies; "
                f"got the number {value!r}: use timeout=timedelta(seconds={value!r})"
            )
        raise TypeError(f"timeout must be a datetime.timedelta, got {type(value).__name__}")
    if value.total_seconds() <= 0:
        raise ValueError(f"timeout must be positive, got {value!r}")
    return value


#: how long a checkpoint asked for after the run raised waits for every rank to ask too
FAILED_RUN_WAIT = timedelta(seconds=30)


class ParallelStrategyBase(DDPStrategy):
    """Lightning's ``DDPStrategy`` with this package's shared rules (see the module docstring).

    Args:
        start_method: ``"popen"`` (default), ``"spawn"``, ``"fork"`` or ``"forkserver"``.
        timeout: a ``timedelta`` for every collective of the run, subgroups included (default:
            torch's, 30 minutes).
        **kwargs: Lightning's strategy arguments (``accelerator``, ``parallel_devices``,
            ``cluster_environment``, ``checkpoint_io``, ``precision_plugin``,
            ``process_group_backend``) and, for a strategy that wraps the model in
            ``DistributedDataParallel``, that class's keywords.

    Raises:
        TypeError: a keyword no class of the strategy accepts (the message lists the accepted
            ones), or a ``timeout`` that is not a ``timedelta``.
    """

    #: whether the model is wrapped in ``DistributedDataParallel`` (its keywords are accepted)
    wraps_in_ddp: ClassVar[bool] = True
    #: whether every byte the strategy sends goes through Python collectives that
    #: :mod:`~lightning_parallel.comm.accounting` counts (``CommStats`` then adds no estimate
    #: of DDP's C++ allreduce on top); a callback may say the same of itself
    reports_communication: ClassVar[bool] = False
    #: read rank 0's per-batch SIGTERM flag one batch late (:class:`LateSigtermFlag`), so that
    #: no rank waits for the others at every batch (a pipeline that never flushes)
    sigterm_read_late: ClassVar[bool] = False

    def __init__(
        self, start_method: str = "popen", timeout: timedelta | None = None, **kwargs: Any
    ) -> None:
        check(self)  # this Lightning has every private name we use (compat.private)
        check_start_method(start_method)
        self.collective_timeout = as_timeout(timeout)
        unknown = sorted(set(kwargs) - self._pass_through_keywords())
        if unknown:
            accepted = ", ".join(sorted(self.accepted_keywords()))
            raise TypeError(
                f"{type(self).__name__} got unexpected keyword argument(s) "
                f"{', '.join(map(repr, unknown))}; it accepts {accepted}"
            )
        super().__init__(
            start_method=start_method,  # type: ignore[arg-type]
            timeout=self.collective_timeout,
            **kwargs,
        )
        self._liveness: Liveness | None = None
        self.returns_model_to_parent = False
        #: the run raised (on_exception): teardown waits for nothing a lost peer may block
        self.failed = False
        #: checkpoints asked for after the run raised (each arrival has its own name)
        self._failed_saves = 0
        self._restore_sigterm: Callable[[], None] | None = None
        self._late_sigterm: LateSigtermFlag | None = None
        self._attached: list[tuple[list[Callback], Callback]] = []

    def strategy_callbacks(self, trainer: pl.Trainer) -> list[Callback]:
        """The callbacks this strategy needs on ``trainer`` (default: none).

        They are attached once, in :meth:`setup_environment` (before Lightning restores
        callback state from a checkpoint, so theirs comes back on a resume), and removed at
        :meth:`teardown`; one already on the trainer is left as it is.
        """
        return []

    @classmethod
    def _pass_through_keywords(cls) -> set[str]:
        names = set(LIGHTNING_ARGUMENTS)
        if cls.wraps_in_ddp:
            names |= set(_DDP_STRATEGY_ARGUMENTS) | _ddp_keywords()
        return names

    @classmethod
    def accepted_keywords(cls) -> set[str]:
        """Every keyword the strategy's constructor accepts, its own and those it passes on."""
        names = cls._pass_through_keywords() | {"start_method", "timeout"}
        for klass in cls.__mro__:
            if klass is ParallelStrategyBase:
                break
            init = vars(klass).get("__init__")
            if init is None:
                continue
            for parameter in inspect.signature(init).parameters.values():
                if parameter.kind not in (parameter.VAR_KEYWORD, parameter.VAR_POSITIONAL):
                    names.add(parameter.name)
        return names - {"self"}

    # -- launch ------------------------------------------------------------------------------

    def launched_externally(self) -> bool:
        """Whether someone else started every process (torchrun, SLURM, the simulated cluster)."""
        environment = self.cluster_environment
        assert environment is not None
        if not environment.creates_processes_externally:
            return False
        if dist.is_available() and dist.is_initialized():
            # a later Trainer in a process that already joined the run (Lightning's teardown
            # removes WORLD_SIZE from the environment)
            return True
        if type(environment).__name__ == "LightningEnvironment":
            # Lightning's own launchers leave LOCAL_RANK behind in the process that ran them;
            # an outside launcher also exports WORLD_SIZE for the whole run
            world = os.environ.get("WORLD_SIZE")
            return world is not None and int(world) == self.num_processes * self.num_nodes
        return True

    @override
    def _configure_launcher(self) -> None:
        # Lightning calls this when the Trainer is built, once the devices and nodes are known
        # and before any process starts: the place for checks that need the world size
        self.check_world_size(self.num_processes * self.num_nodes)
        external = self.launched_externally()
        #: the processes are started here by spawn/fork, and rank 0 hands the trained model
        #: back to the parent process (Lightning's multiprocessing launcher)
        self.returns_model_to_parent = not external and start_method(self) != "popen"
        keep = self.keeps_survivors()
        if keep and not external and start_method(self) != "popen":
            rank_zero_warn(
                f"{type(self).__name__}(worker_loss='continue'): Lightning's "
                f"{start_method(self)} launcher ends every process when one dies, so only a "
                "frozen or cut-off rank can be dropped; use start_method='popen' (the default) "
                "or an outside launcher (torchrun, SLURM) for the others to outlive a dead one"
            )
        set_launcher(self, make_launcher(self, start_method(self), external, keep))

    def keeps_survivors(self) -> bool:
        """Whether the ranks go on without a lost one (``worker_loss="continue"``): then the
        popen launcher does not end every rank when one child process dies. Default: no."""
        return False

    def check_world_size(self, world_size: int) -> None:
        """Raise ``ValueError`` (naming the fix) if the strategy cannot run on ``world_size``
        processes; called by ``Trainer(...)`` before processes start. Default: any size."""

    @override
    def setup_environment(self) -> None:
        set_group_timeout(self.collective_timeout)
        super().setup_environment()
        self._start_liveness()
        trainer = attached_trainer(self.lightning_module)
        if trainer is not None:
            callbacks: list[Callback] = trainer.callbacks
            for callback in self.strategy_callbacks(trainer):
                if callback not in callbacks:
                    callbacks.append(callback)
                    self._attached.append((callbacks, callback))

    @override
    def on_train_start(self) -> None:
        super().on_train_start()
        trainer = attached_trainer(self.lightning_module)
        if trainer is not None and self.world_size > 1 and self._restore_sigterm is None:
            check: Callable[[], None] = _sigterm_broadcast(trainer)
            if self.sigterm_read_late:
                check = self._late_sigterm = LateSigtermFlag(trainer)
            self._restore_sigterm = replace_sigterm_broadcast(trainer, check, keep_existing=True)

    @override
    def on_train_end(self) -> None:
        late, self._late_sigterm = self._late_sigterm, None
        if late is not None:
            late.drain()
        super().on_train_end()

    # -- failures ----------------------------------------------------------------------------

    def _start_liveness(self) -> None:
        if self._liveness is not None or self.world_size < 2 or not dist.is_initialized():
            return
        store = default_store()
        if store is not None:
            self._liveness = Liveness(store, self.global_rank, self.world_size)

    def set_activity(self, what: str) -> None:
        """Record what this rank does now, prefixed with the step (shown if a peer fails)."""
        trainer = attached_trainer(self.lightning_module)
        step = trainer.global_step if trainer is not None else 0
        set_activity(f"step {step}: {what}")

    @override
    def on_exception(self, exception: BaseException) -> None:
        super().on_exception(exception)
        self.failed = True
        liveness = self._liveness
        if liveness is None or not is_communication_error(exception):
            return
        message = f"[lightning_parallel] {liveness.diagnose().text}"
        log.error(message)
        if any(note.startswith("[lightning_parallel]") for note in _notes(exception)):
            return
        add_note = getattr(exception, "add_note", None)  # Python 3.11+
        if add_note is not None:
            add_note(message)
        else:
            exception.__notes__ = [*_notes(exception), message]  # type: ignore[attr-defined]

    @override
    def teardown(self) -> None:
        while self._attached:
            callbacks, callback = self._attached.pop()
            if callback in callbacks:
                callbacks.remove(callback)
        liveness, self._liveness = self._liveness, None
        if liveness is not None:
            liveness.stop(wait=not self.failed)
        restore, self._restore_sigterm = self._restore_sigterm, None
        if restore is not None:
            restore()
        super().teardown()

    def check_every_rank_saves(self, what: str, filepath: StrPath | None = None) -> None:
        """Before a checkpoint that needs every rank: if the run raised, raise
        :class:`~lightning_parallel.files.PartialCheckpointError` (nothing written) unless
        every rank asks for it within :data:`FAILED_RUN_WAIT` or half the group's timeout.
        ``what`` names what the others hold (for the message). Nothing to check while the run
        is healthy."""
        trainer = attached_trainer(self.lightning_module)
        raised = self.failed or (trainer is not None and trainer.interrupted)  # on_exception
        store = default_store()
        if not raised or self.world_size < 2 or store is None:
            return
        self._failed_saves += 1
        # a peer stuck in the failed step stays there for the group's timeout: one that has
        # not come within half of it is stuck, not slow
        wait = min(FAILED_RUN_WAIT, (self.collective_timeout or 2 * FAILED_RUN_WAIT) / 2)
        point = f"lightning_parallel/failed-run-checkpoint/{self._failed_saves}"
        missing = ranks_missing(store, point, self.global_rank, self.world_size, wait)
        if missing:
            raise PartialCheckpointError(
                f"refusing to write {filepath or 'the checkpoint'}: the run raised, and "
                f"rank(s) {missing} did not reach this checkpoint within "
                f"{wait.total_seconds():.0f} s (lost, or still inside the step that failed), "
                f"so {what} cannot be gathered; nothing was written. The last checkpoint "
                "written during fit is whole"
            )

    # -- what each rank is doing (the activity a failure reports) ------------------------------

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        self.set_activity("forward (training_step)")
        return super().training_step(*args, **kwargs)

    @override
    def backward(self, closure_loss: Any, *args: Any, **kwargs: Any) -> Any:
        self.set_activity("backward" + (" and gradient all-reduce" if self.wraps_in_ddp else ""))
        return super().backward(closure_loss, *args, **kwargs)

    @override
    def optimizer_step(self, *args: Any, **kwargs: Any) -> Any:
        self.set_activity("optimizer step")
        return super().optimizer_step(*args, **kwargs)

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        self.set_activity("validation")
        return super().validation_step(*args, **kwargs)

    @override
    def barrier(self, name: str | None = None) -> None:
        self.set_activity(f"barrier {name or ''}".rstrip())
        super().barrier(name)


def _sigterm_broadcast(trainer: pl.Trainer) -> Callable[[], None]:
    """Lightning's per-step broadcast of rank 0's SIGTERM flag, except that a failed broadcast
    raises (a lost peer) instead of reading as "no SIGTERM" and waiting again elsewhere."""

    def broadcast() -> None:
        flag = _own_flag(trainer)
        dist.broadcast(flag, src=0)
        if flag.item() == 1:
            _leave_together()

    return broadcast


def _own_flag(trainer: pl.Trainer) -> Tensor:
    """This rank's SIGTERM flag, on the device the group reduces on."""
    received = 1 if getattr(trainer, "received_sigterm", False) else 0
    return to_group(torch.tensor([received], device=trainer.strategy.root_device))


def _leave_together() -> None:
    with suppress(Exception):
        dist.barrier()  # every rank leaves together, as Lightning's does
    raise SIGTERMException()


class LateSigtermFlag:
    """Rank 0's SIGTERM flag, broadcast before every training batch without waiting for it.

    The broadcast launched at batch ``n`` is read at batch ``n + 1``: every rank stops at the
    same batch, one batch later than under Lightning's blocking broadcast, and no rank waits
    for the others to reach the batch. For a pipeline that never flushes (SpecTrain) the
    blocking broadcast made every stage wait, at every batch, for the last stage to finish its
    step: measured on timm's ViT-Tiny on 2 hosts at 100 Mbit/s, stage 0 idled 29 ms of a
    76 ms step between its update and its next forward, until stage 1's update had ended.
    """

    def __init__(self, trainer: pl.Trainer) -> None:
        self.trainer = trainer
        self.pending: tuple[Any, Tensor] | None = None

    def __call__(self) -> None:
        flag = _own_flag(self.trainer)
        previous = self.pending
        self.pending = (dist.broadcast(flag, src=0, async_op=True), flag)
        if previous is not None and _read(previous):
            _leave_together()

    def drain(self) -> None:
        """Complete the broadcast still in flight (at the end of training)."""
        pending, self.pending = self.pending, None
        if pending is not None:
            _read(pending)


def _read(pending: tuple[Any, Tensor]) -> bool:
    work, flag = pending
    work.wait()
    return bool(flag.item() == 1)


def _notes(exception: BaseException) -> list[str]:
    return list(getattr(exception, "__notes__", []))


def _ddp_keywords() -> set[str]:
    parameters = inspect.signature(DistributedDataParallel.__init__).parameters
    return {name for name in parameters if name not in ("self", "module")}
