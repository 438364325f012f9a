"""Count what a test's code calls, with the original still running."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any


@contextlib.contextmanager
def recording(owner: Any, name: str) -> Iterator[list[tuple[Any, ...]]]:
    """Record the positional arguments of every call of ``owner.<name>`` inside the block
    (a module's function, or a class's method: then the first argument is the instance)."""
    calls: list[tuple[Any, ...]] = []
    original = getattr(owner, name)

    def recorded(*args: Any, **kwargs: Any) -> Any:
        calls.append(args)
        return original(*args, **kwargs)

    setattr(owner, name, recorded)
    try:
        yield calls
    finally:
        setattr(owner, name, original)
