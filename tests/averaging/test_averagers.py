"""Single-process tests of the averaging algorithms, the schedule, the policies and the packing."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import Tensor

from lightning_parallel.averaging import (
    Averager,
    AveragingSchedule,
    BlockMomentumAverager,
    ElasticAverager,
    FlatLayout,
    OneShotAverager,
    OuterOptimizerAverager,
    PeriodicAverager,
    diloco_outer_optimizer,
    lookahead_outer_optimizer,
)
from lightning_parallel.averaging.policies import (
    optimizer_state_tensors,
    reset_optimizer_state,
    round_buffers,
)

WORLD = 3


def _per_rank(averager: Any, world: int) -> list[Any]:
    """``averager`` and ``world - 1`` shallow copies of it: one per simulated rank."""
    copies = [averager]
    for _ in range(world - 1):
        clone = type(averager).__new__(type(averager))
        clone.__dict__.update(averager.__dict__)
        copies.append(clone)
    return copies


def _replica_rounds(averager: Averager, rounds: int = 4, seed: int = 0) -> list[list[Tensor]]:
    """Simulate ``WORLD`` replicas in one process: drift, average through ``averager``, repeat.

    Returns the replicas after every round (the averager of each replica is a copy, as on M
    ranks, fed the same mean).
    """
    generator = torch.Generator().manual_seed(seed)
    start = [torch.randn(4, 3, generator=generator), torch.randn(3, generator=generator)]
    averagers = _per_rank(averager, WORLD)
    # every simulated rank owns its averager state, as on real ranks
    for copy in averagers:
        copy.reset(start, WORLD)
    replicas = [[t.clone() for t in start] for _ in range(WORLD)]
    history = []
    for _ in range(rounds):
        for replica in replicas:
            for tensor in replica:
                tensor.add_(0.1 * torch.randn(tensor.shape, generator=generator))
        mean = [torch.stack([r[k] for r in replicas]).mean(0) for k in range(len(start))]
        # results are copied, as the round runner copies them into the live parameters
        replicas = [
            [t.clone() for t in copy.update(replica, mean)]
            for copy, replica in zip(averagers, replicas, strict=True)
        ]
        history.append([t.clone() for t in replicas[0]])
    return history


def _assert_histories_close(first: list[list[Tensor]], second: list[list[Tensor]]) -> None:
    for round_a, round_b in zip(first, second, strict=True):
        for a, b in zip(round_a, round_b, strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


def test_periodic_and_one_shot_restart_from_the_mean() -> None:
    local = [torch.tensor([1.0, 2.0])]
    mean = [torch.tensor([3.0, 4.0])]
    assert torch.equal(PeriodicAverager().update(local, mean)[0], mean[0])
    assert torch.equal(OneShotAverager().update(local, mean)[0], mean[0])
    assert PeriodicAverager.averages_during_training
    assert not OneShotAverager.averages_during_training


def test_bmuf_closed_form_two_rounds() -> None:
    eta, zeta = 0.5, 0.8
    bmuf = BlockMomentumAverager(block_momentum=eta, block_learning_rate=zeta, nesterov=True)
    bmuf.reset([torch.zeros(2)], world_size=2)
    first = bmuf.update([torch.zeros(2)], [torch.ones(2)])[0]
    # G = 1, Δ = ζ, x_g = ζ, restart x_g + ηΔ
    assert torch.allclose(bmuf.global_model[0], torch.full((2,), zeta))
    assert torch.allclose(first, torch.full((2,), zeta + eta * zeta))
    second = bmuf.update([torch.zeros(2)], [torch.full((2,), 2.0)])[0]
    # the block's progress counts from where it started (the restart point), not from x_g
    delta = eta * zeta + zeta * (2.0 - (zeta + eta * zeta))
    assert torch.allclose(bmuf.block_momentum_buffer[0], torch.full((2,), delta))
    assert torch.allclose(second, torch.full((2,), zeta + delta + eta * delta))


@pytest.mark.parametrize("nesterov", [False, True])
def test_bmuf_is_sgd_with_momentum_on_the_pseudo_gradient(nesterov: bool) -> None:
    # Classic block momentum is heavy-ball SGD (lr ζ, momentum η) on x_g − x̄, Nesterov block
    # momentum is torch's Nesterov SGD; a look-ahead counted twice would drift away (and, at
    # η = 1 − 1/M with ζ = 1, grow without bound).
    bmuf = BlockMomentumAverager(block_momentum=0.5, block_learning_rate=1.0, nesterov=nesterov)
    outer = OuterOptimizerAverager(
        lambda p: torch.optim.SGD(p, lr=1.0, momentum=0.5, nesterov=nesterov)
    )
    _assert_histories_close(_replica_rounds(bmuf, rounds=6), _replica_rounds(outer, rounds=6))


def test_nesterov_bmuf_stays_bounded_under_constant_progress() -> None:
    # Every round the workers move +1 from where they started; at steady state the restart
    # point moves ζ/(1 − η) = 2 per round (not a growing amount).
    bmuf = BlockMomentumAverager(block_momentum=0.5, block_learning_rate=1.0, nesterov=True)
    bmuf.reset([torch.zeros(1)], world_size=2)
    start = torch.zeros(1)
    moves = []
    for _ in range(30):
        restart = bmuf.update([start + 1.0], [start + 1.0])[0]
        moves.append(float(restart - start))
        start = restart
    assert moves[0] == pytest.approx(1.5)  # (1 + η)·ζ in the first round
    assert moves[-1] == pytest.approx(2.0, abs=1e-6)


def test_bmuf_defaults_and_the_papers_one_minus_one_over_m() -> None:
    bmuf = BlockMomentumAverager()
    bmuf.reset([torch.zeros(1)], world_size=4)
    assert (bmuf.block_momentum, bmuf.block_learning_rate, bmuf.nesterov) == (0.5, 0.5, True)
    paper = BlockMomentumAverager(block_momentum=None, block_learning_rate=1.0)
    paper.reset([torch.zeros(1)], world_size=4)
    assert paper.block_momentum == pytest.approx(0.75)
    assert paper.block_learning_rate == 1.0
    assert BlockMomentumAverager(block_momentum=0.8).block_learning_rate == pytest.approx(0.2)


def test_bmuf_without_momentum_equals_periodic() -> None:
    periodic = _replica_rounds(PeriodicAverager())
    bmuf = _replica_rounds(BlockMomentumAverager(block_momentum=0.0, block_learning_rate=1.0))
    _assert_histories_close(periodic, bmuf)


def test_outer_sgd_lr_one_equals_periodic() -> None:
    periodic = _replica_rounds(PeriodicAverager())
    outer = _replica_rounds(OuterOptimizerAverager(lambda p: torch.optim.SGD(p, lr=1.0)))
    _assert_histories_close(periodic, outer)


def test_diloco_outer_step_closed_form() -> None:
    outer = OuterOptimizerAverager(diloco_outer_optimizer(lr=0.7, momentum=0.9))
    outer.reset([torch.zeros(3)], world_size=2)
    restart = outer.update([torch.zeros(3)], [torch.ones(3)])[0]
    # pseudo-gradient g = 0 - 1 = -1; Nesterov: step = g + 0.9·g; x_g = 0 - 0.7·1.9·g
    assert torch.allclose(restart, torch.full((3,), 0.7 * 1.9))


def test_capped_outer_step_is_no_longer_than_the_workers_mean_moved() -> None:
    # Nesterov SGD lr 0.7, μ 0.9 moves 0.7·1.9 = 1.33 times the pseudo-gradient in the first
    # round; at cap 1 the global model lands on the mean itself (the direction is the same)
    capped = OuterOptimizerAverager(diloco_outer_optimizer(lr=0.7, momentum=0.9), step_cap=1.0)
    capped.reset([torch.zeros(3)], world_size=2)
    restart = capped.update([torch.zeros(3)], [torch.ones(3)])[0]
    torch.testing.assert_close(restart, torch.ones(3))
    assert capped.capped_rounds == 1
    # at cap 1.2 the step is 1.2·‖g‖
    looser = OuterOptimizerAverager(diloco_outer_optimizer(lr=0.7, momentum=0.9), step_cap=1.2)
    looser.reset([torch.zeros(3)], world_size=2)
    torch.testing.assert_close(
        looser.update([torch.zeros(3)], [torch.ones(3)])[0], torch.full((3,), 1.2)
    )


@pytest.mark.parametrize("foreach", [False, True])
def test_the_cap_keeps_the_direction_and_leaves_the_momentum_as_it_was(foreach: bool) -> None:
    # the second round's pseudo-gradient turns 90 degrees: the momentum bends the step, and
    # the capped step has the uncapped one's direction at the length of the pseudo-gradient;
    # torch's foreach Nesterov SGD (its default on CUDA) writes g + μ·buf into .grad, which
    # must not become the cap's g
    def nesterov(params: list[Tensor]) -> torch.optim.Optimizer:
        return torch.optim.SGD(params, lr=0.7, momentum=0.5, nesterov=True, foreach=foreach)

    rounds = [torch.tensor([1.0, 0.0]), torch.tensor([0.0, 1.0])]
    free = OuterOptimizerAverager(nesterov)
    capped = OuterOptimizerAverager(nesterov, step_cap=1.0)
    for averager in (free, capped):
        averager.reset([torch.zeros(2)], world_size=2)
    free_start = capped_start = torch.zeros(2)
    for progress in rounds:
        free_end = free.update([free_start], [free_start + progress])[0]
        capped_end = capped.update([capped_start], [capped_start + progress])[0]
        free_step, capped_step = free_end - free_start, capped_end - capped_start
        assert float(capped_step.norm()) == pytest.approx(float(progress.norm()))
        cosine = torch.dot(free_step, capped_step) / (free_step.norm() * capped_step.norm())
        assert float(cosine) == pytest.approx(1.0)
        free_start, capped_start = free_end, capped_end
    assert capped.capped_rounds == 2
    assert capped.gauges() == {"outer_steps_capped": 2.0} and free.gauges() == {}
    free_buffer = free.optimizer.state[free.global_model[0]]["momentum_buffer"]
    capped_buffer = capped.optimizer.state[capped.global_model[0]]["momentum_buffer"]
    assert torch.equal(free_buffer, capped_buffer)  # both the pseudo-gradients' sum, as torch's


def test_a_cap_that_does_not_bind_changes_nothing() -> None:
    # plain averaging (lr 1) moves exactly the cap; Lookahead less: neither is touched
    periodic = _replica_rounds(PeriodicAverager())
    at_cap = OuterOptimizerAverager(lambda p: torch.optim.SGD(p, lr=1.0), step_cap=1.0)
    for round_a, round_b in zip(periodic, _replica_rounds(at_cap), strict=True):
        for a, b in zip(round_a, round_b, strict=True):
            assert torch.equal(a, b)
    assert at_cap.capped_rounds == 0
    free = _replica_rounds(OuterOptimizerAverager(lookahead_outer_optimizer(alpha=0.5)))
    capped = _replica_rounds(
        OuterOptimizerAverager(lookahead_outer_optimizer(alpha=0.5), step_cap=1.0)
    )
    _assert_histories_close(free, capped)


@pytest.mark.parametrize("cap", [0.0, -1.0, True])
def test_a_cap_that_is_not_positive_is_refused(cap: float) -> None:
    with pytest.raises(ValueError, match="step_cap must be a positive number"):
        OuterOptimizerAverager(diloco_outer_optimizer(), step_cap=cap)


def test_lookahead_moves_alpha_of_the_way() -> None:
    outer = OuterOptimizerAverager(lookahead_outer_optimizer(alpha=0.25))
    outer.reset([torch.zeros(2)], world_size=1)
    assert torch.allclose(outer.update([torch.ones(2)], [torch.ones(2)])[0], torch.full((2,), 0.25))


def test_easgd_closed_form_and_center() -> None:
    easgd = ElasticAverager(alpha=0.2, beta=0.6, center_first=False)  # the paper's update
    easgd.reset([torch.zeros(1)], world_size=3)
    restart = easgd.update([torch.full((1,), 2.0)], [torch.full((1,), 1.0)])[0]
    assert torch.allclose(restart, torch.tensor([2.0 - 0.2 * 2.0]))
    assert torch.allclose(easgd.center[0], torch.tensor([0.6]))
    center_first = ElasticAverager(alpha=0.2, beta=0.6)  # the default: the center moves first
    center_first.reset([torch.zeros(1)], world_size=3)
    restart = center_first.update([torch.full((1,), 2.0)], [torch.full((1,), 1.0)])[0]
    assert torch.allclose(center_first.center[0], torch.tensor([0.6]))
    assert torch.allclose(restart, torch.tensor([2.0 - 0.2 * (2.0 - 0.6)]))


def _steady_progress(averager: Averager, world: int, rounds: int = 200) -> float:
    """Per-round advance of the replicas' mean when every worker moves +1 in every round.

    Each worker ``i`` keeps its own offset (the replicas of EASGD never agree), so the workers
    are simulated one averager copy each, as on ``world`` ranks.
    """
    copies = _per_rank(averager, world)
    for copy in copies:
        copy.reset([torch.zeros(1, dtype=torch.float64)], world)
    replicas = [torch.full((1,), float(i), dtype=torch.float64) for i in range(world)]
    means = []
    for _ in range(rounds):
        replicas = [replica + 1.0 for replica in replicas]
        mean = [torch.stack(replicas).mean(0)]
        replicas = [
            copy.update([replica], mean)[0].clone()
            for copy, replica in zip(copies, replicas, strict=True)
        ]
        means.append(float(torch.stack(replicas).mean()))
    return means[-1] - means[-2]


def test_easgd_default_keeps_the_progress_of_each_round() -> None:
    # At β = 0.9, α = β/2, moving the center first keeps 1 − α(1 − β)/(1 − (1 − α)(1 − β))
    # (95%) of the workers' progress per round; the paper's simultaneous update only
    # β/(α + β) (2/3), which is why the registered easgd trained a third slower.
    alpha, beta = 0.45, 0.9
    kept = 1 - alpha * (1 - beta) / (1 - (1 - alpha) * (1 - beta))
    assert _steady_progress(ElasticAverager(), world=2) == pytest.approx(kept)
    assert kept > 0.95
    simultaneous = _steady_progress(ElasticAverager(center_first=False), world=2)
    assert simultaneous == pytest.approx(beta / (alpha + beta))


def test_default_bmuf_and_diloco_keep_the_step_near_the_workers_progress() -> None:
    # With constant progress per round the restart point moves ζ/(1 − η) (BMUF) or
    # lr/(1 − μ) (outer Nesterov SGD) times as far: the defaults keep that near 1, where the
    # papers' values (η = 1 − 1/M with ζ = 1; lr 0.7 with μ = 0.9) give M and 7.
    assert _steady_progress(BlockMomentumAverager(), world=2) == pytest.approx(1.0)
    assert _steady_progress(
        OuterOptimizerAverager(diloco_outer_optimizer()), world=2
    ) == pytest.approx(1.4)
    paper = OuterOptimizerAverager(diloco_outer_optimizer(lr=0.7, momentum=0.9))
    assert _steady_progress(paper, world=2) == pytest.approx(7.0)
    paper_bmuf = BlockMomentumAverager(block_momentum=None, block_learning_rate=1.0)
    assert _steady_progress(paper_bmuf, world=4) == pytest.approx(4.0)


def test_easgd_alpha_one_over_m_makes_the_center_the_periodic_mean() -> None:
    generator = torch.Generator().manual_seed(5)
    easgd = ElasticAverager(alpha=1.0 / WORLD, beta=1.0)  # the paper's beta = M·alpha
    easgd.reset([torch.zeros(5)], WORLD)
    for _ in range(3):
        mean = [torch.randn(5, generator=generator)]
        easgd.update([torch.randn(5, generator=generator)], mean)
        assert torch.equal(easgd.center[0], mean[0])


def test_easgd_center_first_alpha_beta_one_equals_periodic() -> None:
    periodic = _replica_rounds(PeriodicAverager())
    easgd = _replica_rounds(ElasticAverager(alpha=1.0, beta=1.0, center_first=True))
    for round_a, round_b in zip(periodic, easgd, strict=True):
        for a, b in zip(round_a, round_b, strict=True):
            assert torch.equal(a, b)


# averagers with state (a global model, momentum, a center, an outer optimizer), built fresh
STATEFUL = [
    lambda: BlockMomentumAverager(block_momentum=0.6, nesterov=True),
    lambda: ElasticAverager(beta=0.9),
    lambda: OuterOptimizerAverager(diloco_outer_optimizer()),
    lambda: OuterOptimizerAverager(lambda p: torch.optim.Adam(p, lr=0.1)),
]
# the cap adds no state, but a resumed run must cap its steps as the uninterrupted one did
CAPPED = [lambda: OuterOptimizerAverager(diloco_outer_optimizer(), step_cap=1.0)]


@pytest.mark.parametrize("make", STATEFUL + CAPPED)
def test_state_dict_round_trip_continues_exactly(make) -> None:  # type: ignore[no-untyped-def]
    generator = torch.Generator().manual_seed(1)
    inputs = [
        ([torch.randn(4, generator=generator)], [torch.randn(4, generator=generator)])
        for _ in range(4)
    ]
    reference = make()
    reference.reset([torch.zeros(4)], 2)
    outputs = [reference.update(local, mean)[0] for local, mean in inputs]
    resumed = make()
    resumed.reset([torch.zeros(4)], 2)
    for local, mean in inputs[:2]:
        resumed.update(local, mean)
    state = resumed.state_dict()
    fresh = make()
    fresh.load_state_dict(state)
    assert fresh.started
    for (local, mean), expected in zip(inputs[2:], outputs[2:], strict=True):
        assert torch.equal(fresh.update(local, mean)[0], expected)


def test_bad_hyperparameters_raise_naming_the_fix() -> None:
    with pytest.raises(ValueError, match="block_momentum"):
        BlockMomentumAverager(block_momentum=1.0)
    with pytest.raises(ValueError, match="block_learning_rate"):
        BlockMomentumAverager(block_learning_rate=0.0)
    with pytest.raises(ValueError, match="beta"):
        ElasticAverager(beta=0.0)
    with pytest.raises(ValueError, match="alpha"):
        ElasticAverager(alpha=2.0)
    with pytest.raises(TypeError, match=r"torch\.optim"):
        OuterOptimizerAverager(0.7)  # type: ignore[arg-type]
    outer = OuterOptimizerAverager(lambda p: p)  # type: ignore[arg-type,return-value]
    with pytest.raises(TypeError, match="Optimizer"):
        outer.reset([torch.zeros(1)], 1)


def test_schedule_rounds_after_warmup_every_period() -> None:
    schedule = AveragingSchedule(period=3, warmup_steps=2)
    ends = []
    warmups = []
    for _ in range(11):
        warmups.append(schedule.in_warmup)
        ends.append(schedule.count_step())
        if ends[-1]:
            schedule.mark_round()  # what the round runner does when it starts the round
    assert warmups == [True, True] + [False] * 9
    assert [step for step, end in enumerate(ends, start=1) if end] == [5, 8, 11]
    never = AveragingSchedule(period=None)
    assert not any(never.count_step() for _ in range(10))
    resumed = AveragingSchedule(period=3, warmup_steps=2)
    resumed.load_state_dict({"optimizer_steps": 4, "rounds": 0, "last_round_step": 0})
    assert resumed.count_step()  # step 5 ends a round after resume too


def test_an_extra_round_moves_the_phase() -> None:
    schedule = AveragingSchedule(period=4, warmup_steps=1)
    for _ in range(3):
        assert not schedule.count_step()
    assert schedule.local_steps == 2
    schedule.mark_round()  # e.g. before a validation after step 3
    assert schedule.local_steps == 0
    ends = []
    for step in range(4, 16):
        if schedule.count_step():
            ends.append(step)
            schedule.mark_round()
    assert ends == [7, 11, 15]
    assert schedule.rounds == 4


@pytest.mark.parametrize("period", [0, -1, 1.5, True])
def test_schedule_rejects_bad_period(period: object) -> None:
    with pytest.raises(ValueError, match="period must be a positive integer"):
        AveragingSchedule(period=period)  # type: ignore[arg-type]


def test_flat_layout_round_trip_mixed_dtypes() -> None:
    tensors = [
        torch.randn(2, 3),
        torch.arange(4, dtype=torch.float64),
        torch.randn(5),
        torch.ones(1, 1, dtype=torch.float64),
    ]
    layout = FlatLayout(tensors)
    flat = layout.pack(tensors)
    assert [buffer.dtype for buffer in flat] == [torch.float32, torch.float64]
    assert layout.nbytes(flat) == 4 * (6 + 5) + 8 * (4 + 1)
    for original, unpacked in zip(tensors, layout.unpack(flat), strict=True):
        assert torch.equal(original, unpacked)
        assert original.dtype == unpacked.dtype


def test_policies_pick_floating_buffers_and_state() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.BatchNorm1d(3))
    assert len(round_buffers(model, "average")) == 2  # running mean and var, not the counter
    assert round_buffers(model, "local") == []
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.randn(4, 3)).sum().backward()
    optimizer.step()
    tensors = optimizer_state_tensors([optimizer])
    assert len(tensors) == 2 * 4  # exp_avg and exp_avg_sq of 4 parameters, no step scalar
    reset_optimizer_state([optimizer])
    assert not optimizer.state


@pytest.mark.parametrize("make", STATEFUL)
def test_state_loaded_onto_the_cpu_moves_to_the_models_device(make) -> None:  # type: ignore[no-untyped-def]
    """A checkpoint is loaded onto the CPU while the model may live on a GPU: ``to`` moves the
    state there. ``meta`` stands for the other device: mixing it with the CPU raises as CUDA
    does."""
    saved = make()
    saved.reset([torch.zeros(4)], 2)
    saved.update([torch.ones(4)], [torch.full((4,), 0.5)])
    meta = [torch.ones(4, device="meta")]
    stale = make()
    stale.load_state_dict(saved.state_dict())
    with pytest.raises(RuntimeError, match="device"):
        stale.update(meta, meta)
    moved = make()
    moved.load_state_dict(saved.state_dict())
    moved.to(torch.device("meta"))
    assert moved.update(meta, meta)[0].device.type == "meta"
    if isinstance(moved, OuterOptimizerAverager):  # the optimizer state followed its tensors
        assert moved.optimizer is not None
        for state in moved.optimizer.state.values():
            assert all(v.device.type == "meta" for k, v in state.items() if k != "step")
