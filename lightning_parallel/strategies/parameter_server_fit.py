"""What a parameter-server fit asks of Lightning: the configurations it refuses, its epoch hooks.

:func:`check_fit` runs at setup, before the server starts. Inside an epoch the workers are not
in step, so whatever would make them meet there is refused, naming the fix: validation inside an
epoch (``val_check_interval``), ``ModelCheckpoint`` saves every n steps or on a timer, a
``Timer`` that decides every step; so are manual optimization (the optimizer runs on the
server), a ``softsync`` above the world size, and shards or a server rank the world cannot host.
It also resolves ``lr_scale="auto"``: the step per sample of synchronous training.

:class:`ParameterServerHooks` keeps the data iterator in its epoch and drains a worker whose last
step did not (validation and the epoch end then find every rank with the server's weights);
after a lost worker, the strategy then divides the data among the survivors.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import pytorch_lightning as pl
from pytorch_lightning.callbacks import Callback, ModelCheckpoint, Timer
from pytorch_lightning.trainer.states import TrainerFn

from lightning_parallel.compat.private import fit_loop_data, saves_inside_epoch, stops_on_step_timer
from lightning_parallel.parameter_server.data import BudgetedLoader
from lightning_parallel.parameter_server.policies import UpdatePolicy

__all__: list[str] = []


def check_fit(
    trainer: pl.Trainer,
    policy: UpdatePolicy,
    *,
    lr_scale_auto: bool,
    shards: int,
    server_rank: int,
) -> UpdatePolicy:
    """``policy`` for this fit (``lr_scale`` resolved if ``lr_scale_auto``).

    Raises:
        ValueError: a configuration the parameter server cannot run (module docstring).
    """
    module = trainer.lightning_module
    if not module.automatic_optimization:
        raise ValueError(
            "ParameterServerStrategy runs the optimizer on the server and supports automatic "
            "optimization only; remove `self.automatic_optimization = False`"
        )
    if policy.softsync > trainer.world_size:
        raise ValueError(
            f"softsync={policy.softsync} waits for more gradients than there are workers "
            f"({trainer.world_size}); use softsync <= {trainer.world_size}"
        )
    if lr_scale_auto:
        # the step per sample of synchronous training: an update applies softsync gradients,
        # or one per worker under max_staleness=0 (synchronous SGD: no scaling)
        synchronous = policy.max_staleness == 0
        scale = 1.0 if synchronous else policy.softsync / trainer.world_size
        policy = dataclasses.replace(policy, lr_scale=scale)
    if shards > trainer.world_size or server_rank >= trainer.world_size:
        raise ValueError(
            f"shards={shards} and server_rank={server_rank} need a world size above "
            f"both; it is {trainer.world_size}"
        )
    interval = trainer.val_check_interval
    if getattr(trainer, "_val_check_time_interval", None) is not None or not (
        isinstance(interval, float) and interval == 1.0
    ):
        raise ValueError(
            "ParameterServerStrategy validates at epoch ends only (workers are not in step "
            f"inside an epoch); got val_check_interval={interval!r}: leave it at 1.0 and use "
            "check_val_every_n_epoch"
        )
    for callback in trainer.callbacks:  # type: ignore[attr-defined]
        if isinstance(callback, ModelCheckpoint) and saves_inside_epoch(callback):
            raise ValueError(
                "ModelCheckpoint(every_n_train_steps / train_time_interval) saves inside an "
                "epoch, where parameter-server workers are not in step; use every_n_epochs"
            )
        if isinstance(callback, Timer) and stops_on_step_timer(callback):
            raise ValueError(
                "Timer(interval='step') broadcasts a decision every step, where "
                "parameter-server workers are not in step; use Timer(interval='epoch')"
            )
    return policy


class ParameterServerHooks(Callback):
    """Keep the data iterator in its epoch; drain at the epoch end if the last step did not,
    then divide the data among the survivors of a lost worker.

    Args:
        drain: the strategy's drain: ends the epoch now for a worker that has not drained yet.
        after_drain: called at every training epoch's end once drained (every rank).
    """

    def __init__(
        self,
        drain: Callable[[pl.Trainer], None],
        after_drain: Callable[[pl.Trainer], None],
    ) -> None:
        self.drain = drain
        self.after_drain = after_drain

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        combined, fetcher = fit_loop_data(trainer)
        loader = combined.flattened[0] if combined is not None else None
        if isinstance(loader, BudgetedLoader) and loader.stale() and fetcher is not None:
            iter(fetcher)  # what the fit loop does at every other epoch start

    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.state.fn == TrainerFn.FITTING and not trainer.sanity_checking:
            self.drain(trainer)

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.drain(trainer)
        self.after_drain(trainer)
