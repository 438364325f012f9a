"""ReplicaCollapse: the rule on each replica's own loss, and the replacement it triggers."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import pytest
import torch
from helpers.distributed import run_distributed
from torch import Tensor, nn

from lightning_parallel.averaging import (
    AveragingSchedule,
    ElasticAverager,
    LossSpike,
    PeriodicAverager,
    ReplicaAveraging,
    ReplicaCollapse,
    build_reduction,
)
from lightning_parallel.averaging.policies import optimizer_state_tensors
from lightning_parallel.comm.ledger import CommLedger

# ---------------------------------------------------------------------------- the rule


def _feed(rule: ReplicaCollapse, rows: Sequence[Sequence[float | None]]) -> list[list[int]]:
    return [rule.observe(row) for row in rows]


def test_a_replica_back_at_the_start_while_another_trains_collapses_after_patience() -> None:
    rule = ReplicaCollapse(smoothing=0.0, drop=0.15, patience=3)
    start = [[2.3, 2.3]] * 3
    both_fall = [[1.5, 1.5], [1.2, 1.4]]
    one_dies = [[2.3, 1.0]] * 4
    fired = _feed(rule, start + both_fall + one_dies)
    assert fired == [[]] * 5 + [[], [], [0], [0]]
    assert rule.healthy() == [1]
    rule.replaced([0])
    assert rule.smoothed[0] == pytest.approx(1.0) and rule.back[0] == 0
    assert rule.collapses == 1
    assert rule.observe([1.0, 1.0]) == []


def test_a_replica_that_never_left_the_plateau_is_not_collapsed() -> None:
    # a replica still on the plateau when the other leaves it is slow, not dead
    rule = ReplicaCollapse(smoothing=0.0, patience=2)
    fired = _feed(rule, [[2.3, 2.3]] * 3 + [[2.3, 1.0]] * 6)
    assert fired == [[]] * 9


def test_no_replica_is_replaced_when_every_one_collapses() -> None:
    # the round's model itself went bad: the rules on the mean answer that
    rule = ReplicaCollapse(smoothing=0.0, patience=2)
    fired = _feed(rule, [[2.3, 2.3]] * 2 + [[1.0, 1.0]] + [[2.3, 2.4]] * 4)
    assert fired == [[]] * 7


def test_a_short_climb_is_not_a_collapse() -> None:
    rule = ReplicaCollapse(smoothing=0.0, patience=3)
    rows = [[2.3, 2.3]] * 2 + [[1.0, 1.0]] + [[2.3, 1.0]] * 2 + [[1.1, 1.0]] + [[2.3, 1.0]] * 2
    assert _feed(rule, rows) == [[]] * 8


def test_an_infinite_loss_collapses_at_once_and_a_nan_is_ignored() -> None:
    rule = ReplicaCollapse(smoothing=0.5, patience=3)
    _feed(rule, [[2.3, 2.3], [1.0, 1.0], [0.5, 0.5]])
    assert rule.observe([math.nan, 0.5]) == []
    assert rule.observe([math.inf, 0.5]) == [0]


def test_a_lost_replica_is_neither_healthy_nor_collapsed() -> None:
    rule = ReplicaCollapse(smoothing=0.0, patience=1)
    _feed(rule, [[2.3, 2.3, 2.3], [1.0, 1.0, 1.0]])
    assert rule.healthy() == [0, 1, 2]
    assert rule.observe([2.3, None, 1.0]) == [0]
    assert rule.healthy() == [2]


def test_the_start_is_frozen_once_a_replica_has_left_it() -> None:
    rule = ReplicaCollapse(smoothing=0.0)
    _feed(rule, [[2.3, 2.2], [2.4, 2.4], [1.0, 2.4], [3.0, 3.0]])
    assert rule.start == pytest.approx(2.4)


def test_its_state_round_trips() -> None:
    rule = ReplicaCollapse(smoothing=0.3, patience=1)
    _feed(rule, [[2.3, 2.3], [1.0, 1.2], [2.3, 1.1]])
    other = ReplicaCollapse(smoothing=0.3, patience=1)
    other.load_state_dict(rule.state_dict())
    assert other.state_dict() == rule.state_dict()
    assert other.observe([2.3, 1.1]) == rule.observe([2.3, 1.1]) == [0]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"smoothing": 1.0}, "smoothing"),
        ({"drop": 0.0}, "drop"),
        ({"patience": 0}, "patience"),
        ({"patience": True}, "patience"),
    ],
)
def test_bad_arguments_fail_at_construction(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ReplicaCollapse(**kwargs)


# ---------------------------------------------------------------------------- replacement


def _batch(rank: int, step: int) -> tuple[Tensor, Tensor]:
    generator = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(8, 4, generator=generator), torch.randn(8, 2, generator=generator)


def _collapsing_loss(rank: int, step: int) -> float:
    """Every replica leaves 2.3 at step 2; the last one is back at 2.3 from step 5 (with
    patience 2 and no smoothing: collapsed at step 6, replaced at the boundary before 7)."""
    if step < 2:
        return 2.3
    return 2.3 if rank == 2 and step >= 5 else 1.0 + 0.01 * rank


def _flat(tensors: list[Tensor]) -> Tensor:
    return torch.cat([tensor.detach().reshape(-1) for tensor in tensors])


@pytest.mark.parametrize("replace", [True, False])
def test_a_collapsed_replica_takes_the_healthy_replicas_mean_and_the_schedule_goes_on(
    replace: bool,
) -> None:
    def run(rank: int, world: int) -> dict[str, object]:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 2))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        ledger = CommLedger()
        engine = ReplicaAveraging(
            model,
            [optimizer],
            PeriodicAverager(),
            AveragingSchedule(16),
            build_reduction("flat"),
            ledger=ledger,
            spike=LossSpike(ratio=2.0),
            collapse=ReplicaCollapse(smoothing=0.0, patience=2) if replace else None,
        )
        engine.broadcast_replicas()
        before: dict[str, Tensor] = {}
        for step in range(8):
            engine.synchronize()
            if step == 7:
                before["params"] = _flat(list(model.parameters()))
                before["momentum"] = _flat(optimizer_state_tensors([optimizer]))
            inputs, targets = _batch(rank, step)
            optimizer.zero_grad()
            nn.functional.mse_loss(model(inputs), targets).backward()
            engine.observe_loss(_collapsing_loss(rank, step))
            optimizer.step()
            engine.count_optimizer_step()
        return {
            **before,
            "rounds": engine.rounds,
            "rollbacks": engine.rollbacks,
            "replaced": ledger.gauges.get("replicas_replaced"),
        }

    results = run_distributed(run, 3)
    healthy_params = (results[0]["params"] + results[1]["params"]) / 2
    healthy_momentum = (results[0]["momentum"] + results[1]["momentum"]) / 2
    for result in results:
        assert result["rounds"] == 0  # no round was due, none was forced
        assert result["rollbacks"] == 0
        assert result["replaced"] == (1 if replace else None)
    # the healthy replicas keep their own; the collapsed one holds their mean (model and
    # momentum) at the boundary before step 7
    assert not torch.allclose(results[0]["params"], results[1]["params"])
    if replace:
        torch.testing.assert_close(results[2]["params"], healthy_params)
        torch.testing.assert_close(results[2]["momentum"], healthy_momentum)
    else:
        assert not torch.allclose(results[2]["params"], healthy_params)


@pytest.mark.parametrize(
    ("options", "regression", "observes"),
    [
        ({}, 1.0, True),  # whole rounds applied at once: its center is the point to go back to
        ({}, None, False),  # spikes only: EASGD trains through them, nothing to answer
        ({"sync_delay": 1}, 1.0, False),  # a round that lands late leaves no center
        ({"fragments": 2}, 1.0, False),  # streaming rounds keep no whole center
        ({"keep_agreement": True}, 1.0, False),  # before_validation="global", quantized
        ({"collapse": ReplicaCollapse()}, None, True),  # the collapse rule watches each replica
    ],
)
def test_elastic_averaging_watches_the_loss_where_a_rule_can_answer(
    options: dict[str, Any], regression: float | None, observes: bool
) -> None:
    def run(rank: int, world: int) -> dict[str, object]:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        engine = ReplicaAveraging(
            model,
            [optimizer],
            ElasticAverager(beta=0.9),
            AveragingSchedule(4),
            build_reduction("flat"),
            ledger=CommLedger(),
            spike=LossSpike(regression=regression),
            **options,
        )
        engine.broadcast_replicas()
        engine.synchronize()
        return {"observes": engine.observes_loss}

    assert [result["observes"] for result in run_distributed(run, 2)] == [observes, observes]
