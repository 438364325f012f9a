"""The base of the bench's pipeline peers that keep the whole model on every rank."""

from __future__ import annotations

from abc import abstractmethod

from lightning_parallel.strategies.gropipe import GroPipeStrategy

__all__: list[str] = []


class WholeModelPeer(GroPipeStrategy):
    """A peer that keeps the whole model on every rank while each rank trains its own stages:
    :meth:`consolidate` copies every stage's weights from the rank that trains it, before
    evaluation and at the end of ``fit``."""

    owns_stages = False

    @abstractmethod
    def consolidate(self) -> None:
        """Copy every stage's weights from the rank that trains it to every rank."""

    def on_validation_start(self) -> None:
        self.consolidate()

    def on_train_end(self) -> None:
        """Give every rank every stage's weights: the fork/spawn launchers hand rank 0's model
        back, and the next run in the same processes (``validate`` after ``fit``) starts by
        copying rank 0's model to every rank."""
        super().on_train_end()
        self.consolidate()
