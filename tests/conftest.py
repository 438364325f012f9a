"""Shared fixtures: every test starts from a fixed seed, on one CPU thread per process."""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Iterator
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


@pytest.fixture(autouse=True)
def _environment() -> Iterator[None]:
    """Each test gets the session's environment back: a Trainer run in this process sets
    ``MASTER_PORT`` and the ranks' variables, which later subprocesses must not inherit."""
    from lightning_parallel.bench.plan_profile import restore_environment

    saved = dict(os.environ)
    yield
    restore_environment(saved)


@pytest.fixture(autouse=True)
def _ports(monkeypatch: pytest.MonkeyPatch) -> None:
    """Lightning's launchers pick ``MASTER_PORT`` by binding port 0, which races with the other
    pytest-xdist workers' ports: in tests they take this worker's next port instead
    (:func:`helpers.ports.free_port`)."""
    from helpers.ports import free_port

    for name in (
        "lightning_fabric.plugins.environments.lightning",
        "lightning.fabric.plugins.environments.lightning",
    ):
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        monkeypatch.setattr(module, "find_free_network_port", free_port)


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """``-n auto`` (pyproject's addopts): one worker more than there are cores, at most 8.

    Much of the suite waits (a frozen rank's heartbeat, a collective's timeout, a subprocess
    starting), so a third worker on 2 cores fills that time; more would only crowd the CPU.
    """
    return min(8, (os.cpu_count() or 1) + 1)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Fault and real-network tests are ``slow`` too: ``pytest -m "not slow"`` (the quick loop)
    leaves out whatever waits for a timeout or builds network namespaces."""
    for item in items:
        if item.get_closest_marker("faults") or item.get_closest_marker("netns"):
            item.add_marker(pytest.mark.slow)
    # the long tests first, the longest of them (the top-level files: examples, docs pages,
    # the CLI and the type checkers, each in fresh processes) before the rest: on pytest-xdist's
    # workers the short tests then fill the gaps, instead of one worker finishing a long test
    # alone at the end
    items.sort(
        key=lambda item: (item.get_closest_marker("slow") is None, item.path.parent.name != "tests")
    )
