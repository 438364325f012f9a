"""Register strategy names with Lightning so that ``Trainer(strategy="<name>")`` resolves them.

Lightning has no entry-point group for strategies: names must be in its ``StrategyRegistry``
before the ``Trainer`` is built. Every strategy module of this package calls
:func:`register_strategy` at import time, and ``import lightning_parallel`` imports them all.
"""

from __future__ import annotations

from typing import Any

from pytorch_lightning.strategies import Strategy, StrategyRegistry

__all__: list[str] = []

_OUR_NAMES: dict[str, str] = {}


def register_strategy(
    name: str, strategy_cls: type[Strategy], description: str, **init_params: Any
) -> None:
    """Register ``strategy_cls`` under ``name`` with the default ``init_params``.

    Args:
        name: lowercase name accepted by ``Trainer(strategy=...)``.
        strategy_cls: a Lightning ``Strategy`` subclass.
        description: one line shown by ``lightning-parallel strategies``.
        init_params: keyword arguments passed to ``strategy_cls`` when built from the name.
    """
    if name != name.lower():
        raise ValueError(f"strategy name {name!r} must be lowercase; use {name.lower()!r}")
    StrategyRegistry.register(
        name, strategy_cls, description=description, override=True, **init_params
    )
    _OUR_NAMES[name] = description


def registered_names() -> dict[str, str]:
    """Names this package registered, mapped to their one-line description."""
    return dict(_OUR_NAMES)
