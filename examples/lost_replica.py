"""Lightning's own launcher, Lightning's own demo model, and a replica that dies: the others go on.

    python examples/lost_replica.py

Three CPU processes started by Lightning (``Trainer(devices=3)``, the default ``popen``
launcher) train ``BoringModel`` under DiLoCo with ``worker_loss="continue"``; rank 2 exits at
its third step. Rank 0 declares it lost after ``heartbeat_timeout`` (5 s), ranks 0 and 1 log it
and finish the three epochs over the two of them; each prints the epoch it finished.
"""

from __future__ import annotations

import os

import lightning as L
from lightning.pytorch.demos.boring_classes import BoringModel

from lightning_parallel import ModelAveragingStrategy


class LeaveAtStep3(L.Callback):
    """Rank 2's process exits at its third training step (as a killed process would)."""

    def on_train_batch_end(self, trainer: L.Trainer, *args: object) -> None:
        if trainer.global_rank == 2 and trainer.global_step == 3:
            os._exit(1)


def main() -> None:
    strategy = ModelAveragingStrategy(
        algorithm="diloco", period=4, worker_loss="continue", heartbeat_timeout=5
    )
    trainer = L.Trainer(
        accelerator="cpu",
        devices=3,
        strategy=strategy,
        max_epochs=3,
        limit_train_batches=12,
        callbacks=[LeaveAtStep3()],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(BoringModel())
    print(f"rank {trainer.global_rank} finished epoch {trainer.current_epoch}", flush=True)


if __name__ == "__main__":
    main()
