"""Profile a ``LightningModule`` for a plan: a real one-process ``fit`` and the plain-torch
measures of :mod:`lightning_parallel.plan.measure`.

1. a ``fit`` runs under ``ddp`` on this one process (the module's own Lightning namespace),
   timed step by step as the bench times a step, for at least ``steps`` steps and on until the
   steps after the first two add up to ``seconds`` (:data:`PROFILE_SECONDS`; at most
   :data:`PROFILE_MAX_STEPS`): the trainer's own time per step (their median) and the
   process's peak memory come from it;
2. :func:`~lightning_parallel.plan.measure.profile_step` times the forward, backward and
   optimizer step of ``training_step`` on the data module's first batch, and
   :func:`~lightning_parallel.plan.measure.pipeline_layers` the chain a pipeline would split,
   at each micro-batch count asked for; the low-rank codec work of every matrix shape is timed
   too (:func:`~lightning_parallel.plan.codecs.codec_timings`), and what torch's PowerSGD hook
   adds to a step, in the fit's world of one process
   (:func:`~lightning_parallel.plan.codecs.comm_hook_seconds`).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from typing import Any

__all__: list[str] = []


def _rss_bytes() -> float:
    """This process's resident memory now."""
    with open("/proc/self/statm") as statm:
        return float(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


#: steps of the profile's fit not timed (the first ones build the optimizer state and warm up)
PROFILE_WARMUP_STEPS = 2
#: the profile's fit runs until its timed steps add up to this many seconds (and at least the
#: steps asked for): three 8-step fits of ``gpt`` one after the other gave medians of 46, 61
#: and 70 ms, three 3-second fits 59, 67 and 58 ms, beside steps of 58-69 ms in the bench's runs
PROFILE_SECONDS = 3.0
#: the most steps the profile's fit takes, whatever their time
PROFILE_MAX_STEPS = 400


def _step_probe(callback_base: type, steps: int, seconds: float) -> Any:
    """A callback of ``callback_base``'s namespace that times steps as the bench's probe does
    (from the previous step's end to this one's), stops the fit once ``steps`` steps are done
    and the timed ones add up to ``seconds``, and reads the peak memory at train end. After the
    first backward it tries Hylo's candidates on the gradients
    (:func:`~lightning_parallel.compression.trials.first_trial_errors`), as a run's first
    calibration step does."""
    import resource
    import time

    from lightning_parallel.compression.policy import HyloPolicy
    from lightning_parallel.compression.trials import first_trial_errors
    from lightning_parallel.plan.hylo import HYLO_RANK

    class StepProbe(callback_base):  # type: ignore[misc, valid-type]
        def __init__(self) -> None:
            self.step_seconds: list[float] = []
            self.peak_rss_bytes = 0.0
            self.codec_errors: dict[str, dict[str, float]] | None = None
            self._previous: float | None = None
            self._start = 0.0

        def on_train_batch_start(self, *args: Any) -> None:
            now = time.perf_counter()
            self._start = self._previous if self._previous is not None else now

        def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
            self._previous = time.perf_counter()
            self.step_seconds.append(self._previous - self._start)
            timed = sum(self.step_seconds[PROFILE_WARMUP_STEPS:])
            if len(self.step_seconds) >= steps and timed >= seconds:
                trainer.should_stop = True

        def on_after_backward(self, trainer: Any, module: Any) -> None:
            if self.codec_errors is None:
                gradients = {
                    name: parameter.grad
                    for name, parameter in module.named_parameters()
                    if parameter.grad is not None
                }
                self.codec_errors = first_trial_errors(gradients, HyloPolicy(rank=HYLO_RANK))

        def on_train_end(self, *args: Any) -> None:
            self.peak_rss_bytes = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024.0

    return StepProbe()


@contextmanager
def _isolated_fit() -> Iterator[None]:
    """Leave the caller's process as it was found: the environment variables the one-process
    ``ddp`` fit sets (the master's address and port, ``OMP_NUM_THREADS``) are restored and the
    default process group it created is destroyed, so a later multi-process ``Trainer`` in the
    same process (a fork launcher inherits the group) starts its own world."""
    import torch.distributed as dist

    environment = dict(os.environ)
    had_group = dist.is_available() and dist.is_initialized()
    try:
        yield
    finally:
        if dist.is_available() and dist.is_initialized() and not had_group:
            dist.destroy_process_group()
        restore_environment(environment)


def restore_environment(saved: dict[str, str]) -> None:
    """Give the process the environment ``saved`` again, touching only the variables that
    differ: clearing the whole environment and setting it again would rewrite (and reallocate)
    the C library's ``environ`` once per variable, under any native thread reading it with
    ``getenv``, which is not safe against ``setenv`` in another thread."""
    for name in [name for name in os.environ if name not in saved]:
        del os.environ[name]
    for name, value in saved.items():
        if os.environ.get(name) != value:
            os.environ[name] = value


def profile_module(
    model: Any,
    datamodule: Any,
    *,
    micro_batches: list[int] | tuple[int, ...] = (1,),
    steps: int = 8,
    seconds: float = PROFILE_SECONDS,
    threads: int = 1,
    seed: int = 0,
    accelerator: str = "cpu",
    hold_memory: bool = True,
) -> Any:
    """Profile a ``LightningModule`` (either namespace) on its data module's first batch, in
    this process (see the module docstring); ``micro_batches`` are the splits of the batch to
    take layer profiles at (1: the whole batch). ``accelerator="cuda"``: the fit, the step, the
    layers, the codecs and the hook all run on this process's GPU (every clock reading waits
    for the GPU's queued work), and the profile's notes say so (``"accelerator": "cuda"``).
    With ``hold_memory`` the process holds the memory it frees from then on, as a bench rank
    does (:func:`~lightning_parallel.cpu_memory.hold_freed_memory`; the notes'
    ``"freed_memory_held"`` says whether it did).
    Returns a :class:`~lightning_parallel.plan.profile.StepProfile`."""
    import torch

    from lightning_parallel.compat.namespaces import PYTORCH_LIGHTNING, of_object
    from lightning_parallel.cpu_memory import hold_freed_memory
    from lightning_parallel.plan.codecs import codec_timings
    from lightning_parallel.plan.measure import (
        parameter_server_exchange_seconds,
        pipeline_layers,
        profile_step,
    )

    if accelerator not in ("cpu", "cuda"):
        raise ValueError(f"accelerator must be 'cpu' or 'cuda', got {accelerator!r}")
    if accelerator == "cuda" and not torch.cuda.is_available():
        raise ValueError("accelerator='cuda': this machine has no CUDA device; use 'cpu'")
    device = torch.device("cuda", torch.cuda.current_device()) if accelerator == "cuda" else None
    lightning = (of_object(model) or PYTORCH_LIGHTNING).module()
    threads_before = torch.get_num_threads()
    # a bench rank holds freed memory too: without it, whether a step's temporary tensors
    # fault in depends on what the process freed before (lightning_parallel.cpu_memory)
    held = hold_memory and hold_freed_memory()
    base = _rss_bytes()
    probe = _step_probe(lightning.Callback, steps, seconds)
    with _isolated_fit():
        # Lightning's CPU accelerator gives each process cores // processes threads unless
        # OMP_NUM_THREADS is set (the bench's hosts set it to 1)
        os.environ["OMP_NUM_THREADS"] = str(threads)
        torch.set_num_threads(threads)
        lightning.seed_everything(seed, workers=True, verbose=False)
        trainer = lightning.Trainer(
            accelerator=accelerator, devices=1,
            strategy=lightning.strategies.DDPStrategy(process_group_backend="gloo"),
            max_steps=max(steps, PROFILE_MAX_STEPS), limit_val_batches=0, logger=False,
            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
            num_sanity_val_steps=0,
            callbacks=[probe],
        )  # fmt: skip
        trainer.fit(model, datamodule=datamodule)
        torch.set_num_threads(threads)
        if device is not None:  # Lightning's teardown left the model on the CPU
            model.to(device)
        hooks = _hook_timings(model, datamodule, device)
    warmup = min(PROFILE_WARMUP_STEPS, max(0, len(probe.step_seconds) - 1))
    steady = probe.step_seconds[warmup:]
    trainer_step = sorted(steady)[len(steady) // 2] if steady else None
    loader = datamodule.train_dataloader()
    batch = _on(device, next(iter(loader)))
    samples = len(loader.dataset) if hasattr(loader, "dataset") else None
    # the trained model profiles as the untrained one would: the same work per step
    optimizer = _first_optimizer(model.configure_optimizers())
    profile = profile_step(model, batch, optimizer, repeats=4, warmup=1)
    hooks = {**hooks, "parameter_server": parameter_server_exchange_seconds(optimizer)}
    # the chain's layers at every micro-batch size asked for (the whole batch too: DDP's
    # gradients become ready layer by layer)
    layers, error = pipeline_layers(model, batch, sorted({1, *micro_batches}), repeats=2)
    codecs = codec_timings(profile.parameters, device=device)
    torch.set_num_threads(threads_before)
    return replace(
        profile,
        codec_seconds=codecs,
        hook_seconds=hooks,
        codec_errors=probe.codec_errors or {},
        trainer_step_s=trainer_step,
        base_rss_bytes=base,
        peak_rss_bytes=probe.peak_rss_bytes or None,
        layer_profiles=layers,
        pipeline_error=error,
        notes={
            "model": type(model).__name__,
            "profile_steps": len(probe.step_seconds),
            # every timed step (the spread, not only the median: a step that waits for every
            # replica lasts the slowest replica's)
            "step_seconds": steady,
            "train_samples": samples,
            "validation_samples": _validation_samples(datamodule),
            "drop_last": bool(getattr(loader, "drop_last", False)),
            "accelerator": accelerator,
            "freed_memory_held": held,
        },
    )


def _validation_samples(datamodule: Any) -> int | None:
    """Samples of the data module's validation set (``None``: none, or not sized)."""
    try:
        loader = datamodule.val_dataloader()
        return len(loader.dataset) if hasattr(loader, "dataset") else None
    except Exception:  # a module without validation data, or an unsized dataset
        return None


def _on(device: Any, batch: Any) -> Any:
    """``batch`` with its tensors on ``device`` (``None``: as it is)."""
    if device is None:
        return batch
    from torch.utils._pytree import tree_map

    return tree_map(lambda value: value.to(device) if hasattr(value, "to") else value, batch)


def _hook_timings(model: Any, datamodule: Any, device: Any = None) -> dict[str, float]:
    """What ``ddp_powersgd``'s hook (at its defaults, as the strategy registers it) adds to a
    step, keyed ``"ddp_powersgd@RANK"``; empty where it could not be measured."""
    from lightning_parallel.plan.codecs import comm_hook_seconds
    from lightning_parallel.strategies.ddp_hooks import PowerSGDDDPStrategy

    strategy = PowerSGDDDPStrategy()
    batch = _on(device, next(iter(datamodule.train_dataloader())))
    seconds = comm_hook_seconds(
        model, batch, strategy.make_comm_hook(), strategy.make_comm_state(),
        warmup=strategy.start_powerSGD_iter + 1,
    )  # fmt: skip
    if seconds is None:
        return {}
    return {f"ddp_powersgd@{strategy.matrix_approximation_rank}": seconds}


def _first_optimizer(configured: Any) -> Any:
    """The optimizer in what ``configure_optimizers`` returned (its first, as the strategies
    take it)."""
    import torch

    if isinstance(configured, torch.optim.Optimizer):
        return configured
    if isinstance(configured, dict):
        return _first_optimizer(configured["optimizer"])
    if isinstance(configured, (list, tuple)) and configured:
        return _first_optimizer(configured[0])
    raise ValueError(f"configure_optimizers returned {type(configured).__name__}: no optimizer")
