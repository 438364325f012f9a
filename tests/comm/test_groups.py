"""``lightning_parallel.comm.groups.new_group``: the run's timeout, and the step around torch's
split of a device-bound gloo default group (which gloo cannot do)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

from lightning_parallel.comm import groups


class _Backend:
    def __init__(self, splits: bool, has_nocolor_split: bool) -> None:
        self.supports_splitting = splits
        if has_nocolor_split:
            self.perform_nocolor_split = lambda device: None


class _DefaultGroup:
    def __init__(self, backend: _Backend) -> None:
        self.bound_device_id: torch.device | None = torch.device("cuda", 0)
        self.backend = backend

    def _get_backend(self, device: torch.device) -> _Backend:
        return self.backend


@pytest.mark.parametrize(
    ("splits", "has_nocolor_split", "unbound"),
    [
        (True, False, True),  # gloo on a CUDA device: torch would call a method gloo lacks
        (True, True, False),  # NCCL: the split works, the binding stays
        (False, False, False),  # a backend that does not split: nothing to step around
    ],
)
def test_new_group_unbinds_only_a_default_group_that_cannot_split(
    monkeypatch: pytest.MonkeyPatch, splits: bool, has_nocolor_split: bool, unbound: bool
) -> None:
    default = _DefaultGroup(_Backend(splits, has_nocolor_split))
    seen: list[Any] = []

    def fake_new_group(**kwargs: Any) -> str:
        seen.append((default.bound_device_id, kwargs["ranks"], kwargs["timeout"]))
        return "group"

    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist.distributed_c10d, "_get_default_group", lambda: default)
    monkeypatch.setattr(dist, "new_group", fake_new_group)
    assert groups.new_group([1, 0]) == "group"
    expected = None if unbound else torch.device("cuda", 0)
    assert seen == [(expected, [0, 1], groups.group_timeout())]
    assert default.bound_device_id == torch.device("cuda", 0)  # restored after the call


def test_new_group_restores_the_binding_when_torch_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    default = _DefaultGroup(_Backend(splits=True, has_nocolor_split=False))

    def failing_new_group(**kwargs: Any) -> None:
        assert default.bound_device_id is None
        raise RuntimeError("rendezvous timed out")

    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist.distributed_c10d, "_get_default_group", lambda: default)
    monkeypatch.setattr(dist, "new_group", failing_new_group)
    with pytest.raises(RuntimeError, match="rendezvous"):
        groups.new_group([0, 1])
    assert default.bound_device_id == torch.device("cuda", 0)
