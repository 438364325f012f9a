"""``lightning_parallel.comm.groups.new_group`` steps around torch's split of a device-bound
default group where it would fail (gloo) or hang (another backend, members only): checked on
stand-ins for torch's group objects, since a CPU-only torch cannot bind a group to a device."""

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
    ("splits", "has_nocolor_split", "backend", "members_only", "unbound"),
    [
        # gloo on a CUDA device: torch would call a method gloo lacks
        (True, False, None, False, True),
        # NCCL, a group of its own backend: the split works, the binding stays
        (True, True, None, False, False),
        (True, True, "nccl", False, False),
        # NCCL, a gloo side group: non-members would split NCCL's communicator alone
        (True, True, "gloo", False, True),
        # NCCL, only the members call: the others cannot join a split
        (True, True, None, True, True),
        # a backend that does not split: nothing to step around
        (False, False, "gloo", True, False),
    ],
)
def test_new_group_unbinds_only_where_torch_split_would_fail_or_hang(
    monkeypatch: pytest.MonkeyPatch,
    splits: bool,
    has_nocolor_split: bool,
    backend: str | None,
    members_only: bool,
    unbound: bool,
) -> None:
    default = _DefaultGroup(_Backend(splits, has_nocolor_split))
    seen: list[Any] = []

    def fake_new_group(**kwargs: Any) -> str:
        seen.append((default.bound_device_id, kwargs["ranks"], kwargs["backend"]))
        return "group"

    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
    monkeypatch.setattr(dist.distributed_c10d, "_get_default_group", lambda: default)
    monkeypatch.setattr(dist, "new_group", fake_new_group)
    assert groups.new_group([1, 0], backend=backend, members_only=members_only) == "group"
    expected = None if unbound else torch.device("cuda", 0)
    assert seen == [(expected, [0, 1], backend)]
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
