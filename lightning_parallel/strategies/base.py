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
"""

from __future__ import annotations

import inspect
import os
from datetime import timedelta
from typing import Any, ClassVar

from pytorch_lightning.strategies import DDPStrategy
from torch.distributed.constants import default_pg_timeout
from torch.nn.parallel import DistributedDataParallel
from typing_extensions import override

from lightning_parallel.comm.groups import set_group_timeout
from lightning_parallel.compat import check
from lightning_parallel.compat.private import (
    check_start_method,
    make_launcher,
    set_launcher,
    start_method,
)

__all__ = ["ParallelStrategyBase", "as_timeout"]

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

    wraps_in_ddp: ClassVar[bool] = True

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
        set_launcher(self, make_launcher(self, start_method(self), self.launched_externally()))

    def check_world_size(self, world_size: int) -> None:
        """Raise ``ValueError`` (naming the fix) if the strategy cannot run on ``world_size``
        processes; called by ``Trainer(...)`` before processes start. Default: any size."""

    @override
    def setup_environment(self) -> None:
        set_group_timeout(self.collective_timeout)
        super().setup_environment()


def _ddp_keywords() -> set[str]:
    parameters = inspect.signature(DistributedDataParallel.__init__).parameters
    return {name for name in parameters if name not in ("self", "module")}
