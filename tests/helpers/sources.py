"""The package's own source files, without the ``lightning.pytorch`` build written from them."""

from __future__ import annotations

from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "lightning_parallel"
_BUILD = PACKAGE / "lightning"


def source_files(folder: Path = PACKAGE) -> list[Path]:
    """Every ``.py`` file under ``folder``, less the generated build (lightning_parallel/lightning/,
    all but its hand-written ``__init__.py``: see lightning_parallel/compat/generate.py)."""
    return sorted(
        path
        for path in folder.rglob("*.py")
        if not (path.is_relative_to(_BUILD) and path != _BUILD / "__init__.py")
    )
