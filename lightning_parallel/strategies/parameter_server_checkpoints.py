"""The parameter server's state in Lightning's checkpoints: gathered from the shards, resumed.

:class:`ParameterServerCheckpoints` is the checkpoint part of
:class:`~lightning_parallel.strategies.ParameterServerStrategy`. The user's optimizer never
steps (the server shards do), so the trained optimizer state lives on the shards' hosts:

1. saving, at an epoch's end (nothing pending): every rank's ``optimizer_state`` calls
   :meth:`~lightning_parallel.parameter_server.runtime.ParameterServerRuntime.gather_state`,
   which collects every shard's optimizer state and counters on rank 0. The optimizer state,
   in the user's optimizer's layout, is what Lightning saves under ``optimizer_states`` (the
   checkpoint loads under ``ddp`` and on one device); the shards' versions, counters and the
   run's remaining batches go under ``"parameter_server"`` in the same checkpoint;
2. resuming: ``load_checkpoint`` keeps the ``"parameter_server"`` entry, and
   ``load_optimizer_state_dict`` gives each shard hosted on this rank its part of the optimizer
   state, and its version and counters
   (:meth:`~lightning_parallel.parameter_server.runtime.ParameterServerRuntime.load_state`).
   Without that entry (a checkpoint of another strategy), or from another number of shards,
   only the optimizer state is restored.

Outside a fit (no runtime) Lightning's own behaviour applies.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import Tensor
from torch.optim import Optimizer
from typing_extensions import override

from lightning_parallel.compat.types import StrPath
from lightning_parallel.strategies.parameter_server_collectives import ParameterServerCollectives

__all__: list[str] = []


class ParameterServerCheckpoints(ParameterServerCollectives):
    """Save the server's optimizer state and counters with the checkpoint; resume them."""

    #: what :meth:`optimizer_state` gathered on rank 0 for the checkpoint being saved
    _server_state: dict[str, Any] | None = None
    #: the ``"parameter_server"`` entry of the checkpoint being resumed
    _resume_server_state: dict[str, Any] | None = None

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Tensor]:
        if self.runtime is None:
            return super().optimizer_state(optimizer)
        gathered = self.runtime.gather_state()  # every rank calls this while checkpointing
        if gathered is None:
            self._server_state = None
            return super().optimizer_state(optimizer)
        optimizer_state, self._server_state = gathered
        return optimizer_state

    @override
    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: StrPath, storage_options: Any | None = None
    ) -> None:
        if self._server_state is not None and "optimizer_states" in checkpoint:
            checkpoint["parameter_server"] = self._server_state
        self._server_state = None
        super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)

    @override
    def load_checkpoint(
        self, checkpoint_path: StrPath, *args: Any, **kwargs: Any
    ) -> dict[str, Any]:
        # passed on as given: Lightning 2.4's signature has no weights_only
        checkpoint = super().load_checkpoint(checkpoint_path, *args, **kwargs)
        self._resume_server_state = checkpoint.get("parameter_server")
        return checkpoint

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        super().load_optimizer_state_dict(checkpoint)
        if self.runtime is not None:
            self.runtime.load_state(checkpoint["optimizer_states"][0], self._resume_server_state)
