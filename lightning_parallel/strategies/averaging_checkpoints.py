"""Model averaging's checkpoints: the averaged model in the file, each replica beside it.

:class:`AveragingCheckpoints` is the checkpoint half of
:class:`~lightning_parallel.strategies.ModelAveragingStrategy`: ``state_dict`` is the mean of
the replicas (an ordinary checkpoint that loads anywhere); under :data:`CHECKPOINT_KEY` go the
schedule, the averagers' state and, in files of their own
(:mod:`lightning_parallel.averaging.replica_files`), every rank's replica, optimizer state and
rounds in flight, so that a resumed run continues exactly.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch.distributed as dist
from pytorch_lightning.utilities.rank_zero import rank_zero_warn
from typing_extensions import override

from lightning_parallel.averaging import ReplicaAveraging, replica_files
from lightning_parallel.compat.types import StrPath
from lightning_parallel.strategies.averaging_options import resume_mismatch
from lightning_parallel.strategies.worker_loss import SurvivorCollectives

__all__: list[str] = []

#: Key of the averaging state in a Lightning checkpoint.
CHECKPOINT_KEY = "model_averaging"


class AveragingCheckpoints(SurvivorCollectives):
    """Save and restore the state of :attr:`averaging` with Lightning's checkpoints."""

    averaging: ReplicaAveraging | None = None
    _restored: dict[str, Any] | None = None
    _checkpoint_path: StrPath | None = None

    # ------------------------------------------------------------------ checkpoints

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        if self.averaging is None:
            return super().lightning_module_state_dict()
        if self.survivors is None:  # (the survivors agree on every collective already)
            # the checkpoint's first collective: after a failure, only if every rank is here
            self.check_every_rank_saves("the replicas")
        self.averaging.synchronize()
        return self.averaging.averaged_state_dict()

    @override
    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: StrPath, storage_options: Any | None = None
    ) -> None:
        """Save the averaged model; each rank's replica goes to a file of its own first.

        See :mod:`lightning_parallel.averaging.replica_files`: the checkpoint's size does not
        grow with the world size, and a crash during a save leaves the previous one intact.
        """
        averaging = self.averaging
        if averaging is None or "optimizer_states" not in checkpoint:
            super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)
            return
        averaging.synchronize()
        local = averaging.local_state_dict()
        state: dict[str, Any] = {
            "algorithm": type(averaging.averager).__name__,
            "world_size": averaging.world_size,
            "shared": averaging.state_dict(),
        }
        if not replica_files.supports(filepath):
            # a URL (s3://...): the replicas travel in the checkpoint, gathered on rank 0
            gathered: list[Any] | None = [local]
            if self.survivors is not None:
                gathered = self.gather_objects(local)
            elif averaging.world_size > 1:
                gathered = [None] * averaging.world_size if self.is_global_zero else None
                dist.gather_object(local, gathered, dst=0)
            checkpoint[CHECKPOINT_KEY] = {"format": 1, **state, "replicas": gathered}
            super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)
            return
        save_id = f"step{averaging.schedule.optimizer_steps}"
        # by place among the ranks in the run: after a lost replica, a run of the survivors'
        # size resumes exactly
        replica_files.save_replica(
            local, replica_files.replica_path(filepath, save_id, self.member_index())
        )
        self.barrier(
            "model_averaging.save_replicas"
        )  # every replica is on disk before the checkpoint
        checkpoint[CHECKPOINT_KEY] = {"format": 2, **state, "replica_files": save_id}
        super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)
        if self.is_global_zero:
            replica_files.remove_other_saves(filepath, keep=save_id)

    @override
    def remove_checkpoint(self, filepath: StrPath) -> None:
        super().remove_checkpoint(filepath)
        if self.is_global_zero and replica_files.supports(filepath):
            replica_files.remove_other_saves(filepath, keep=None)

    @override
    def load_checkpoint(
        self, checkpoint_path: StrPath, *args: Any, **kwargs: Any
    ) -> dict[str, Any]:
        self._checkpoint_path = checkpoint_path
        return super().load_checkpoint(checkpoint_path, *args, **kwargs)

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        super().load_model_state_dict(checkpoint, strict=strict)
        self._restored = checkpoint.get(CHECKPOINT_KEY)

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        super().load_optimizer_state_dict(checkpoint)
        if self._restored is None and CHECKPOINT_KEY in checkpoint:
            self._restored = checkpoint[CHECKPOINT_KEY]
        restored, self._restored = self._restored, None
        if restored is not None and self.averaging is not None:
            self._restore_averaging(self.averaging, restored)

    def _restore_averaging(self, averaging: ReplicaAveraging, restored: dict[str, Any]) -> None:
        algorithm = type(averaging.averager).__name__
        replica = self._saved_replica(restored)
        reason = resume_mismatch(restored, averaging, algorithm)
        if reason is None and replica is None:
            reason = (
                f"rank {self.global_rank}'s replica file of the checkpoint is missing (copy the "
                f"{replica_files.SUFFIX} folder beside the checkpoint along with it)"
            )
        if reason is not None or replica is None:
            rank_zero_warn(
                f"{reason}: every replica restarts from the checkpoint's averaged model and the "
                "averager starts afresh (only the step counter is kept)"
            )
            averaging.schedule.load_state_dict(restored["shared"]["schedule"])
            return
        averaging.load_state_dict(restored["shared"])
        averaging.load_local_state_dict(replica)

    def _saved_replica(self, restored: dict[str, Any]) -> dict[str, Any] | None:
        """This rank's saved replica state, or ``None`` where it cannot be found."""
        if restored.get("format", 1) == 1:
            replicas = restored.get("replicas") or []
            return replicas[self.global_rank] if self.global_rank < len(replicas) else None
        if self._checkpoint_path is None:
            return None
        path = replica_files.replica_path(
            self._checkpoint_path, restored["replica_files"], self.global_rank
        )
        return replica_files.load_replica(path) if path.is_file() else None
