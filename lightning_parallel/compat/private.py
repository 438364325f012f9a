"""The only door to Lightning's private API, with the versions each use was checked on.

Every use of a name Lightning does not promise to keep is listed in :data:`PRIVATE_USES` with
why it is needed, and reached through a function of this module. :func:`check` looks each one
up in the namespace a strategy or callback belongs to; every strategy and callback of this
package calls it when it is constructed, so a Lightning release that removes one fails there,
with an error naming it and the supported range, never with an ``AttributeError`` in a step.

Torch-level helpers that Lightning keeps private (``_sync_module_states``,
``_register_ddp_comm_hook``, ``_optimizers_to_device``, ``_sync_ddp_if_available``) are not used:
:mod:`lightning_parallel.comm.modules` has plain-torch versions of them.
"""

from __future__ import annotations

import functools
import importlib
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from lightning_parallel.compat.namespaces import Namespace, of_object

__all__: list[str] = []

# The range the whole suite runs on in CI (the oldest and the newest release are tested).
SUPPORTED = ">=2.4, <2.7"
CHECKED = "2.4.0 and 2.6.6"


class LightningCompatError(RuntimeError):
    """The installed Lightning lacks something this package needs."""


@dataclass(frozen=True)
class PrivateUse:
    """One private Lightning name this package relies on.

    Attributes:
        module: the module, relative to the namespace's trainer package (``"strategies"``) or,
            with a leading ``fabric.``, to its fabric package.
        owner: the class holding ``name``; empty for a module-level name.
        name: the private name.
        kind: ``"attribute"`` (on the class or module), or ``"set in __init__"`` (an
            instance attribute, looked up in the source of ``owner.__init__``).
        why: what would break without it.
        required: ``False`` for a name that older releases lack and that is only worked around
            where it exists.
    """

    module: str
    owner: str
    name: str
    kind: str
    why: str
    required: bool = True


PRIVATE_USES: tuple[PrivateUse, ...] = (
    PrivateUse(
        "strategies.launchers",
        "",
        "_MultiProcessingLauncher",
        "attribute",
        "the spawn/fork launcher for pipeline and parameter-server strategies, which are not "
        "DDPStrategy launches (no DDP wrapper) but start processes the same way",
    ),
    PrivateUse(
        "strategies.launchers",
        "",
        "_SubprocessScriptLauncher",
        "attribute",
        "the popen launcher (and the one for externally started processes: torchrun, SLURM)",
    ),
    PrivateUse(
        "strategies.launchers",
        "_SubprocessScriptLauncher",
        "_call_children_scripts",
        "attribute",
        "starts the other ranks for the popen launcher that lets them outlive a lost one "
        "(worker_loss='continue'); Lightning's own kills every rank when one child fails",
    ),
    PrivateUse(
        "fabric.utilities.distributed",
        "",
        "_set_num_threads_if_needed",
        "attribute",
        "the per-process thread count Lightning's popen launcher sets, kept by that launcher",
        required=False,
    ),
    PrivateUse(
        "strategies",
        "DDPStrategy",
        "_configure_launcher",
        "attribute",
        "the hook Lightning calls to pick a launcher; overridden to choose one of the two above",
    ),
    PrivateUse(
        "strategies",
        "DDPStrategy",
        "_start_method",
        "set in __init__",
        "which launcher the user chose (start_method=...)",
    ),
    PrivateUse(
        "strategies",
        "DDPStrategy",
        "_launcher",
        "set in __init__",
        "where _configure_launcher stores the launcher",
    ),
    PrivateUse(
        "strategies",
        "DDPStrategy",
        "_register_ddp_hooks",
        "attribute",
        "registers DDP comm hooks on CUDA only; overridden to register them on CPU too",
    ),
    PrivateUse(
        "strategies",
        "ParallelStrategy",
        "_layer_sync",
        "set in __init__",
        "Trainer(sync_batchnorm=True), which model averaging refuses",
    ),
    PrivateUse(
        "callbacks",
        "Callback",
        "_generate_state_key",
        "attribute",
        "the checkpoint key of a callback with options (Lightning's documented way)",
    ),
    PrivateUse(
        "loops.fit_loop",
        "_FitLoop",
        "_combined_loader",
        "set in __init__",
        "the parameter server's budgeted loader, restarted at an epoch start",
    ),
    PrivateUse(
        "loops.fit_loop",
        "_FitLoop",
        "_data_fetcher",
        "set in __init__",
        "the fit loop's iterator over that loader",
    ),
    PrivateUse(
        "loops.training_epoch_loop",
        "_TrainingEpochLoop",
        "_broadcast_sigterm_tensor",
        "attribute",
        "a per-batch broadcast from rank 0 that would put asynchronous workers in lockstep "
        "(2.4 has none: each rank checks its own signal there, which is what replaces it)",
        required=False,
    ),
    PrivateUse(
        "callbacks",
        "ModelCheckpoint",
        "_every_n_train_steps",
        "set in __init__",
        "saving inside an epoch, which parameter-server workers refuse",
    ),
    PrivateUse(
        "callbacks",
        "ModelCheckpoint",
        "_train_time_interval",
        "set in __init__",
        "saving inside an epoch, which parameter-server workers refuse",
    ),
    PrivateUse(
        "callbacks",
        "Timer",
        "_duration",
        "set in __init__",
        "Timer(interval='step'), which parameter-server workers refuse",
    ),
    PrivateUse(
        "callbacks",
        "Timer",
        "_interval",
        "set in __init__",
        "Timer(interval='step'), which parameter-server workers refuse",
    ),
    PrivateUse(
        "core.module",
        "LightningModule",
        "_trainer",
        "set in __init__",
        "the trainer a module is attached to, or None (the public property raises instead)",
    ),
    PrivateUse(
        "core.optimizer",
        "LightningOptimizer",
        "_optimizer",
        "set in __init__",
        "the user's optimizer inside Lightning's wrapper, which the pipelines rebuild over a "
        "stage's parameters",
    ),
    PrivateUse(
        "plugins.precision",
        "Precision",
        "_after_closure",
        "attribute",
        "Lightning's work before an optimizer step (the hooks, then clipping), which SpecTrain "
        "runs itself: its stages step inside the pipeline, not in optimizer_step",
    ),
)


def _resolve_module(namespace: Namespace, relative: str) -> Any:
    if relative.startswith("fabric."):
        return importlib.import_module(f"{namespace.fabric}.{relative[len('fabric.') :]}")
    return importlib.import_module(f"{namespace.pytorch}.{relative}")


def _missing(namespace: Namespace, use: PrivateUse) -> str | None:
    """Why ``use`` is not available in ``namespace``, or ``None`` if it is."""
    try:
        module = _resolve_module(namespace, use.module)
    except ImportError:
        return f"module {namespace.pytorch}.{use.module} is gone"
    owner = getattr(module, use.owner, None) if use.owner else module
    if owner is None:
        return f"{namespace.pytorch}.{use.module}.{use.owner} is gone"
    if use.kind == "attribute":
        return None if hasattr(owner, use.name) else f"{use.owner or use.module}.{use.name} is gone"
    # an instance attribute: some class of the owner's MRO sets it in its __init__
    for klass in owner.__mro__:
        init = vars(klass).get("__init__")
        if init is None:
            continue
        try:
            source = inspect.getsource(init)
        except (OSError, TypeError):
            return None  # no source to read (a zipped install): trust the version range
        if f"self.{use.name}" in source:
            return None
    return f"{use.owner}.__init__ no longer sets self.{use.name}"


@functools.cache
def problems(namespace: Namespace) -> tuple[str, ...]:
    """Every private use missing from ``namespace``, each with why it is needed."""
    found = []
    for use in PRIVATE_USES:
        if not use.required:
            continue
        reason = _missing(namespace, use)
        if reason is not None:
            found.append(f"{reason} (needed for: {use.why})")
    return tuple(found)


def check(obj: object) -> None:
    """Raise if ``obj``'s Lightning (a strategy or callback of ours) lacks a private use.

    Raises:
        LightningCompatError: names each missing use, the installed version and the
            supported range.
    """
    namespace = of_object(obj)
    if namespace is None:
        return
    missing = problems(namespace)
    if missing:
        raise LightningCompatError(
            f"{type(obj).__name__} cannot run on {namespace.distribution} {namespace.version()}: "
            + "; ".join(missing)
            + f". lightning_parallel supports {namespace.distribution} {SUPPORTED} (checked on "
            f"{CHECKED}); install a version in that range"
        )


# --------------------------------------------------------------------------- launchers


START_METHODS = ("popen", "spawn", "fork", "forkserver")


def check_start_method(value: str) -> None:
    """Raise ``ValueError`` unless ``value`` names one of Lightning's launchers."""
    if value not in START_METHODS:
        raise ValueError(f"start_method must be one of {START_METHODS}, got {value!r}")


def make_launcher(
    strategy: Any, start_method: str, external: bool, keep_survivors: bool = False
) -> Any:
    """Lightning's launcher for ``strategy``: the script launcher or the spawn/fork one.

    Args:
        strategy: a Lightning ``ParallelStrategy`` of ours.
        start_method: ``"popen"`` or a ``multiprocessing`` start method.
        external: the processes were started by someone else (torchrun, SLURM, our cluster).
        keep_survivors: the popen launcher lets the other ranks outlive one that dies (its
            observer thread, which kills every rank when a child fails, is not started).
    """
    namespace = of_object(strategy)
    assert namespace is not None
    launchers = _resolve_module(namespace, "strategies.launchers")
    if external or start_method == "popen":
        script_launcher = launchers._SubprocessScriptLauncher
        if keep_survivors and not external:
            script_launcher = _surviving(script_launcher, namespace)
        return script_launcher(
            strategy.cluster_environment, strategy.num_processes, strategy.num_nodes
        )
    return launchers._MultiProcessingLauncher(strategy, start_method=start_method)


@functools.cache
def _surviving(script_launcher: type, namespace: Namespace) -> type:
    """``script_launcher`` without the observer that ends every rank when one child fails."""
    distributed = _resolve_module(namespace, "fabric.utilities.distributed")
    set_threads = getattr(distributed, "_set_num_threads_if_needed", None)

    class SurvivingScriptLauncher(script_launcher):  # type: ignore[misc, valid-type]
        """Lightning's popen launcher whose ranks outlive a lost one (``worker_loss``)."""

        def launch(
            self, function: Callable[..., Any], *args: Any, trainer: Any = None, **kwargs: Any
        ) -> Any:
            environment = self.cluster_environment
            environment.validate_settings(num_devices=self.num_processes, num_nodes=self.num_nodes)
            if not environment.creates_processes_externally:
                self._call_children_scripts()
            if set_threads is not None:
                set_threads(num_processes=self.num_processes)
            return function(*args, **kwargs)

    return SurvivingScriptLauncher


def start_method(strategy: Any) -> str:
    """The start method a ``DDPStrategy`` was built with."""
    return str(strategy._start_method)


def set_launcher(strategy: Any, launcher: Any) -> None:
    """Store ``launcher`` where Lightning's ``Strategy.launcher`` reads it."""
    strategy._launcher = launcher


# --------------------------------------------------------------------------- DDP internals


def layer_sync(strategy: Any) -> Any:
    """The strategy's layer-sync plugin (set by ``Trainer(sync_batchnorm=True)``), or ``None``."""
    return strategy._layer_sync


def attached_trainer(module: Any) -> Any:
    """The trainer ``module`` is attached to, or ``None`` (also for no module; the public
    ``LightningModule.trainer`` raises instead)."""
    return getattr(module, "_trainer", None)


def unwrapped_optimizer(optimizer: Any) -> Any:
    """The optimizer inside a ``LightningOptimizer`` (any other optimizer as it is)."""
    return getattr(optimizer, "_optimizer", optimizer)


def after_closure(precision: Any, module: Any, optimizer: Any) -> None:
    """Lightning's pre-step work (``on_before_optimizer_step`` hooks, then gradient clipping)."""
    precision._after_closure(module, optimizer)


def state_key(callback: Any, **options: Any) -> str:
    """A callback's checkpoint key that includes its options (``Callback._generate_state_key``)."""
    return str(callback._generate_state_key(**options))


# --------------------------------------------------------------------------- loop internals


def should_update_logs(trainer: Any) -> bool:
    """Whether the trainer writes this step's metrics (``log_every_n_steps``)."""
    return bool(trainer._logger_connector.should_update_logs)


def fit_loop_data(trainer: Any) -> tuple[Any, Any]:
    """The fit loop's ``(combined loader, data fetcher)``; either may be ``None``."""
    loop = trainer.fit_loop
    return loop._combined_loader, loop._data_fetcher


def replace_sigterm_broadcast(
    trainer: Any, check: Callable[[], None], keep_existing: bool = False
) -> Callable[[], None]:
    """Make the epoch loop call ``check`` instead of broadcasting rank 0's SIGTERM flag.

    Args:
        keep_existing: leave a replacement already in place (a strategy's own) as it is.

    Returns:
        A function that restores Lightning's broadcast.
    """
    epoch_loop = trainer.fit_loop.epoch_loop
    if not hasattr(epoch_loop, "_broadcast_sigterm_tensor"):
        return lambda: None  # an older Lightning: each rank already checks its own signal
    if keep_existing and "_broadcast_sigterm_tensor" in vars(epoch_loop):
        return lambda: None
    epoch_loop._broadcast_sigterm_tensor = check
    return lambda: epoch_loop.__dict__.pop("_broadcast_sigterm_tensor", None)


def saves_inside_epoch(checkpoint: Any) -> bool:
    """Whether a ``ModelCheckpoint`` saves every N steps or every time interval."""
    return checkpoint._every_n_train_steps > 0 or checkpoint._train_time_interval is not None


def stops_on_step_timer(timer: Any) -> bool:
    """Whether a ``Timer`` has a duration and checks it every step."""
    return timer._interval == "step" and bool(timer._duration)
