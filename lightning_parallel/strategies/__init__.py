"""Lightning strategies of this package; importing this package registers their names."""

from lightning_parallel.strategies.registry import register_strategy, registered_names

__all__ = ["register_strategy", "registered_names"]
