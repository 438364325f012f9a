"""One benchmark process: train the model under one SPEC and write what it measured.

Run on every process of the simulated cluster by the runner::

    python -m lightning_parallel.bench.worker --spec ddp --model vgg_mini --data digits \\
        --max-steps 60 --output DIR

``--model`` and ``--data`` are bundled names or class paths, with options
(:mod:`lightning_parallel.bench.modules` builds them).

It reads the cluster's environment (``NODE_RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``,
``LOCAL_WORLD_SIZE``, ``LP_CLUSTER_HOSTS``, ``LP_CLUSTER_INTERFACE``, ``LP_STRAGGLER``), uses
one torch thread, and writes ``DIR/rank<R>.json`` with:

1. per training batch, its time from ``on_train_batch_start`` to ``on_train_batch_end``
   (forward, backward, communication, optimizer step; data loading excluded), and the samples
   trained (a batch the strategy skipped, counted by its ``skipped_batches``, adds none);
2. validation accuracy and loss at every validation, with the wall time since training began
   (a final validation runs after fit when the last step was not validated);
3. the host interface's kernel counter ``tx_bytes`` at train start and end (local rank 0 only:
   the interface is the host's), the independent measure of bytes on the wire;
4. the library's reported bytes and steps (:class:`~lightning_parallel.callbacks.CommStats`),
   strategy gauges, comm-hook calls and straggler delay;
5. the peak resident memory of the process;
6. the bytes of the training state this rank holds at train end: its parameters, their
   gradients and its optimizers' state (:mod:`lightning_parallel.bench.footprint`), as
   ``param_bytes``, ``grad_bytes``, ``optimizer_bytes``.

A process that fails writes ``ok: false``, the error, and ``refused: true`` when the error is
the strategy declining the model or its settings (a ``ValueError``, ``TypeError``,
``ImportError`` or ``MisconfigurationException`` from building the strategy until the first
training step finished).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time
import traceback
from collections.abc import Mapping, Sized
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lightning_parallel.cluster.faults import STEPS_VARIABLE, progress_line
from lightning_parallel.cpu_memory import MALLOC_MODES

__all__: list[str] = []


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m lightning_parallel.bench.worker")
    parser.add_argument("--spec", required=True)
    parser.add_argument("--model", default="vgg_mini", help="NAME[:key=value,...]")
    parser.add_argument(
        "--data", default=None, help="NAME[:key=value,...] (default: the model's kind)"
    )
    parser.add_argument("--max-steps", type=int, default=None)
    parser.add_argument("--epochs", type=int, default=None)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", required=True, type=Path)
    parser.add_argument("--accelerator", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--malloc", choices=MALLOC_MODES, default="held")
    parser.add_argument(
        "--progress-every",
        type=float,
        default=None,
        help="print a progress line every this many seconds of training (fault runs: a rank "
        "that goes on without a lost peer is then not taken for hung)",
    )
    return parser


def _tx_bytes(interface: str | None) -> int | None:
    if not interface:
        return None
    path = Path(f"/sys/class/net/{interface}/statistics/tx_bytes")
    return int(path.read_text()) if path.exists() else None


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # kB on Linux


def _skipped_batches(trainer: Any) -> int:
    """Batches the strategy skipped so far (``skipped_batches``; 0 for strategies without it)."""
    return int(getattr(trainer.strategy, "skipped_batches", 0))


def _make_probe(
    interface: str | None, progress_every: float | None = None, progress: _Progress | None = None
) -> Any:
    """The callback that measures steps, validations and the interface counter."""
    import pytorch_lightning as pl
    from pytorch_lightning.trainer.states import TrainerFn

    from lightning_parallel.bench.footprint import training_footprint

    class Probe(pl.Callback):
        def __init__(self) -> None:
            self.step_seconds: list[float] = []
            # samples trained in each step (0: a batch the strategy did not train)
            self.step_samples: list[int] = []
            self.samples = 0
            self.validations: list[dict[str, float]] = []
            self.train_start = 0.0
            self.train_seconds = 0.0
            self.tx_start: int | None = None
            self.tx_end: int | None = None
            # [seconds since training started, bytes sent since then] after every step
            self.tx_trace: list[list[float]] = []
            self.footprint: dict[str, int | None] = dict.fromkeys(
                ("param_bytes", "grad_bytes", "optimizer_bytes")
            )
            # the training's peak: what a strategy does after the last step (a pipeline
            # gathering every stage on rank 0, the final validation) is not training
            self.train_peak_rss_mb: float | None = None
            self._batch_start = 0.0
            self._previous_end: float | None = None
            self._validation_start = 0.0
            self._skipped_before = 0
            self._printed = time.perf_counter()
            # the steps a fault waits for (cluster/faults.py): said as each is reached
            listed = os.environ.get(STEPS_VARIABLE, "")
            self._report = {int(step) for step in listed.split(",") if step.strip()}

        def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
            self.tx_start = _tx_bytes(interface)
            self.train_start = time.perf_counter()

        def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
            self._previous_end = None

        def on_train_batch_start(
            self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
        ) -> None:
            # A step runs from the previous step's end: what Lightning does between two
            # batches (fetching, its per-batch collectives, where DDP waits for a straggler)
            # is part of the step. The first step of an epoch starts here.
            now = time.perf_counter()
            self._batch_start = self._previous_end if self._previous_end is not None else now
            self._skipped_before = _skipped_batches(trainer)

        def on_train_batch_end(
            self,
            trainer: pl.Trainer,
            pl_module: pl.LightningModule,
            outputs: Any,
            batch: Any,
            batch_idx: int,
        ) -> None:
            self._previous_end = time.perf_counter()
            self.step_seconds.append(self._previous_end - self._batch_start)
            if self.tx_start is not None:
                sent = _tx_bytes(interface)
                if sent is not None:
                    wall = self._previous_end - self.train_start
                    self.tx_trace.append([round(wall, 4), float(sent - self.tx_start)])
            if progress is not None:
                progress.steps += 1
            since = self._previous_end - self._printed
            every = progress_every is not None and since > progress_every
            reached = {listed for listed in self._report if listed <= trainer.global_step}
            self._report -= reached
            if every or reached:
                self._printed = self._previous_end
                print(progress_line(trainer.global_rank, trainer.global_step), flush=True)
            # a batch the strategy did not train (the parameter server's epoch tail: its grant
            # went to a faster worker) keeps its time but adds no samples
            trained = _samples(batch) if _skipped_batches(trainer) == self._skipped_before else 0
            self.samples += trained
            self.step_samples.append(trained)

        def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
            self._validation_start = time.perf_counter()
            self._previous_end = None  # validation is not part of the next step

        def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
            if trainer.sanity_checking:
                return
            now = time.perf_counter()
            if trainer.state.fn == TrainerFn.VALIDATING:  # the extra validation after fit
                wall = self.train_seconds + now - self._validation_start
            else:
                wall = now - self.train_start
            metrics = trainer.callback_metrics
            self.validations.append(
                {
                    "wall_s": wall,
                    "step": float(trainer.global_step),
                    "val_acc": float(metrics["val_acc"]) if "val_acc" in metrics else float("nan"),
                    "val_loss": float(metrics["val_loss"])
                    if "val_loss" in metrics
                    else float("nan"),
                }
            )

        def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
            self.train_seconds = time.perf_counter() - self.train_start
            self.tx_end = _tx_bytes(interface)
            # what the rank holds now, before the strategy's teardown frees or moves it
            held = training_footprint(pl_module.parameters(), trainer.optimizers)
            self.footprint.update(held.as_dict())
            self.train_peak_rss_mb = _peak_rss_mb()

    return Probe()


def _first_tensor(batch: Any) -> Any:
    import torch

    if isinstance(batch, torch.Tensor):
        return batch
    items = batch.values() if isinstance(batch, Mapping) else batch
    for item in items if isinstance(batch, (Mapping, list, tuple)) else ():
        found = _first_tensor(item)
        if found is not None:
            return found
    return None


def _samples(batch: Any) -> int:
    """The samples in ``batch``: the length of its first tensor, looked for depth first through
    tuples, lists and mappings (``(x, y)``, ``{"input_ids": ..., "labels": ...}``); without a
    tensor, the length of its first element."""
    tensor = _first_tensor(batch)
    if tensor is not None:
        return len(tensor) if tensor.dim() else 1
    first = batch[0] if isinstance(batch, (list, tuple)) and batch else batch
    return len(first) if isinstance(first, Sized) else 1


def _validates(model: Any, datamodule: Any) -> bool:
    """Whether a validation can run: the model has a ``validation_step`` and the data (or the
    model) a ``val_dataloader``. A user's module without them is trained and left unvalidated,
    its ``val_acc`` null."""
    from pytorch_lightning.utilities.model_helpers import is_overridden

    return is_overridden("validation_step", model) and (
        is_overridden("val_dataloader", datamodule) or is_overridden("val_dataloader", model)
    )


# errors that mean "this strategy does not take this model or these settings": raised at
# construction, setup or the first batch with the reason, they are recorded as a refusal
_REFUSALS: tuple[type[BaseException], ...] = (ValueError, TypeError, ImportError)


@dataclass
class _Progress:
    """How far a process got: the strategy was being built, training steps finished."""

    strategy: bool = False
    steps: int = 0


def _is_refusal(error: BaseException, progress: _Progress) -> bool:
    """A refusal: a clean error (``ValueError``, ``TypeError``, ``ImportError``, Lightning's
    ``MisconfigurationException``) from building the strategy until the first training step
    finished (an error in building the model or data is the bench's settings, not a refusal)."""
    from pytorch_lightning.utilities.exceptions import MisconfigurationException

    clean = isinstance(error, (*_REFUSALS, MisconfigurationException))
    return clean and progress.strategy and progress.steps == 0


def _cuda_placement(spec: str, interface: str | None) -> tuple[list[int], str]:
    """This process's GPU and the SPEC it runs on CUDA.

    Rank ``R`` uses GPU ``R mod G`` of the ``G`` visible. NCCL is kept to its socket transport
    on the host's interface (no shared memory, peer-to-peer or InfiniBand between simulated
    hosts), so the shaped links carry its traffic. When ranks share a GPU (NCCL refuses two
    ranks on one device) the SPEC gets ``process_group_backend=gloo`` unless it names one.
    """
    import torch

    gpus = torch.cuda.device_count()
    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    os.environ.update({"NCCL_P2P_DISABLE": "1", "NCCL_SHM_DISABLE": "1", "NCCL_IB_DISABLE": "1"})
    if interface:
        os.environ.setdefault("NCCL_SOCKET_IFNAME", interface)
    if world > gpus and "process_group_backend" not in spec:
        spec += ("," if ":" in spec else ":") + "process_group_backend=gloo"
    return [rank % gpus], spec


def train(args: argparse.Namespace, progress: _Progress | None = None) -> dict[str, Any]:
    """Train under ``args.spec`` on this process's share of the cluster; return the record.

    ``progress``, when given, follows how far training got (read after an error to tell a
    refusal from a failure).
    """
    progress = progress if progress is not None else _Progress()
    import pytorch_lightning as pl
    import torch
    from pytorch_lightning.strategies import DDPStrategy

    from lightning_parallel.bench.modules import build
    from lightning_parallel.bench.specs import build_strategy, parse_spec, split_trainer_options
    from lightning_parallel.callbacks.comm_stats import CommStats
    from lightning_parallel.callbacks.straggler import Straggler
    from lightning_parallel.comm.accounting import ring_allreduce_bytes
    from lightning_parallel.comm.ledger import process_ledger
    from lightning_parallel.cpu_memory import hold_freed_memory
    from lightning_parallel.demo import default_data

    torch.set_num_threads(1)  # hosts share the machine's cores: one thread per process
    # as the plan's profile: no page faults for temporary tensors (False without glibc)
    held = args.malloc == "held" and hold_freed_memory()
    num_nodes = int(os.environ.get("LP_CLUSTER_HOSTS", os.environ.get("WORLD_SIZE", "1")))
    devices: int | list[int] = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    interface = os.environ.get("LP_CLUSTER_INTERFACE") if local_rank == 0 else None
    spec_text = args.spec
    if args.accelerator == "cuda":
        devices, spec_text = _cuda_placement(spec_text, os.environ.get("LP_CLUSTER_INTERFACE"))

    pl.seed_everything(args.seed, workers=True, verbose=False)
    data = args.data or default_data(parse_spec(args.model).name)
    model, datamodule = build(args.model, data, args.batch_size, args.seed)
    progress.strategy = True
    spec, trainer_options = split_trainer_options(parse_spec(spec_text))
    strategy = build_strategy(spec)
    stats = CommStats(log=False)
    probe = _make_probe(interface, args.progress_every, progress)
    straggler = Straggler.from_env()
    # the straggler sleeps in on_train_batch_end before the probe reads the clock
    callbacks: list[pl.Callback] = [stats, *([straggler] if straggler else []), probe]
    trainer = pl.Trainer(
        accelerator=args.accelerator,
        devices=devices,
        num_nodes=num_nodes,
        strategy=strategy,
        max_steps=args.max_steps if args.max_steps is not None else -1,
        max_epochs=args.epochs if args.epochs is not None else -1,
        callbacks=callbacks,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        **trainer_options,
    )
    trainer.fit(model, datamodule=datamodule)
    last_validated = probe.validations[-1]["step"] if probe.validations else -1.0
    if last_validated != float(trainer.global_step) and _validates(model, datamodule):
        trainer.validate(model, datamodule=datamodule, verbose=False)

    gradient_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    gauges = dict(process_ledger().gauges)
    return {
        "ok": True,
        "error": None,
        "rank": trainer.global_rank,
        "node_rank": trainer.node_rank,
        "local_rank": trainer.local_rank,
        "world_size": trainer.world_size,
        "strategy_class": type(trainer.strategy).__name__,
        "data_parallel": isinstance(trainer.strategy, DDPStrategy),
        "steps": trainer.global_step,
        "samples": probe.samples,
        "batch_size": args.batch_size,
        "step_seconds": probe.step_seconds,
        "step_samples": probe.step_samples,
        "validations": probe.validations,
        "train_seconds": probe.train_seconds,
        "interface": interface,
        "tx_bytes": None
        if probe.tx_start is None or probe.tx_end is None
        else probe.tx_end - probe.tx_start,
        "tx_trace": probe.tx_trace,
        "reported_bytes": stats.totals.bytes_sent,
        "reported_steps": stats.totals.steps,
        "comm_seconds": stats.totals.comm_seconds,
        "dense_allreduce_bytes": ring_allreduce_bytes(gradient_bytes, trainer.world_size),
        "parameters": sum(p.numel() for p in model.parameters()),
        "gauges": gauges,
        "hook_calls": getattr(trainer.strategy, "hook_calls", None),
        # a pipeline's cut, as its partition (and trial) chose it
        "boundaries": getattr(trainer.strategy, "boundaries", None),
        "straggler_delay_s": straggler.delayed_seconds if straggler else 0.0,
        "torch_threads": torch.get_num_threads(),
        "freed_memory_held": held,
        "peak_rss_mb": probe.train_peak_rss_mb or _peak_rss_mb(),
        **probe.footprint,
    }


def main(argv: list[str] | None = None) -> int:
    """Train, write ``rank<R>.json``; on failure write the error there and exit 1."""
    args = _parser().parse_args(argv)
    if (args.max_steps is None) == (args.epochs is None):
        print("error: give exactly one of --max-steps and --epochs", file=sys.stderr)
        return 2
    rank = os.environ.get("RANK", "0")
    args.output.mkdir(parents=True, exist_ok=True)
    target = args.output / f"rank{rank}.json"
    progress = _Progress()
    try:
        record = train(args, progress)
    except Exception as error:
        traceback.print_exc()
        record = {
            "ok": False,
            "refused": _is_refusal(error, progress),
            "error": "\n".join(
                [f"{type(error).__name__}: {error}", *getattr(error, "__notes__", [])]
            ),
            "traceback": traceback.format_exc(),
            "rank": int(rank),
            "peak_rss_mb": _peak_rss_mb(),
        }
        target.write_text(json.dumps(record))
        return 1
    target.write_text(json.dumps(record))
    return 0


def _exit(code: int) -> None:
    """Leave at once once the record is written.

    Interpreter teardown with live gloo and Lightning threads occasionally ends in a C++
    ``std::terminate`` (exit code 134) after a run that finished and wrote its record; the
    record, not the teardown, is the result, so the worker flushes and exits without it.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    _exit(main())
