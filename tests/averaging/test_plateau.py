"""The plateau rule on synthetic loss sequences (one process), and its synchronous window over
2 gloo processes: the window's steps are counted, the replicas agree through it, and a resume
continues exactly."""

from __future__ import annotations

import io
import math

import pytest
import torch
from helpers.distributed import run_distributed
from torch import Tensor, nn

from lightning_parallel.averaging import (
    AveragingSchedule,
    LossSpike,
    OuterOptimizerAverager,
    PeriodicAverager,
    PlateauExit,
    ReplicaAveraging,
    build_reduction,
    diloco_outer_optimizer,
)
from lightning_parallel.comm.ledger import CommLedger

# ---------------------------------------------------------------------------- the rule


def _fires_at(rule: PlateauExit, losses: list[float]) -> int | None:
    for step, loss in enumerate(losses, start=1):
        if rule.observe(loss):
            return step
    return None


def test_a_flat_noisy_plateau_never_fires() -> None:
    generator = torch.Generator().manual_seed(0)
    noise = (torch.rand(500, generator=generator) - 0.5) * 0.02  # ±0.01, as 2 ranks of 32
    losses = [2.3026 + float(value) for value in noise]
    assert _fires_at(PlateauExit(), losses) is None


def test_it_fires_once_when_the_smoothed_loss_falls_by_drop() -> None:
    plateau = [2.30] * 30
    descent = [2.30 - 0.02 * step for step in range(1, 40)]  # 2.28, 2.26, ...
    rule = PlateauExit(drop=0.05, smoothing=0.7)
    fired = _fires_at(rule, plateau + descent)
    assert fired is not None and fired > 30
    # the first step whose smoothed loss L_t = 0.7 L_{t-1} + 0.3 l_t is at most 0.95 · 2.30
    smoothed, expected = 2.30, None
    for step, loss in enumerate(descent, start=31):
        smoothed = 0.7 * smoothed + 0.3 * loss
        if smoothed <= 0.95 * 2.30:
            expected = step
            break
    assert fired == expected
    assert rule.fired_at == fired
    assert not rule.observe(0.1)  # once only


def test_the_plateau_level_is_the_highest_smoothed_loss() -> None:
    # a loss that rises first (as a network's does in its first steps) is measured from its top
    rising = [2.0, 2.2, 2.4, 2.4, 2.4, 2.4]
    rule = PlateauExit(drop=0.1, smoothing=0.0)
    assert _fires_at(rule, [*rising, 2.17]) is None  # 2.17 > 0.9 · 2.4 = 2.16
    assert rule.observe(2.15)


def test_non_finite_losses_are_ignored() -> None:
    rule = PlateauExit(drop=0.05, smoothing=0.0)
    assert not rule.observe(2.3)
    assert not rule.observe(math.nan)
    assert not rule.observe(math.inf)
    assert rule.observed == 1
    assert rule.observe(2.0)


def test_its_state_round_trips() -> None:
    losses = [2.3, 2.31, 2.29, 2.25, 2.2, 2.1, 2.0]
    whole = PlateauExit(drop=0.05)
    fired = _fires_at(whole, losses)
    first = PlateauExit(drop=0.05)
    assert _fires_at(first, losses[:4]) is None
    second = PlateauExit(drop=0.05)
    second.load_state_dict(first.state_dict())
    rest = _fires_at(second, losses[4:])
    assert rest is not None and fired == rest + 4 and second.state_dict() == whole.state_dict()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [({"drop": 0.0}, "drop"), ({"drop": 1.0}, "drop"), ({"smoothing": 1.0}, "smoothing")],
)
def test_bad_arguments_fail_at_construction(kwargs: dict[str, float], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        PlateauExit(**kwargs)


def test_a_window_needs_a_positive_length() -> None:
    schedule = AveragingSchedule(4)
    with pytest.raises(ValueError, match="positive"):
        schedule.open_synchronous_window(0)
    schedule.count_step()
    schedule.open_synchronous_window(3)
    assert schedule.in_warmup
    assert [schedule.count_step() for _ in range(3 + 4)] == [False] * 6 + [True]
    assert schedule.synchronous_steps == 3


# ---------------------------------------------------------------------------- the window


def _losses(rank: int, step: int) -> float:
    """A plateau at 2.3 for 6 steps, then a fall: the rule (drop 0.05, smoothing 0) fires at
    step 8's loss (2.3 · 0.95 = 2.185 > 2.18)."""
    if step == 15:
        return 10.0  # a spike, for the runs with a spike rule
    return 2.3 + 0.001 * rank if step < 6 else 2.3 - 0.06 * (step - 5)


def _batch(rank: int, step: int) -> tuple[Tensor, Tensor]:
    generator = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(8, 4, generator=generator), torch.randn(8, 2, generator=generator)


def _setup(
    make: object, window: int | None, seed: int = 0, spike: bool = False
) -> tuple[nn.Module, torch.optim.Optimizer, ReplicaAveraging]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    engine = ReplicaAveraging(
        model,
        [optimizer],
        make(),  # type: ignore[operator]
        AveragingSchedule(3),
        build_reduction("flat"),
        ledger=CommLedger(),
        plateau=None if window is None else PlateauExit(drop=0.05, smoothing=0.0),
        window_steps=window or 0,
        spike=LossSpike(ratio=2.0) if spike else None,
    )
    return model, optimizer, engine


def _train(
    engine: ReplicaAveraging,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    rank: int,
    steps: range,
    trace: list[tuple[int, bool, bool]] | None = None,
) -> None:
    for step in steps:
        engine.synchronize()
        synchronous = engine.in_warmup
        inputs, targets = _batch(rank, step)
        optimizer.zero_grad()
        nn.functional.mse_loss(model(inputs), targets).backward()
        if synchronous:
            engine.average_gradients()
        else:
            engine.observe_loss(_losses(rank, step))
        optimizer.step()
        engine.count_optimizer_step()
        if trace is not None:
            flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
            gathered = [torch.zeros_like(flat) for _ in range(2)]
            torch.distributed.all_gather(gathered, flat)
            trace.append((step, synchronous, torch.equal(gathered[0], gathered[1])))


def test_the_window_runs_its_synchronous_steps_then_local_training_resumes() -> None:
    def run(rank: int, world: int) -> dict[str, object]:
        model, optimizer, engine = _setup(PeriodicAverager, window=4)
        engine.broadcast_replicas()
        trace: list[tuple[int, bool, bool]] = []
        _train(engine, model, optimizer, rank, range(20), trace)
        synchronous = [step for step, sync, _ in trace if sync]
        return {
            "synchronous": synchronous,
            "agree_in_window": all(same for _, sync, same in trace if sync),
            "differ_after": not trace[-1][2] or engine.schedule.local_steps == 0,
            "counted": engine.schedule.synchronous_steps,
            "fired_at": engine.plateau.fired_at if engine.plateau else None,
            "rounds": engine.rounds,
        }

    results = run_distributed(run, 2)
    for result in results:
        # steps 0..7 are local (rounds after steps 2 and 5); the rule fires at step 7's loss
        # (0-based; its 8th observation), so steps 8..11 are synchronous, then rounds every 3
        assert result["fired_at"] == 8
        assert result["synchronous"] == [8, 9, 10, 11]
        assert result["counted"] == 4
        assert result["agree_in_window"]
        assert result["rounds"] == 2 + 2  # 2 before the window, after steps 14 and 17
    assert results[0]["synchronous"] == results[1]["synchronous"]


def test_window_zero_reproduces_the_former_behaviour() -> None:
    def run(rank: int, world: int) -> bool:
        model, optimizer, engine = _setup(PeriodicAverager, window=None)
        engine.broadcast_replicas()
        _train(engine, model, optimizer, rank, range(12))
        engine.finish()
        before = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        plain, plain_optimizer, engine = _watched_replicas(spike=False)
        _train(engine, plain, plain_optimizer, rank, range(12))
        engine.finish()
        after = torch.cat([p.detach().reshape(-1) for p in plain.parameters()])
        return torch.equal(before, after) and engine.schedule.synchronous_steps == 0

    assert all(run_distributed(run, 2))


@pytest.mark.parametrize("stop", [7, 8, 10, 13, 16])
def test_a_resume_before_during_or_after_the_window_continues_exactly(stop: int) -> None:
    # the window opens at step 8 and ends after step 11; step 15's loss spikes, so step 16
    # starts from the round of step 14 (stop 16: the checkpoint follows the roll-back)
    configurations = {
        "periodic": PeriodicAverager,
        "diloco": lambda: OuterOptimizerAverager(diloco_outer_optimizer()),
    }

    def run(rank: int, world: int) -> dict[str, bool]:
        results = {}
        for name, make in configurations.items():
            model, optimizer, engine = _setup(make, window=4, spike=True)
            engine.broadcast_replicas()
            _train(engine, model, optimizer, rank, range(18))
            engine.finish()
            uninterrupted = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
            model, optimizer, engine = _setup(make, window=4, spike=True)
            engine.broadcast_replicas()
            _train(engine, model, optimizer, rank, range(stop))
            engine.synchronize()  # what a checkpoint does first
            buffer = io.BytesIO()
            torch.save({"shared": engine.state_dict(), "local": engine.local_state_dict()}, buffer)
            buffer.seek(0)
            saved = torch.load(buffer, weights_only=False)
            model, optimizer, engine = _setup(make, window=4, seed=123, spike=True)
            engine.load_state_dict(saved["shared"])
            engine.load_local_state_dict(saved["local"])
            _train(engine, model, optimizer, rank, range(stop, 18))
            engine.finish()
            resumed = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
            results[name] = torch.equal(resumed, uninterrupted)
            results[f"{name}-counted"] = engine.schedule.synchronous_steps == 4
            results[f"{name}-rolled-back-once"] = engine.rollbacks == 1
        return results

    for results in run_distributed(run, 2):
        failed = [name for name, ok in results.items() if not ok]
        assert not failed, failed


# ---------------------------------------------------------------------------- loss spikes


def test_a_spike_is_measured_against_the_healthy_level() -> None:
    # the spike alone (a bump this large right after the fall is also a regression)
    rule = LossSpike(ratio=2.0, smoothing=0.5, regression=None)
    healthy = [2.3, 2.2, 2.0, 1.8, 1.6]
    assert not any(rule.observe(loss) for loss in healthy)
    level = rule.smoothed
    assert level is not None
    assert not rule.observe(2.0 * level - 1e-6)  # DDP's own bumps (x1.8 on vgg_mini) pass
    level = rule.smoothed
    assert level is not None
    assert rule.observe(2.0 * level + 1e-6)
    assert rule.smoothed == level  # a spike does not move the level
    assert rule.observe(math.inf)
    assert not rule.observe(math.nan)  # no loss reported
    assert rule.spikes == 2


def test_after_a_restart_the_level_restarts_at_the_next_loss() -> None:
    rule = LossSpike(ratio=2.0, smoothing=0.5, regression=None)  # the spikes alone
    for loss in (2.3, 2.0, 1.8, 1.6):
        assert not rule.observe(loss)
    assert rule.observe(6.0)
    rule.restart()
    # the point gone back to is itself bad: its losses are the new level, not spikes
    assert not rule.observe(5.0)
    assert rule.smoothed == 5.0
    assert not any(rule.observe(loss) for loss in (5.5, 4.8, 5.9))
    assert rule.observe(25.0)  # twice the new level is a spike again
    assert rule.spikes == 2
    saved = rule.state_dict()
    rule.restart()
    resumed = LossSpike(ratio=2.0, smoothing=0.5, regression=None)
    resumed.load_state_dict(rule.state_dict())
    assert resumed.rebase and not LossSpike().rebase
    assert saved["rebase"] is False


def test_late_noise_below_the_starting_level_is_no_spike() -> None:
    rule = LossSpike(ratio=2.0, smoothing=0.5)
    falling = [2.3, 1.5, 0.8, 0.4, 0.2, 0.1, 0.1, 0.1]
    assert not any(rule.observe(loss) for loss in falling)
    assert rule.highest == 2.3
    assert not rule.observe(1.0)  # ten times the recent level, but better than at the start
    assert rule.observe(2.4)


# vgg_mini, bmuf, seed 2: the mean loss leaves the plateau, climbs back over three steps (none
# of them twice the smoothed level) and stays at ln 10 for 40 steps
_SLOW_DEATH = [2.303, 2.301, 2.299, 2.295, 2.285, 2.252, 2.152, 2.027, 1.906, 1.713, 1.562]
_CLIMB = [2.692, 3.496, 2.780, 2.255, 2.261, 2.247, 2.278]
# vgg_mini, model_averaging, seed 2: one step back at the start, then 2.1-2.25 and a recovery
_BUMP = [2.303, 2.30, 2.29, 2.25, 2.20, 2.16, 2.07, 2.00, 1.99, 1.61, 1.66, 2.08, 3.28, 2.09]
_BUMP += [2.25, 2.07, 2.12, 2.23, 2.25, 2.23, 2.22, 2.17, 2.10, 1.99, 1.84, 1.58, 1.45, 1.21]


def test_a_climb_back_to_the_starting_loss_that_stays_is_a_regression() -> None:
    rule = LossSpike(ratio=2.0)
    assert not any(rule.observe(loss) for loss in _SLOW_DEATH)
    assert rule.armed and not rule.unsettled
    fired = [rule.observe(loss) for loss in _CLIMB]
    # the smoothed loss is back at the start (2.303) from 3.50 on; the third step there fires
    assert fired == [False, False, False, True, False, False, False]
    assert (rule.spikes, rule.regressions) == (0, 1)


def test_the_loss_is_unsettled_from_half_way_back() -> None:
    rule = LossSpike(ratio=2.0)
    for loss in _SLOW_DEATH:
        rule.observe(loss)
    rule.observe(_CLIMB[0])  # the smoothed loss 2.09: more than half-way back from 1.83
    assert rule.unsettled
    assert not LossSpike(regression=None).unsettled


def test_one_step_back_at_the_start_is_no_regression() -> None:
    rule = LossSpike(ratio=2.0)
    assert not any(rule.observe(loss) for loss in _BUMP)
    assert (rule.spikes, rule.regressions) == (0, 0)
    assert rule.observe(2.303) is False and not rule.unsettled


# vgg_mini, diloco, seed 4 (the mean loss of its first 49 steps, then two at ddp's level after
# its bump): the loss leaves the plateau and bumps (2.70, 3.53) where ddp's own run bumps (2.97)
# and trains on; the bump's echo kept the smoothed loss above the start for 3 steps while the
# step's own loss was back at 2.03, and the former rule rolled back at step 49 (0.900 at the
# end, streaming DiLoCo 0.797; ddp 0.967)
_ECHO = [2.302, 2.303, 2.302, 2.304, 2.303, 2.302, 2.305, 2.303, 2.304, 2.295, 2.303, 2.303]
_ECHO += [2.303, 2.297, 2.293, 2.298, 2.294, 2.298, 2.293, 2.303, 2.298, 2.299, 2.292, 2.284]
_ECHO += [2.28, 2.281, 2.284, 2.281, 2.277, 2.277, 2.271, 2.277, 2.245, 2.26, 2.241, 2.233]
_ECHO += [2.213, 2.212, 2.143, 2.135, 2.042, 1.97, 1.993, 1.506, 1.608, 2.698, 3.533, 2.032]
_ECHO += [2.252, 2.1, 2.0]


def test_a_bump_s_echo_in_the_smoothed_loss_is_no_regression() -> None:
    rule = LossSpike(ratio=2.0)
    above: list[bool] = []
    for loss in _ECHO:
        assert not rule.observe(loss)
        assert rule.smoothed is not None and rule.start is not None
        above.append(rule.smoothed >= rule.start)
    assert rule.armed and (rule.spikes, rule.regressions) == (0, 0)
    # the smoothed loss alone was back at the start for the three steps after the bump (the
    # former rule's regression); the steps' own losses were not
    assert above[-6:] == [False, True, True, True, False, False]


def test_a_dead_loss_just_below_the_start_is_a_regression() -> None:
    # a dead network's loss sits at ln 10 give or take the batch's noise, often a little below
    # the plateau's highest smoothed value (2.303): inside the band it is back at the start
    dead = [2.27, 2.26, 2.28, 2.27, 2.25, 2.27, 2.28, 2.26, 2.27, 2.28, 2.26, 2.27]
    rule = LossSpike(ratio=2.0)
    assert not any(rule.observe(loss) for loss in _SLOW_DEATH)
    fired = [rule.observe(loss) for loss in dead]
    assert sum(fired) == 1 and rule.regressions == 1
    # the smoothed loss alone never reaches the start there: no band, no regression
    exact = LossSpike(ratio=2.0, band=0.0)
    assert not any(exact.observe(loss) for loss in _SLOW_DEATH + dead * 3)


def test_without_the_regression_the_slow_death_goes_unnoticed() -> None:
    rule = LossSpike(ratio=2.0, regression=None)
    assert not any(rule.observe(loss) for loss in _SLOW_DEATH + _CLIMB + [2.30] * 40)
    assert (rule.spikes, rule.regressions) == (0, 0)


def test_a_regression_fires_again_only_after_the_loss_has_fallen_again() -> None:
    rule = LossSpike(ratio=2.0)
    for loss in _SLOW_DEATH:
        rule.observe(loss)
    fired = [rule.observe(loss) for loss in _CLIMB + [2.30] * 40]
    assert sum(fired) == 1  # rolled back to a point on the plateau: no roll-back every step
    for loss in [1.8, 1.6, 1.5, 1.5, 1.5, 1.5]:  # the loss leaves the plateau again
        assert not rule.observe(loss)
    assert rule.armed
    assert any(rule.observe(loss) for loss in [2.6] * 8)
    assert rule.regressions == 2


def test_late_noise_far_below_the_start_is_no_regression() -> None:
    rule = LossSpike(ratio=2.0)
    losses = [2.30] * 5 + [2.0, 1.6, 1.2, 0.8, 0.5, 0.4, 0.3, 1.0, 1.2, 0.9, 0.3, 0.2]
    assert not any(rule.observe(loss) for loss in losses)
    assert (rule.spikes, rule.regressions) == (0, 0)


def test_an_armed_regression_leaves_the_spikes_as_the_spike_only_rule_has_them() -> None:
    # armed at 1.81, the smoothed loss climbs to 2.59, above the start (2.30), for one step
    # (no regression: it needs 3), falls to 1.13, then a step of 2.5: more than twice 1.13 and
    # than the start, but below the highest smoothed loss so far, 2.59, which the spike-only
    # rule measures against; one level for both rules (frozen at 2.30 once armed) made it a
    # spike, as a step like it rolled back bmuf seed 4 (0.903 -> 0.811)
    losses = [2.30] * 5 + [2.0, 1.6, 1.3, 1.2, 1.2, 2.3, 3.4, 3.4]
    losses += [1.4, 1.0, 0.9, 0.9, 0.9, 0.9, 2.5]
    spike_only = LossSpike(ratio=2.0, regression=None)
    rule = LossSpike(ratio=2.0)
    expected = [spike_only.observe(loss) for loss in losses]
    assert [rule.observe(loss) for loss in losses] == expected == [False] * len(losses)
    assert rule.armed and (rule.spikes, rule.regressions) == (0, 0)
    assert rule.start == 2.30 and rule.highest == spike_only.highest
    assert rule.highest is not None and rule.highest > 2.5
    for loss in [4.0, math.inf]:  # above both levels and twice the smoothed loss: spikes
        assert rule.observe(loss) and spike_only.observe(loss)
    assert rule.spikes == spike_only.spikes == 2


def test_the_regression_state_round_trips() -> None:
    rule = LossSpike()
    for loss in _SLOW_DEATH + _CLIMB[:2]:
        rule.observe(loss)
    copy = LossSpike()
    copy.load_state_dict(rule.state_dict())
    assert copy.state_dict() == rule.state_dict()
    rest = _CLIMB[2:] + [1.5] * 9 + [2.6] * 6
    assert [copy.observe(x) for x in rest] == [rule.observe(x) for x in rest]


def test_the_spike_rule_refuses_a_ratio_of_one_or_less() -> None:
    with pytest.raises(ValueError, match="ratio"):
        LossSpike(ratio=1.0)
    with pytest.raises(ValueError, match="smoothing"):
        LossSpike(smoothing=-0.1)
    with pytest.raises(ValueError, match="regression"):
        LossSpike(regression=0.0)
    with pytest.raises(ValueError, match="armed_drop"):
        LossSpike(armed_drop=1.0)
    with pytest.raises(ValueError, match="patience"):
        LossSpike(patience=0)
    with pytest.raises(ValueError, match="band"):
        LossSpike(band=1.0)
    with pytest.raises(ValueError, match="band"):  # at the arming fall: armed means back
        LossSpike(band=0.15, armed_drop=0.15)


def test_a_spike_rolls_every_replica_back_to_the_last_agreed_point() -> None:
    def spiking(rank: int, step: int) -> float:
        return 10.0 if step == 7 else 2.0

    def run(rank: int, world: int) -> dict[str, object]:
        model, optimizer, engine = _watched_replicas(outer=True)
        agreed = None
        for step in range(9):
            engine.synchronize()
            if step == 6:  # the round after step 5 was applied at this boundary
                agreed = torch.cat([p.detach().reshape(-1).clone() for p in model.parameters()])
            _observed_step(engine, model, optimizer, rank, step, spiking(rank, step))
        # step 7's loss spiked: step 8 ran from the agreed point with fresh momentum, and the
        # next round is 3 steps after the roll-back, not at step 8
        engine.synchronize()
        assert agreed is not None
        rolled = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        return {
            "rollbacks": engine.rollbacks,
            "rounds": engine.rounds,
            "moved_from_agreed": float((rolled - agreed).norm()),
            "last_round_step": engine.schedule.last_round_step,
            "rolled": rolled,
        }

    results = run_distributed(run, 2)
    for result in results:
        assert result["rollbacks"] == 1
        assert result["rounds"] == 2  # after steps 2 and 5 only
        assert result["last_round_step"] == 8
        assert 0 < result["moved_from_agreed"] < 0.5  # one step with fresh momentum
    assert not torch.equal(results[0]["rolled"], results[1]["rolled"])  # step 8 was local


@pytest.mark.parametrize("outer", [False, True])
def test_a_spike_after_an_evaluation_round_rolls_back_to_the_schedule_s_round(
    outer: bool,
) -> None:
    # rounds after steps 2 and 5; an evaluation after step 6 runs a short round of its own,
    # and step 8's loss spikes: the roll-back goes to the round after step 5, not to the
    # evaluation's (diloco on vgg_mini, seed 4: going back to the validation's round, the
    # loss blew up again from it and the run ended at 0.775; from the round before, 0.900)
    def run(rank: int, world: int) -> dict[str, object]:
        model, optimizer, engine = _watched_replicas(outer=outer)
        points: dict[str, Tensor] = {}
        for step in range(9):
            engine.synchronize()
            if step == 6:
                points["round"] = _flat(model)
            if step == 7:
                engine.prepare_evaluation(policy="round")
                points["evaluation"] = _flat(model)
                engine.restore_replica()
            _observed_step(engine, model, optimizer, rank, step, 10.0 if step == 8 else 2.0)
        engine.synchronize()
        rolled = _flat(model)
        return {
            "rollbacks": engine.rollbacks,
            "rounds": engine.rounds,
            "rolled_to": [name for name, point in points.items() if torch.equal(rolled, point)],
        }

    for result in run_distributed(run, 2):
        assert result["rollbacks"] == 1
        assert result["rounds"] == 3  # after steps 2 and 5, and the evaluation's
        assert result["rolled_to"] == ["round"]


def test_an_evaluation_round_is_no_new_point_for_a_second_roll_back() -> None:
    # step 4's loss spikes and rolls back to the round after step 2; an evaluation's round
    # after step 5 is not a point to go back to, so step 6's spike, before the schedule's next
    # round, would go back to the same point and is declined
    def run(rank: int, world: int) -> tuple[int, int]:
        model, optimizer, engine = _watched_replicas(outer=True)
        for step in range(8):
            engine.synchronize()
            if step == 6:
                engine.prepare_evaluation(policy="round")
                engine.restore_replica()
            _observed_step(engine, model, optimizer, rank, step, 10.0 if step in (4, 6) else 2.0)
        engine.synchronize()
        return engine.rollbacks, engine.rollbacks_declined

    assert run_distributed(run, 2) == [(1, 1), (1, 1)]


def test_a_step_without_a_loss_does_not_show_a_point_healthy() -> None:
    # the round after step 5 lands at step 6, which reports no loss (NaN); step 7's spike is
    # then the first loss from that round, and goes back to the round after step 2
    def run(rank: int, world: int) -> list[int]:
        model, optimizer, engine = _watched_replicas()
        points: dict[int, Tensor] = {}
        losses = {6: math.nan, 7: 10.0}
        for step in range(8):
            engine.synchronize()
            if step in (3, 6):
                points[step] = _flat(model)
            _observed_step(engine, model, optimizer, rank, step, losses.get(step, 2.0))
        engine.synchronize()
        rolled = _flat(model)
        return [step for step, point in points.items() if torch.equal(rolled, point)]

    assert run_distributed(run, 2) == [[3], [3]]


def _observed_step(
    engine: ReplicaAveraging,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    rank: int,
    step: int,
    loss: float,
) -> None:
    """One local step on ``rank``'s batch, the loss rules fed ``loss`` (as a fit does)."""
    inputs, targets = _batch(rank, step)
    optimizer.zero_grad()
    nn.functional.mse_loss(model(inputs), targets).backward()
    engine.observe_loss(loss)
    optimizer.step()
    engine.count_optimizer_step()


def _flat(model: nn.Module) -> Tensor:
    return torch.cat([p.detach().reshape(-1).clone() for p in model.parameters()])


def test_a_point_that_spikes_again_is_not_gone_back_to_step_after_step() -> None:
    # step 7's loss spikes; the point rolled back to loses as much (10.0 from then on): one
    # roll-back, then training goes on from it (streaming DiLoCo on vgg_mini, seed 1, went
    # back 45 steps in a row)
    def run(rank: int, world: int) -> int:
        model, optimizer, engine = _watched_replicas(outer=True)
        for step in range(12):
            engine.synchronize()
            _observed_step(engine, model, optimizer, rank, step, 10.0 if step >= 7 else 2.0)
        engine.synchronize()
        return engine.rollbacks

    assert run_distributed(run, 2) == [1, 1]


@pytest.mark.parametrize("outer", [False, True])
def test_a_spike_at_the_first_step_after_a_round_goes_back_to_the_round_before(
    outer: bool,
) -> None:
    # rounds after steps 2 and 5; the first loss from the round after step 5 (step 6's)
    # spikes: that round's point is itself bad, and the roll-back goes to the round after
    # step 2, which step 3's loss had shown healthy (streaming DiLoCo on vgg_mini, seed 1:
    # a round's point with losses of 4.9 and 5.8 was gone back to until the run died)
    def run(rank: int, world: int) -> dict[str, object]:
        model, optimizer, engine = _watched_replicas(outer=outer)
        points: dict[int, Tensor] = {}
        for step in range(7):
            engine.synchronize()
            if step in (3, 6):  # the rounds after steps 2 and 5 were applied here
                points[step] = _flat(model)
            _observed_step(engine, model, optimizer, rank, step, 10.0 if step == 6 else 2.0)
        engine.synchronize()
        rolled = _flat(model)
        return {
            "rollbacks": engine.rollbacks,
            "rolled_to": [step for step, point in points.items() if torch.equal(rolled, point)],
        }

    for result in run_distributed(run, 2):
        assert result["rollbacks"] == 1
        assert result["rolled_to"] == [3]


@pytest.mark.parametrize("outer", [False, True])
def test_a_round_applied_late_is_the_point_rolled_back_to(outer: bool) -> None:
    # overlap=True: the rounds started after steps 2 and 5 land a step later, each replica
    # keeping that step; no replica ever holds the agreed point, which must still be kept:
    # step 8's spike goes back to the round started after step 5 (its result, shown healthy
    # by step 7's loss), not to where local training started nor to the round before
    def run(rank: int, world: int) -> dict[str, object]:
        model, optimizer, engine = _watched_replicas(outer=outer, overlap=True)
        start = _flat(model)
        kept: dict[int, Tensor] = {}
        for step in range(9):
            engine.synchronize()
            if engine._safe_point is not None:  # the point kept once this boundary's round landed
                kept[step] = torch.cat([t.reshape(-1).clone() for t in engine._safe_point])
            _observed_step(engine, model, optimizer, rank, step, 10.0 if step == 8 else 2.0)
        engine.synchronize()
        return {"rollbacks": engine.rollbacks, "rolled": _flat(model), "start": start,
                "kept": kept}  # fmt: skip

    results = run_distributed(run, 2)
    for result in results:
        assert result["rollbacks"] == 1
        kept = result["kept"]
        assert torch.equal(kept[0], result["start"])  # local training starts in agreement
        assert not torch.equal(kept[4], kept[0])  # the round after step 2 landed at 4
        assert not torch.equal(kept[7], kept[4])  # the round after step 5 landed at 7
        assert torch.equal(result["rolled"], kept[7])
    # the point rolled back to is the agreed one: identical on both replicas
    assert torch.equal(results[0]["rolled"], results[1]["rolled"])


def test_a_late_round_s_point_holds_buffers_and_leaves_averaged_optimizer_state_out() -> None:
    # the recorded point is the round's parameters then its buffers (BatchNorm's statistics),
    # not the averaged optimizer state that follows them in the round
    def run(rank: int, world: int) -> tuple[int, int, bool]:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3), nn.Linear(3, 2))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        engine = ReplicaAveraging(
            model, [optimizer], PeriodicAverager(), AveragingSchedule(3),
            build_reduction("flat"), ledger=CommLedger(), spike=LossSpike(ratio=2.0),
            overlap=True, optimizer_state="average",
        )  # fmt: skip
        engine.broadcast_replicas()
        for step in range(9):
            engine.synchronize()
            _observed_step(engine, model, optimizer, rank, step, 10.0 if step == 8 else 2.0)
        engine.synchronize()
        assert engine._safe_point is not None
        running = model[1].running_mean
        return (
            engine.rollbacks,
            len(engine._safe_point),
            any(torch.equal(running, t) for t in engine._safe_point),
        )

    # six parameters, then the running mean and variance (not the six momentum buffers)
    assert run_distributed(run, 2) == [(1, 8, True), (1, 8, True)]


def test_a_regression_after_a_roll_back_is_not_declined() -> None:
    # armed at step 2; step 7 spikes and rolls back; from there the loss climbs back to the
    # start and stays (a dead network), every round meanwhile held inside the climb, so no new
    # point is kept: the regression still rolls back (diloco on vgg_mini, seed 3, declined it
    # and sat at 2.30 for 25 steps), where a second spike would be declined
    losses = [2.3, 2.3, 1.0, 1.0, 1.0, 1.0, 1.0, 10.0, 1.0] + [2.3] * 14

    def run(rank: int, world: int) -> tuple[int, int, int, int]:
        model, optimizer, engine = _watched_replicas(outer=True)
        for step, loss in enumerate(losses):
            engine.synchronize()
            _observed_step(engine, model, optimizer, rank, step, loss)
        engine.synchronize()
        assert engine.spike is not None
        return (
            engine.rollbacks,
            engine.rollbacks_declined,
            engine.spike.spikes,
            engine.spike.regressions,
        )

    assert run_distributed(run, 2) == [(2, 0, 1, 1), (2, 0, 1, 1)]


def test_a_third_roll_back_to_one_point_is_declined_for_a_regression_too() -> None:
    # the point gone back to is healthy (its first loss 1.0), and the network dies from it
    # every time (2.3 after that): the rule re-arms at that first loss, so each death is a
    # regression; the spike went back to the point once, the first regression goes back a
    # second time, the next is declined (no end to it otherwise)
    def run(rank: int, world: int) -> tuple[int, int, int]:
        model, optimizer, engine = _watched_replicas(outer=True)
        since = 0
        for step in range(60):
            before = engine.rollbacks
            engine.synchronize()
            since = 0 if engine.rollbacks > before else since + 1
            if step < 8:
                loss = [2.3, 2.3, 1.0, 1.0, 1.0, 1.0, 1.0, 10.0][step]
            else:
                loss = 1.0 if since == 0 else 2.3
            _observed_step(engine, model, optimizer, rank, step, loss)
        engine.synchronize()
        assert engine.spike is not None
        return engine.rollbacks, engine.rollbacks_declined, engine.spike.regressions

    assert run_distributed(run, 2) == [(2, 1, 2), (2, 1, 2)]


def test_no_second_roll_back_before_a_round_has_come() -> None:
    # spikes at steps 7, 10 and 12: the first rolls back (the next round then comes after
    # step 10); the second, before that round, would go back to the same point and is only
    # counted; the third, after the round, rolls back again (vgg_mini: a spike every 6 steps
    # from one point, with no round between them, rolled back 9 and 36 times)
    def run(rank: int, world: int) -> tuple[int, int, int]:
        model, optimizer, engine = _watched_replicas(outer=True)
        for step in range(14):
            engine.synchronize()
            _observed_step(
                engine, model, optimizer, rank, step, 10.0 if step in (7, 10, 12) else 2.0
            )
        engine.synchronize()
        assert engine.spike is not None
        return engine.rollbacks, engine.rollbacks_declined, engine.spike.spikes

    assert run_distributed(run, 2) == [(2, 1, 3), (2, 1, 3)]


def _watched_replicas(
    spike: bool = True, outer: bool = False, overlap: bool = False
) -> tuple[nn.Module, torch.optim.Optimizer, ReplicaAveraging]:
    """A small model averaged every 3 steps (DiLoCo's outer optimizer with ``outer``, else
    plain averaging; each round applied a step late with ``overlap``; the spike and
    regression rules unless not ``spike``), replicas broadcast (inside a distributed run)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    engine = ReplicaAveraging(
        model,
        [optimizer],
        OuterOptimizerAverager(diloco_outer_optimizer()) if outer else PeriodicAverager(),
        AveragingSchedule(3),
        build_reduction("flat"),
        ledger=CommLedger(),
        spike=LossSpike(ratio=2.0) if spike else None,
        overlap=overlap,
    )
    engine.broadcast_replicas()
    return model, optimizer, engine


def test_a_regression_rolls_back_to_the_point_from_before_the_climb() -> None:
    # the loss falls (armed at step 3), climbs from step 6 (unsettled from step 7) and is back
    # in the start's band (both losses at least 0.97 x 2.3) from step 9: the third step there,
    # 11, fires; the round after step 8 falls inside the climb and is not kept, so the
    # roll-back goes to the round after 5
    climbing = [2.3, 2.3, 1.2, 1.0, 1.0, 1.0] + [2.6] * 6

    def run(rank: int, world: int) -> dict[str, object]:
        model, optimizer, engine = _watched_replicas()
        agreed = None
        for step in range(12):
            engine.synchronize()
            if step == 6:  # the round after step 5 was applied at this boundary
                agreed = torch.cat([p.detach().reshape(-1).clone() for p in model.parameters()])
            _observed_step(engine, model, optimizer, rank, step, climbing[step])
        engine.synchronize()
        assert agreed is not None
        rolled = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        assert engine.spike is not None
        return {
            "rollbacks": engine.rollbacks,
            "regressions": engine.spike.regressions,
            "rounds": engine.rounds,
            "equal_to_agreed": torch.equal(rolled, agreed),
        }

    for result in run_distributed(run, 2):
        assert (result["rollbacks"], result["regressions"]) == (1, 1)
        assert result["rounds"] == 3  # after steps 2, 5 and 8
        assert result["equal_to_agreed"]


@pytest.mark.parametrize("settles", [True, False])
def test_a_round_held_inside_a_climb_becomes_safe_once_the_loss_settles(settles: bool) -> None:
    # armed at step 2; a climb makes the loss unsettled at step 8, so the round after step 8
    # is held; with ``settles`` the loss falls back under the half-way mark at step 9 and the
    # spike at step 11 rolls back to that held round (bmuf seed 4 went back to the round
    # before the climb, 33 steps); a climb still under way at the spike goes back before it
    after = [0.8, 0.8] if settles else [2.2, 2.2]
    losses = [2.3, 2.3, 1.0, 1.0, 1.0, 1.0, 2.2, 2.2, 2.2, *after, 10.0]

    def run(rank: int, world: int) -> dict[str, object]:
        model, optimizer, engine = _watched_replicas()
        agreed: dict[int, Tensor] = {}
        for step, loss in enumerate(losses):
            engine.synchronize()
            if step in (6, 9):  # the rounds after steps 5 and 8 were applied here
                agreed[step] = torch.cat(
                    [p.detach().reshape(-1).clone() for p in model.parameters()]
                )
            _observed_step(engine, model, optimizer, rank, step, loss)
        engine.synchronize()
        rolled = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        assert engine.spike is not None
        return {
            "rollbacks": engine.rollbacks,
            "spikes": engine.spike.spikes,
            "regressions": engine.spike.regressions,
            "rolled_to": [step for step, point in agreed.items() if torch.equal(rolled, point)],
        }

    for result in run_distributed(run, 2):
        assert (result["rollbacks"], result["spikes"], result["regressions"]) == (1, 1, 0)
        assert result["rolled_to"] == ([9] if settles else [6])
