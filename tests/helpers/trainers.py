"""Trainer arguments the multi-process tests share."""

from __future__ import annotations

from typing import Any

# a test's Trainer writes nothing and prints no bars or summaries
QUIET: dict[str, Any] = {
    "logger": False,
    "enable_checkpointing": False,
    "enable_progress_bar": False,
    "enable_model_summary": False,
}
