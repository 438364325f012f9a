"""Log what communication costs per training step, for every strategy, through Lightning.

``CommStats`` makes each rank's :class:`~lightning_parallel.comm.ledger.CommLedger` visible:

1. at ``setup`` it starts counting every ``torch.distributed`` collective called from Python
   (:func:`~lightning_parallel.comm.accounting.track_collectives`), which covers DDP comm
   hooks, Lightning's own collectives and all strategies of this package;
2. plain DDP (a strategy without ``reports_communication = True``) allreduces gradients in
   C++, out of Python's sight: for it, each optimizer step adds the ring-allreduce cost of the
   gradients, ``2·(W−1)/W · Σ bytes(grad)``;
3. after each optimizer step it drains the ledger and logs ``comm/bytes`` (bytes this rank
   sent during the step), ``comm/seconds`` (blocking time in communication), ``comm/calls``;
   every strategy gauge is logged as ``comm/<gauge>`` on the steps whose metrics the trainer
   writes (``log_every_n_steps``): a gauge is a current value, so the loggers see the same
   figures, and a step does not pay ``LightningModule.log`` for dozens of gauges it would
   discard (Hylo's per-layer gauges, the parameter server's histogram);
4. it keeps per-process totals in :attr:`totals` and a per-step :attr:`history`;
5. with ``summary=True``, rank 0 prints a short summary when the fit ends: bytes per step
   against what ``ddp`` would send for this model (``2·(W−1)/W`` times the gradient bytes),
   the share of step time spent communicating, the technique's headline gauges (staleness,
   pipeline bubble, compression ratio, ...) and where the logs and checkpoints were written.

Example::

    trainer = Trainer(strategy="ddp", callbacks=[CommStats()])
"""

from __future__ import annotations

import time
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import Any

import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import Callback
from pytorch_lightning.strategies import DDPStrategy

from lightning_parallel.comm.accounting import ring_allreduce_bytes, track_collectives
from lightning_parallel.comm.ledger import CommLedger, process_ledger
from lightning_parallel.compat import check
from lightning_parallel.compat.private import should_update_logs

__all__: list[str] = []


@dataclass
class CommTotals:
    """Per-process totals over a fit."""

    bytes_sent: float = 0.0
    comm_seconds: float = 0.0
    steps: int = 0
    step_seconds: list[float] = field(default_factory=list)

    @property
    def bytes_per_step(self) -> float:
        return self.bytes_sent / self.steps if self.steps else 0.0


def _gradient_bytes(module: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters() if p.requires_grad)


class CommStats(Callback):
    """Log bytes sent, communication time and strategy gauges per optimizer step.

    Args:
        log: log the figures through the trainer's loggers (``False``: only collect them).
        prog_bar: also show ``comm/bytes`` in the progress bar.
        ledger: the ledger to read (default: this process's ledger).
        gauges_every_n_steps: log the gauges every n optimizer steps instead (``None``: on the
            steps the trainer writes, every ``log_every_n_steps``).
        summary: print the end-of-fit summary on rank 0 (also kept in :attr:`summary_text`).
    """

    def __init__(
        self,
        log: bool = True,
        prog_bar: bool = False,
        ledger: CommLedger | None = None,
        gauges_every_n_steps: int | None = None,
        summary: bool = False,
    ) -> None:
        check(self)  # this Lightning has every private name we use (compat.private)
        if gauges_every_n_steps is not None and gauges_every_n_steps < 1:
            raise ValueError(
                f"gauges_every_n_steps must be >= 1 or None (follow the trainer's "
                f"log_every_n_steps), got {gauges_every_n_steps}"
            )
        # not ``self.log``: Lightning sets every callback's ``log`` to the module's ``log``
        self.log_metrics = log
        self.prog_bar = prog_bar
        self.gauges_every_n_steps = gauges_every_n_steps
        self.summary = summary
        self.summary_text = ""
        self._ddp_bytes = 0.0
        self.ledger = ledger if ledger is not None else process_ledger()
        self.totals = CommTotals()
        self.history: list[dict[str, float]] = []
        self._stack: ExitStack | None = None
        self._analytic_bytes = 0.0
        self._last_step = 0
        self._step_start = 0.0

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self._stack is None:
            self._stack = ExitStack()
            self._stack.enter_context(track_collectives(self.ledger))

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self._stack is not None:
            self._stack.close()
            self._stack = None

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        strategy = trainer.strategy
        plain_ddp = isinstance(strategy, DDPStrategy) and not reports_communication(trainer)
        world = trainer.world_size
        self._ddp_bytes = ring_allreduce_bytes(_gradient_bytes(pl_module), world)
        self._analytic_bytes = self._ddp_bytes if plain_ddp else 0.0
        self.ledger.drain()  # set-up traffic (initial broadcast) is not a training step's
        self._last_step = trainer.global_step

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # communication after the last optimizer step (a final averaging round, a drain) still
        # belongs to the fit: it counts in the totals, spread over the steps
        records = self.ledger.drain()
        self.totals.bytes_sent += sum(r.bytes_sent for r in records.values())
        self.totals.comm_seconds += sum(r.seconds for r in records.values())
        if self.summary:
            self.summary_text = fit_summary(
                trainer, self.totals, self._ddp_bytes, self.ledger.gauges
            )
            if trainer.global_rank == 0:
                print(self.summary_text, flush=True)

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if trainer.global_step == self._last_step and not self._step_start:
            self._step_start = time.perf_counter()

    def on_train_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        steps = trainer.global_step - self._last_step
        if steps <= 0:  # gradient accumulation: no optimizer step yet
            return
        self._last_step = trainer.global_step
        if self._analytic_bytes:
            self.ledger.add("gradients", self._analytic_bytes * steps, 0.0, calls=steps)
        records = self.ledger.drain()
        sent = sum(r.bytes_sent for r in records.values())
        seconds = sum(r.seconds for r in records.values())
        calls = sum(r.calls for r in records.values())
        step_seconds = time.perf_counter() - self._step_start if self._step_start else 0.0
        self._step_start = time.perf_counter()
        self.totals.bytes_sent += sent
        self.totals.comm_seconds += seconds
        self.totals.steps += steps
        self.totals.step_seconds.append(step_seconds)
        row = {"step": float(trainer.global_step), "bytes": sent, "seconds": seconds}
        row.update({f"gauge/{k}": v for k, v in self.ledger.gauges.items()})
        self.history.append(row)
        if self.log_metrics:
            metrics = {"comm/bytes": sent, "comm/seconds": seconds, "comm/calls": float(calls)}
            if self._gauges_due(trainer):
                metrics.update({f"comm/{k}": v for k, v in self.ledger.gauges.items()})
            for name, value in metrics.items():
                pl_module.log(
                    name,
                    float(value),
                    on_step=True,
                    on_epoch=False,
                    prog_bar=self.prog_bar and name == "comm/bytes",
                    rank_zero_only=True,
                )

    def _gauges_due(self, trainer: pl.Trainer) -> bool:
        if self.gauges_every_n_steps is not None:
            return trainer.global_step % self.gauges_every_n_steps == 0
        # Lightning's own test, evaluated where it evaluates it (after on_train_batch_end)
        return should_update_logs(trainer) or bool(getattr(trainer, "fast_dev_run", False))


# the gauges a summary shows first, when the strategy reports them
_HEADLINE_GAUGES = (
    "compression_ratio",
    "staleness_mean",
    "staleness_max",
    "ps_dropped",
    "bubble_fraction",
    "allreduce_hidden_fraction",
    "rounds",
    "divergence",
)


def fit_summary(
    trainer: pl.Trainer, totals: CommTotals, ddp_bytes: float, gauges: dict[str, float]
) -> str:
    """A few lines a person can read at the end of a fit (see :class:`CommStats`)."""
    strategy = type(trainer.strategy).__name__
    lines = [f"lightning_parallel: {strategy} on {trainer.world_size} processes, rank 0's figures"]
    per_step = totals.bytes_per_step
    if ddp_bytes > 0:
        lines.append(
            f"  sent per step   {_megabytes(per_step)} ({per_step / ddp_bytes:.2f}x the "
            f"{_megabytes(ddp_bytes)} that ddp sends for this model)"
        )
    else:
        lines.append(f"  sent per step   {_megabytes(per_step)}")
    step_time = sum(totals.step_seconds)
    if totals.steps and step_time > 0:
        lines.append(
            f"  communicating   {1000 * totals.comm_seconds / totals.steps:.1f} ms per step, "
            f"{totals.comm_seconds / step_time:.0%} of step time (blocking time on this rank)"
        )
    shown = [name for name in _HEADLINE_GAUGES if name in gauges]
    if shown:
        lines.append("  gauges          " + ", ".join(f"{n} {gauges[n]:.3g}" for n in shown))
    places = []
    if trainer.loggers:
        places.append(f"logs in {trainer.log_dir}")
    checkpoint = getattr(trainer, "checkpoint_callback", None)
    if checkpoint is not None and getattr(checkpoint, "dirpath", None):
        places.append(f"checkpoints in {checkpoint.dirpath}")
    timeline = getattr(trainer.strategy, "timeline_path", None)
    if timeline:
        places.append(f"pipeline timeline in {timeline}")
    if places:
        lines.append("  written         " + "; ".join(places))
    lines.append("  per-step figures are logged as comm/bytes, comm/seconds and comm/<gauge>")
    return "\n".join(lines)


def _megabytes(value: float) -> str:
    return f"{value / 1e6:.3f} MB"


def reports_communication(trainer: pl.Trainer) -> bool:
    """Whether the strategy, or one of the trainer's callbacks, sends every byte through Python
    collectives that are counted (their class attribute ``reports_communication``; Lightning's
    own strategies have none: DDP's C++ allreduce is estimated instead)."""
    callbacks: list[Callback] = trainer.callbacks  # type: ignore[attr-defined]
    owners: list[object] = [trainer.strategy, *callbacks]
    return any(getattr(type(owner), "reports_communication", False) for owner in owners)
