"""Type aliases the Lightning layer shares (Lightning's own live in private modules)."""

from __future__ import annotations

from pathlib import Path

__all__: list[str] = []

# a checkpoint path, as Lightning's strategies accept it
StrPath = str | Path
