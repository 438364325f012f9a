"""The public classes are classes to type checkers: a user may subclass them under ``--strict``.

``typing_check/user_subclasses.py`` subclasses every public strategy and callback of the
``lightning.pytorch`` build; its copy with the imports swapped does the same for
``pytorch_lightning``. Both must pass ``mypy --strict`` and strict ``pyright`` with no error, and
a copy of each that passes a string for ``stages`` must fail both: the checkers read the real
signature, not ``Any``.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
USER_FILE = Path(__file__).parent / "typing_check" / "user_subclasses.py"
BAD_LINE = 'wrong = MyGroPipe(stages="two")\n'
_TO_PYTORCH_LIGHTNING = (
    ("import lightning.pytorch as pl\n", "import pytorch_lightning as pl\n"),
    ("from lightning.pytorch.strategies import", "from pytorch_lightning.strategies import"),
    ("from lightning_parallel import (", "from lightning_parallel.pytorch_lightning import ("),
)


def _files(folder: Path) -> dict[str, Path]:
    """The user file for each namespace, and a copy of each with :data:`BAD_LINE` appended."""
    lightning = USER_FILE.read_text()
    pytorch_lightning = lightning
    for old, new in _TO_PYTORCH_LIGHTNING:
        assert old in pytorch_lightning, old
        pytorch_lightning = pytorch_lightning.replace(old, new)
    texts = {
        "user_lightning": lightning,
        "user_pytorch_lightning": pytorch_lightning,
        "bad_lightning": lightning + BAD_LINE,
        "bad_pytorch_lightning": pytorch_lightning + BAD_LINE,
    }
    files = {}
    for name, text in texts.items():
        files[name] = folder / f"{name}.py"
        files[name].write_text(text)
    return files


def _errors_by_file(lines: list[tuple[str, str]], files: dict[str, Path]) -> dict[str, list[str]]:
    errors: dict[str, list[str]] = {name: [] for name in files}
    for path, message in lines:
        for name, file in files.items():
            if Path(path).name == file.name:
                errors[name].append(message)
    return errors


def _assert_only_the_bad_lines_fail(errors: dict[str, list[str]], checker: str) -> None:
    assert errors["user_lightning"] == [], f"{checker}: {errors['user_lightning']}"
    assert errors["user_pytorch_lightning"] == [], f"{checker}: {errors['user_pytorch_lightning']}"
    for name in ("bad_lightning", "bad_pytorch_lightning"):
        assert errors[name] and all('"stages"' in error for error in errors[name]), (
            f"{checker} accepted stages='two' in {name}: {errors[name]}"
        )


def test_mypy_strict_types_every_public_class_under_both_namespaces(tmp_path) -> None:
    files = _files(tmp_path)
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "mypy",
            "--strict",
            # the user's file is checked; the installed libraries' own code is not reported on
            "--follow-imports=silent",
            "--cache-dir",
            str(tmp_path / "cache"),
            *map(str, files.values()),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
        env={**os.environ, "MYPYPATH": str(ROOT)},  # an editable install is an import hook
    )
    found = re.findall(r"^(\S+\.py):\d+: error: (.*)$", done.stdout, flags=re.MULTILINE)
    _assert_only_the_bad_lines_fail(_errors_by_file(found, files), "mypy")


def test_pyright_strict_types_every_public_class_under_both_namespaces(tmp_path) -> None:
    pyright = shutil.which("pyright", path=str(Path(sys.executable).parent))
    # a dev install has it (pyproject's dev extras), as it has mypy: missing is a failure
    assert pyright is not None, "pyright is not installed: pip install -e '.[dev]'"
    files = _files(tmp_path)
    done = subprocess.run(
        [pyright, "--outputjson", "--pythonpath", sys.executable, *map(str, files.values())],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,  # pyright resolves the package from its project root (editable installs hide it)
    )
    report = json.loads(done.stdout)
    found = [
        (entry["file"], entry["message"])
        for entry in report["generalDiagnostics"]
        if entry["severity"] == "error"
    ]
    _assert_only_the_bad_lines_fail(_errors_by_file(found, files), "pyright")
