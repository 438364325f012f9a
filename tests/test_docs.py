"""The docs' Python code blocks run: each page's blocks, concatenated, as one script."""

import re
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.environment import user_environment

pytestmark = pytest.mark.slow  # the pages' code runs whole fits

DOCS = Path(__file__).resolve().parent.parent / "docs"
BLOCK = re.compile(r"^```python\n(.*?)^```", re.MULTILINE | re.DOTALL)
PAGES = sorted(p for p in DOCS.rglob("*.md") if BLOCK.search(p.read_text()))


def test_there_are_runnable_pages():
    assert any(p.name == "tutorial.md" for p in PAGES)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_page_code_runs(page, tmp_path):
    script = "\n\n".join(BLOCK.findall(page.read_text()))
    path = tmp_path / f"docs_page_{page.stem}.py"  # not lightning.py: it would shadow the package
    path.write_text(script)
    result = subprocess.run(
        [sys.executable, str(path)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=180,
        env=user_environment(),
    )
    assert result.returncode == 0, f"{page.name} failed:\n{result.stderr[-4000:]}"
