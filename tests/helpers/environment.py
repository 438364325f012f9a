"""The environment of a user's process, for tests that run scripts as a user would."""

from __future__ import annotations

import os

# conftest.py pins the test session's public names to pytorch_lightning; a user's script (a docs
# page, an example) has no such pin and must find its Lightning by itself
OVERRIDE = "LIGHTNING_PARALLEL_NAMESPACE"


def user_environment(**extra: str) -> dict[str, str]:
    """``os.environ`` without the test session's namespace pin, plus ``extra``."""
    environment = {key: value for key, value in os.environ.items() if key != OVERRIDE}
    environment.update(extra)
    return environment
