"""Write the ``lightning.pytorch`` build of this package's Lightning layer as real files.

The strategies, callbacks, demo models and data and the CLI subclass Lightning's classes, and a
class can subclass only one of the two namespaces' (see :mod:`.namespaces`). The source is
written once, against ``pytorch_lightning`` (this package's required dependency), at its own
path (``lightning_parallel/strategies/`` ...). The ``lightning.pytorch`` build is the same files
with the Lightning import paths mapped the way Lightning's own build maps them to produce its two
packages, written under ``lightning_parallel/lightning/``:

======================================  ==============================================
in the source                           in the ``lightning.pytorch`` build
======================================  ==============================================
``pytorch_lightning``                   ``lightning.pytorch``
``lightning_fabric``                    ``lightning.fabric``
``lightning_parallel.strategies`` ...   ``lightning_parallel.lightning.strategies`` ...
======================================  ==============================================

They are ordinary modules: type checkers, IDEs, ``inspect`` and ``pickle`` see real classes at a
real path. A wheel carries them (``setup.py`` writes them into the build); in a source checkout
they are git-ignored and :func:`ensure_current`, run when ``lightning_parallel.lightning`` is
imported, writes the ones that are missing or older than their source. Each ends with a line
naming its source; the mapping keeps every other line where it was, so a traceback's line
number is the source's too.

This module uses only the standard library: ``setup.py`` loads it by path, before anything is
installed. ``python -m lightning_parallel.compat.generate [--check]`` writes (or checks) the build.
"""

from __future__ import annotations

import os
import re
import sys
import tempfile
from pathlib import Path

__all__ = ["LAYER_MODULES", "ensure_current", "expected_files", "rewrite", "write"]

# The modules (and packages, with everything under them) that import Lightning.
LAYER_MODULES: tuple[str, ...] = (
    "strategies",
    "callbacks",
    "demo.classifier",
    "demo.image_models",
    "demo.sequence_models",
    "demo.models",
    "demo.data",
    "cli",
)
ROOT = "lightning_parallel"
BUILD = "lightning"  # the build's folder inside the package: lightning_parallel/lightning/
PACKAGE_DIR = Path(__file__).resolve().parent.parent
_LAYER_PATTERN = "|".join(re.escape(name) for name in LAYER_MODULES)
_REWRITES: tuple[tuple[re.Pattern[str], str], ...] = (
    (re.compile(r"\bpytorch_lightning\b"), "lightning.pytorch"),
    (re.compile(r"\blightning_fabric\b"), "lightning.fabric"),
    (re.compile(rf"\b{ROOT}\.({_LAYER_PATTERN})\b"), rf"{ROOT}.{BUILD}.\1"),
)
_FOOTER = (
    "# generated from {source} by lightning_parallel.compat.generate: edit that file instead\n"
)
_FOOTER_START = "# generated from "
_PACKAGE_DOC = '"""The lightning.pytorch build of {name} (compat/generate.py)."""\n'


def rewrite(source: str) -> str:
    """``source`` with its Lightning import paths mapped to the ``lightning.pytorch`` build."""
    for pattern, replacement in _REWRITES:
        source = pattern.sub(replacement, source)
    return source


def _sources(package_dir: Path) -> list[Path]:
    """The layer's source files, relative to ``package_dir``."""
    files: list[Path] = []
    for relative in LAYER_MODULES:
        base = package_dir.joinpath(*relative.split("."))
        if base.is_dir():
            files += sorted(path.relative_to(package_dir) for path in base.rglob("*.py"))
        else:
            files.append(base.with_suffix(".py").relative_to(package_dir))
    return files


def expected_files(package_dir: Path = PACKAGE_DIR) -> dict[Path, str]:
    """Every file of the build (relative to ``package_dir``) mapped to the text it must hold."""
    expected: dict[Path, str] = {}
    for relative in _sources(package_dir):
        text = rewrite((package_dir / relative).read_text(encoding="utf-8"))
        if not text.endswith("\n"):
            text += "\n"
        source = f"{ROOT}/{relative.as_posix()}"
        expected[BUILD / relative] = text + _FOOTER.format(source=source)
        for parent in relative.parents:
            # an intermediate package with no source of its own (``demo`` of ``demo.models``)
            init = BUILD / parent / "__init__.py"
            if parent != Path(".") and init not in expected and not _is_source(parent, package_dir):
                name = f"{ROOT}.{'.'.join(parent.parts)}"
                expected[init] = _PACKAGE_DOC.format(name=name) + _FOOTER.format(source=name)
    return expected


def _is_source(relative_dir: Path, package_dir: Path) -> bool:
    dotted = ".".join(relative_dir.parts)
    return any(dotted == name or dotted.startswith(name + ".") for name in LAYER_MODULES)


def _generated(path: Path) -> bool:
    """Whether ``path`` is a file this module wrote (it ends with the footer)."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError:
        return False
    return bool(lines) and lines[-1].startswith(_FOOTER_START)


def stale(package_dir: Path = PACKAGE_DIR, target_dir: Path | None = None) -> list[Path]:
    """The build's files (relative) that are missing or differ, and leftovers of removed sources."""
    target_dir = target_dir or package_dir
    expected = expected_files(package_dir)
    out = []
    for relative, text in expected.items():
        path = target_dir / relative
        try:
            current = path.read_text(encoding="utf-8")
        except OSError:
            current = None
        if current != text:
            out.append(relative)
    build = target_dir / BUILD
    if build.is_dir():
        for path in sorted(build.rglob("*.py")):
            relative = path.relative_to(target_dir)
            if relative not in expected and _generated(path):
                out.append(relative)
    return out


def _write_atomically(path: Path, text: str) -> None:
    # ranks that import at the same moment each write a whole file; the last rename wins
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(handle, "w", encoding="utf-8") as stream:
            stream.write(text)
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise


def write(package_dir: Path = PACKAGE_DIR, target_dir: Path | None = None) -> list[Path]:
    """Write the build's stale files under ``target_dir`` (default: the package itself).

    Returns:
        the files (relative to ``target_dir``) written or, for removed sources, deleted.
    """
    target_dir = target_dir or package_dir
    expected = expected_files(package_dir)
    changed = stale(package_dir, target_dir)
    for relative in changed:
        if relative in expected:
            _write_atomically(target_dir / relative, expected[relative])
        else:
            (target_dir / relative).unlink(missing_ok=True)
    return changed


def ensure_current() -> None:
    """Bring the build in this package's folder up to date with its source.

    Raises:
        ImportError: the build is stale and its folder is read-only (names the command to run).
    """
    if not stale():
        return
    try:
        write()
    except OSError as error:
        raise ImportError(
            f"the lightning.pytorch build in {PACKAGE_DIR / BUILD} is older than its source and "
            f"cannot be written ({error}); run `python -m lightning_parallel.compat.generate` "
            "with write access, or reinstall lightning-parallel"
        ) from error


def main(argv: list[str] | None = None) -> int:
    """``python -m lightning_parallel.compat.generate [--check]``."""
    args = sys.argv[1:] if argv is None else argv
    if args == ["--check"]:
        behind = stale()
        for relative in behind:
            print(f"stale: {relative.as_posix()}")
        return 1 if behind else 0
    if args:
        print("usage: python -m lightning_parallel.compat.generate [--check]", file=sys.stderr)
        return 2
    for relative in write():
        print(f"wrote {relative.as_posix()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
