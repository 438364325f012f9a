"""Shared fixtures: every test starts from a fixed seed, on one CPU thread per process."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
os.environ.setdefault("PL_DISABLE_FORK", "0")
# The tests are written against pytorch_lightning, and one session imports both Lightnings
# (tests/test_compat.py covers lightning.pytorch): the public names and the demo facade must
# give the pytorch_lightning build here, whatever the order the tests run in.
os.environ.setdefault("LIGHTNING_PARALLEL_NAMESPACE", "pytorch_lightning")


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)
    torch.set_num_threads(1)
