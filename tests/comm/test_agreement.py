"""Settings that every rank must share: one collective, the same error on every rank."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import torch.distributed as dist
from helpers.distributed import run_distributed
from helpers.spies import recording

from lightning_parallel.comm.agreement import (
    check_same_settings,
    differing_settings,
    digest,
    plain_attributes,
)
from lightning_parallel.compression import CostModel

_VALUE = ("plans", (("fc.weight", (32, 256), "two_bit", 512),), None, 0.5)


def _digest_in_a_new_interpreter(hash_seed: str) -> int:
    code = f"from lightning_parallel.comm.agreement import digest; print(digest({_VALUE!r}))"
    env = dict(os.environ, PYTHONHASHSEED=hash_seed)
    result = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    return int(result.stdout)


def test_the_digest_is_the_same_in_every_process_and_fits_int64() -> None:
    # Python's own hash() of a string changes with PYTHONHASHSEED; the digest must not
    assert _digest_in_a_new_interpreter("1") == _digest_in_a_new_interpreter("2") == digest(_VALUE)
    assert 0 <= digest(_VALUE) < 2**63
    assert digest(_VALUE) != digest((*_VALUE[:3], 0.25))


def test_numbers_count_by_value_and_flags_stay_flags() -> None:
    assert digest(512) == digest(512.0) == digest(np.int64(512)) == digest(np.float64(512))
    assert digest((3, (1, 2))) == digest([3.0, [1.0, 2.0]])
    assert digest(True) != digest(1) and digest(None) != digest(0) and digest("1") != digest(1)
    as_numpy = plain_attributes(CostModel(bandwidth=np.float64(2.0)))
    assert digest(as_numpy) == digest(plain_attributes(CostModel(bandwidth=2)))


def _compare(rank: int, world: int) -> dict[str, object]:
    same = {"a": 1, "b": "x", "c": None}
    with recording(dist, "all_reduce") as reductions:
        agreed = differing_settings(same, None)
    mine = {"a": 1, "b": "x" if rank < 2 else "y", "c": (rank == 1) or None}
    try:
        check_same_settings(mine, None, owner="Test")
        message = "no error"
    except ValueError as error:
        message = str(error)
    return {"agreed": agreed, "reductions": len(reductions), "message": message}


def test_differing_settings_are_named_on_every_rank_after_one_all_reduce() -> None:
    results = run_distributed(_compare, 3, timeout=60)
    for rank, result in enumerate(results):
        assert result["agreed"] == [] and result["reductions"] == 1
        message = result["message"]
        assert isinstance(message, str)
        assert message.startswith("Test: b, c differ across ranks"), message
        assert f"(rank {rank} has b=" in message and "pass the same arguments" in message
    assert "b='y', c=None" in str(results[2]["message"])
    assert "b='x', c=True" in str(results[1]["message"])


def test_plain_attributes_keep_settings_and_leave_state_out() -> None:
    model = CostModel(bandwidth=1e9, margin=2.0)
    model.observe_transfer(1000.0, 0.5)  # state: private, and not a setting
    assert plain_attributes(model) == ("CostModel", (("bandwidth", 1e9), ("margin", 2.0)))
    assert plain_attributes(CostModel(margin=2.0)) != plain_attributes(model)


def _long_plans(rank: int, world: int) -> str:
    try:
        check_same_settings({"plans": tuple(range(rank, 1000))}, None, owner="Test")
    except ValueError as error:
        return str(error)
    return "no error"


def test_a_long_value_is_cut_in_the_message() -> None:
    for message in run_distributed(_long_plans, 2, timeout=60):
        assert "plans differ across ranks" in message
        quoted = message.split("plans=", 1)[1].split(");", 1)[0]
        assert quoted.endswith("...") and len(quoted) == 80
