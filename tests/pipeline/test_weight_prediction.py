"""Weight prediction equals the hand computation; stash/2bw keep the versions they promise."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn

from lightning_parallel.pipeline.weight_prediction import (
    AdamDirection,
    DoubleBufferedWeights,
    LearningRateForecast,
    MomentumBuffer,
    PredictionErrorMeter,
    ScheduledLearningRate,
    SmoothedGradient,
    SpecTrainPrediction,
    WeightPredictor,
    WeightStashing,
    make_weight_predictor,
    staleness_learning_rate_scale,
)


def _update(
    predictor: WeightPredictor, optimizer: torch.optim.Optimizer, grad: torch.Tensor
) -> None:
    """One optimizer update of the single parameter with gradient ``grad``."""
    (param,) = predictor.parameters
    param.grad = grad.clone()
    predictor.before_update()
    optimizer.step()
    predictor.after_update()
    param.grad = None


def _drive(
    predictor: WeightPredictor,
    optimizer: torch.optim.Optimizer,
    batches: int,
    grad: Callable[[int], torch.Tensor],
) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """Run the 1F1B no-flush order of one stage: F(t), then B(t-(N-k-1)) and its update.

    Returns, per micro-batch, the weights its forward and its backward saw.
    """
    (param,) = predictor.parameters
    lag = predictor.stages - predictor.stage - 1
    seen: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    forward_seen: dict[int, torch.Tensor] = {}
    pending = 0
    for t in range(batches + lag):
        if t < batches:
            used = predictor.forward_weights(t)
            forward_seen[t] = (param.detach() if used is None else used[0]).clone()
        b = t - lag
        if b >= 0:
            used = predictor.backward_weights(b)
            seen[b] = (forward_seen.pop(b), (param.detach() if used is None else used[0]).clone())
            predictor.release(b)
            param.grad = grad(b) if param.grad is None else param.grad + grad(b)
            pending += 1
            if pending == predictor.update_period:
                param.grad /= pending
                predictor.before_update()
                optimizer.step()
                predictor.after_update()
                param.grad = None
                pending = 0
    return seen


def _param(values: list[float]) -> nn.Parameter:
    return nn.Parameter(torch.tensor(values))


def test_v2_equals_hand_computation_and_reuses_forward_weights_for_backward() -> None:
    w = _param([1.0, -2.0, 3.0])
    optimizer = torch.optim.SGD([w], lr=0.1)
    predictor = make_weight_predictor("v2", [w], optimizer, stage=0, stages=3, gamma=0.5)
    assert isinstance(predictor, SpecTrainPrediction)
    g0, g1 = torch.tensor([1.0, 2.0, -1.0]), torch.tensor([3.0, 0.0, 1.0])
    _update(predictor, optimizer, g0)
    _update(predictor, optimizer, g1)
    w2 = torch.tensor([1.0, -2.0, 3.0]) - 0.1 * g0 - 0.1 * g1
    v1 = 0.5 * (0.5 * g0) + 0.5 * g1  # v_{-1}=0, v_0=(1-gamma)g_0, v_1=gammav_0+(1-gamma)g_1
    expected = w2 - 2 * 0.1 * v1  # s = N-k-1 = 2
    forward = predictor.forward_weights(7)
    assert forward is not None
    torch.testing.assert_close(forward[0], expected, rtol=0, atol=1e-7)
    _update(predictor, optimizer, torch.tensor([5.0, 5.0, 5.0]))
    backward = predictor.backward_weights(7)
    assert backward is not None
    torch.testing.assert_close(backward[0], expected, rtol=0, atol=1e-7)


def test_v1_equals_hand_computation_forward_and_backward_horizons() -> None:
    w = _param([0.5, 1.5])
    optimizer = torch.optim.SGD([w], lr=0.2)
    # N=4, k=2: forward s = floor(2/2) + 4-2-1 = 2, backward s = floor(2/2) = 1
    predictor = make_weight_predictor("v1", [w], optimizer, stage=2, stages=4, gamma=0.8)
    assert isinstance(predictor, SpecTrainPrediction)
    assert (predictor.forward_horizon, predictor.backward_horizon) == (2, 1)
    g0, g1 = torch.tensor([1.0, -1.0]), torch.tensor([2.0, 4.0])
    _update(predictor, optimizer, g0)
    v0 = 0.2 * g0
    w1 = torch.tensor([0.5, 1.5]) - 0.2 * g0
    forward = predictor.forward_weights(0)
    assert forward is not None
    torch.testing.assert_close(forward[0], w1 - 2 * 0.2 * v0, rtol=0, atol=1e-7)
    _update(predictor, optimizer, g1)
    v1 = 0.8 * v0 + 0.2 * g1
    w2 = w1 - 0.2 * g1
    backward = predictor.backward_weights(0)
    assert backward is not None
    torch.testing.assert_close(backward[0], w2 - 1 * 0.2 * v1, rtol=0, atol=1e-7)


def test_v1_and_v2_predict_nothing_where_the_horizon_is_zero() -> None:
    w = _param([1.0])
    optimizer = torch.optim.SGD([w], lr=0.1)
    last = make_weight_predictor("v2", [w], optimizer, stage=1, stages=2)
    assert last.forward_weights(0) is None and last.backward_weights(0) is None
    assert last.peak_bytes() == 0  # no smoothed gradient kept where nothing is predicted
    first = make_weight_predictor("v1", [w], optimizer, stage=1, stages=3)
    assert isinstance(first, SpecTrainPrediction)
    assert (first.forward_horizon, first.backward_horizon) == (1, 0)


def test_momentum_sgd_step_scale_makes_prediction_exact_under_constant_gradient() -> None:
    """torch SGD(momentum=μ) steps η·buf with buf = v/(1-μ): the scale 1/(1-μ) is needed."""
    w = _param([0.0, 0.0])
    optimizer = torch.optim.SGD([w], lr=0.01, momentum=0.9)
    predictor = make_weight_predictor(
        "v2", [w], optimizer, stage=0, stages=4, direction="smoothed_gradient"
    )
    assert isinstance(predictor, SpecTrainPrediction)
    assert isinstance(predictor.direction, SmoothedGradient)
    assert predictor.direction.gamma == 0.9
    assert predictor.direction.step_scale == pytest.approx(10.0)
    g = torch.tensor([1.0, -2.0])
    for _ in range(200):  # long enough for buf and v to converge
        _update(predictor, optimizer, g)
    velocity = predictor.direction.velocity[0].clone()
    forward = predictor.forward_weights(0)
    assert forward is not None
    torch.testing.assert_close(forward[0], w.detach() - 3 * 0.01 * 10.0 * velocity)
    for _ in range(3):
        _update(predictor, optimizer, g)
    torch.testing.assert_close(forward[0], w.detach(), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("dampening", [0.0, 0.3])
def test_sgd_momentum_buffer_is_the_scaled_smoothed_gradient_at_no_memory_cost(
    dampening: float,
) -> None:
    predictions = {}
    for direction in ("auto", "smoothed_gradient"):
        w = _param([1.0, -1.0, 0.5])
        optimizer = torch.optim.SGD([w], lr=0.1, momentum=0.8, dampening=dampening)
        predictor = make_weight_predictor(
            "v2",
            [w],
            optimizer,
            stage=0,
            stages=3,
            direction=direction,  # type: ignore[arg-type]
        )
        for g in ([1.0, 2.0, 3.0], [-1.0, 0.5, 0.0], [2.0, 2.0, -2.0]):
            _update(predictor, optimizer, torch.tensor(g))
        assert isinstance(predictor, SpecTrainPrediction)
        predictions[direction] = (predictor.forward_weights(0), predictor.peak_bytes())
    assert isinstance(
        make_weight_predictor("v2", [_param([1.0])], optimizer, stage=0, stages=2).direction,  # type: ignore[union-attr]
        MomentumBuffer,
    )
    auto, smoothed = predictions["auto"], predictions["smoothed_gradient"]
    assert auto[0] is not None and smoothed[0] is not None
    if dampening == 0.0:  # same recursion from the first update on
        torch.testing.assert_close(auto[0][0], smoothed[0][0])
    else:  # torch's first update ignores dampening: the buffers differ by that first term
        assert not torch.allclose(auto[0][0], smoothed[0][0])
    assert auto[1] == 3 * 4 and smoothed[1] == 2 * 3 * 4  # one prediction (+ v), in bytes


def test_schedule_aware_sums_the_schedulers_future_learning_rates() -> None:
    w = _param([1.0, 1.0])
    optimizer = torch.optim.SGD([w], lr=1.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda e: 0.5**e)
    forecast = ScheduledLearningRate(optimizer, scheduler, updates_per_scheduler_step=2)
    predictor = make_weight_predictor(
        "v2", [w], optimizer, stage=0, stages=4, gamma=0.0, learning_rates=forecast
    )
    g = torch.tensor([1.0, 2.0])
    _update(predictor, optimizer, g)  # one update done in the current scheduler period
    # next 3 updates: periods (1+0)//2=0, (1+1)//2=1, (1+2)//2=1 -> lrs 1, 0.5, 0.5
    assert forecast.sums(3) == [pytest.approx(2.0)]
    forward = predictor.forward_weights(0)
    assert forward is not None
    torch.testing.assert_close(forward[0], w.detach() - 2.0 * g)  # gamma=0: v = last gradient
    assert optimizer.param_groups[0]["lr"] == 1.0 and scheduler.last_epoch == 0  # untouched
    constant = LearningRateForecast(optimizer)
    assert constant.sums(3) == [pytest.approx(3.0)]


def test_schedule_forecast_matches_the_rates_that_really_occur() -> None:
    w = _param([1.0])
    optimizer = torch.optim.SGD([w], lr=0.3)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=0.3, total_steps=40)
    forecast = ScheduledLearningRate(optimizer, scheduler, updates_per_scheduler_step=3)
    predictions: list[tuple[int, float]] = []
    applied: list[float] = []
    for update in range(60):
        predictions.append((update, forecast.sums(5)[0]))
        applied.append(optimizer.param_groups[0]["lr"])
        w.grad = torch.ones(1)
        optimizer.step()
        forecast.note_update()
        if (update + 1) % 3 == 0:
            scheduler.step()
    for update, predicted in predictions:
        if update + 5 <= len(applied):
            assert predicted == pytest.approx(sum(applied[update : update + 5]), rel=1e-6)


def test_adam_aware_prediction_equals_hand_computation() -> None:
    w = _param([1.0, -1.0])
    lr, wd, eps, (b1, b2) = 0.05, 0.1, 1e-8, (0.9, 0.999)
    optimizer = torch.optim.AdamW([w], lr=lr, weight_decay=wd, eps=eps, betas=(b1, b2))
    predictor = make_weight_predictor("v2", [w], optimizer, stage=0, stages=3)
    assert isinstance(predictor, SpecTrainPrediction)
    assert isinstance(predictor.direction, AdamDirection)
    grads = [torch.tensor([1.0, 0.5]), torch.tensor([-2.0, 1.0])]
    m = torch.zeros(2)
    v = torch.zeros(2)
    for g in grads:
        _update(predictor, optimizer, g)
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
    m_hat, v_hat = m / (1 - b1**2), v / (1 - b2**2)
    live = w.detach().clone()
    expected = live - 2 * lr * (m_hat / (v_hat.sqrt() + eps) + wd * live)
    forward = predictor.forward_weights(0)
    assert forward is not None
    torch.testing.assert_close(forward[0], expected, rtol=1e-6, atol=1e-7)


def test_adam_aware_prediction_beats_smoothed_gradient_under_adam() -> None:
    errors = {}
    for direction in ("adam", "smoothed_gradient"):
        w = _param([0.0, 0.0])
        optimizer = torch.optim.Adam([w], lr=0.01)
        predictor = make_weight_predictor(
            "v2",
            [w],
            optimizer,
            stage=0,
            stages=4,
            direction=direction,  # type: ignore[arg-type]
        )
        g = torch.tensor([3.0, -0.2])
        for _ in range(50):
            _update(predictor, optimizer, g)
        forward = predictor.forward_weights(0)
        assert forward is not None
        for _ in range(3):
            _update(predictor, optimizer, g)
        errors[direction] = float((forward[0] - w.detach()).norm())
    assert errors["adam"] < 1e-3 < errors["smoothed_gradient"]


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_stash_backward_sees_the_forward_version_and_holds_n_minus_k_minus_1_copies(
    stage: int,
) -> None:
    w = _param([1.0, 2.0])
    optimizer = torch.optim.SGD([w], lr=0.1)
    predictor = make_weight_predictor("stash", [w], optimizer, stage=stage, stages=4)
    assert isinstance(predictor, WeightStashing)
    seen = _drive(predictor, optimizer, 12, lambda b: torch.tensor([1.0 + b, -float(b)]))
    for forward, backward in seen.values():
        torch.testing.assert_close(forward, backward, rtol=0, atol=0)
    assert predictor.peak_bytes() == (4 - stage - 1) * predictor.stage_bytes
    assert predictor.held_bytes() == 0  # drained: every snapshot freed


def test_no_snapshot_when_no_update_happens_between_forward_and_backward() -> None:
    w = _param([1.0])
    predictor = WeightStashing([w], stage=0, stages=3)
    predictor.forward_weights(0)
    assert predictor.backward_weights(0) is None
    predictor.release(0)
    assert predictor.peak_bytes() == 0


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_2bw_updates_every_n_micro_batches_with_at_most_two_versions(stage: int) -> None:
    w = _param([0.0])
    optimizer = torch.optim.SGD([w], lr=1.0)
    predictor = make_weight_predictor("2bw", [w], optimizer, stage=stage, stages=3)
    assert isinstance(predictor, DoubleBufferedWeights) and predictor.update_period == 3
    seen = _drive(predictor, optimizer, 9, lambda b: torch.tensor([float(b)]))
    for forward, backward in seen.values():
        torch.testing.assert_close(forward, backward, rtol=0, atol=0)
    assert predictor.updates == 3
    # mean gradients of micro-batches 0-2, 3-5, 6-8: 1, 4, 7
    torch.testing.assert_close(w.detach(), torch.tensor([-12.0]))
    assert predictor.peak_bytes() == (predictor.stage_bytes if stage < 2 else 0)


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_v2_and_v1_memory_is_what_the_docs_say(stage: int) -> None:
    stages = 3
    for mode in ("v2", "v1", "none"):
        w = _param([1.0, 2.0, 3.0])
        optimizer = torch.optim.SGD([w], lr=0.1, momentum=0.9)
        predictor = make_weight_predictor(mode, [w], optimizer, stage=stage, stages=stages)
        _drive(predictor, optimizer, 8, lambda b: torch.tensor([1.0, 0.0, -1.0]))
        size = predictor.stage_bytes
        if mode == "v2":  # predictions in flight; the direction is SGD's momentum buffer
            expected = (stages - stage) * size if stage < stages - 1 else 0
        elif mode == "v1":
            expected = size  # one transient prediction
        else:
            expected = 0
        assert predictor.peak_bytes() == expected, mode


def test_prediction_error_meter_equals_hand_computation_and_shows_the_gain() -> None:
    # stage 0 of 3, plain SGD lr 0.1, constant gradient (1, 1): W_u = (3, 4) - 0.1·u·(1, 1).
    # Micro-batch b's gradient is applied with b updates done; its forward saw W_{max(b-2, 0)}.
    def live(u: int) -> torch.Tensor:
        return torch.tensor([3.0, 4.0]) - 0.1 * u

    drift = [float((live(max(b - 2, 0)) - live(b)).norm() / live(b).norm()) for b in range(10)]
    expected_stale = sum(drift) / 10
    for mode in ("none", "v2"):
        w = _param([3.0, 4.0])
        optimizer = torch.optim.SGD([w], lr=0.1)
        predictor = make_weight_predictor(mode, [w], optimizer, stage=0, stages=3, gamma=0.0)
        _drive(predictor, optimizer, 10, lambda b: torch.tensor([1.0, 1.0]))
        assert predictor.meter is not None
        means = predictor.meter.pop_means()
        assert means is not None
        prediction_error, stale_error = means
        assert stale_error == pytest.approx(expected_stale, rel=1e-5)
        if mode == "none":
            assert prediction_error == pytest.approx(stale_error)
        else:
            # gamma=0 and a constant gradient: once one gradient is known the prediction is exact
            # (micro-batches 0, 1 and 2 were forwarded before the first update)
            assert prediction_error == pytest.approx(sum(drift[:3]) / 10, rel=1e-5)
        assert predictor.meter.pop_means() is None


def test_meter_samples_coordinates_when_the_stage_is_large() -> None:
    w = nn.Parameter(torch.randn(1000))
    meter = PredictionErrorMeter([w], sample_size=100)
    assert meter.sample(None).numel() == 100
    exact = PredictionErrorMeter([w], sample_size=5000)
    assert exact.sample(None).numel() == 1000


def test_bad_arguments_name_the_fix() -> None:
    w = _param([1.0])
    sgd = torch.optim.SGD([w], lr=0.1)
    with pytest.raises(ValueError, match="prediction must be one of"):
        make_weight_predictor("v3", [w], sgd, stage=0, stages=2)
    with pytest.raises(TypeError, match="direction='smoothed_gradient'"):
        make_weight_predictor("v2", [w], sgd, stage=0, stages=2, direction="adam")
    with pytest.raises(ValueError, match="stage must be in"):
        make_weight_predictor("none", [w], sgd, stage=2, stages=2)
    with pytest.raises(ValueError, match="needs the optimizer"):
        make_weight_predictor("v2", [w], None, stage=0, stages=2)
    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(sgd)
    with pytest.raises(TypeError, match="learning_rates='constant'"):
        ScheduledLearningRate(sgd, plateau)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="learning_rate_scale must be a factor in"):
        make_weight_predictor("none", [w], sgd, stage=0, stages=2, learning_rate_scale=0.0)
    with pytest.raises(ValueError, match="'staleness' or a factor in"):
        make_weight_predictor("none", [w], sgd, stage=0, stages=2, learning_rate_scale="half")
    with pytest.raises(ValueError, match="needs the optimizer whose learning rates"):
        make_weight_predictor("none", [w], None, stage=0, stages=2, learning_rate_scale=0.5)


def test_staleness_scale_is_the_delayed_sgd_stability_ratio() -> None:
    """ρ(τ) = sin(π/(2(2τ+1))): the largest stable η·h of x' = x - η·h·x_{t-τ}, over 2."""
    for tau in range(1, 5):
        rho = staleness_learning_rate_scale(tau)

        # largest stable a of x_{t+1} = x_t - a·x_{t-τ}: spectral radius of its state map
        def radius(a: float, tau: int = tau) -> float:
            transition = torch.zeros(tau + 1, tau + 1, dtype=torch.float64)
            transition[0, 0], transition[0, tau] = 1.0, -a
            transition[1:, :-1] = torch.eye(tau, dtype=torch.float64)
            return float(torch.linalg.eigvals(transition).abs().max())

        stable = [a for a in torch.linspace(0.01, 2.0, 400).tolist() if radius(a) < 1.0]
        assert rho == pytest.approx(max(stable) / 2.0, abs=0.004)
    assert staleness_learning_rate_scale(0, 0.9, True) == 1.0
    assert staleness_learning_rate_scale(1) == pytest.approx(0.5)


def test_staleness_scale_under_momentum_is_the_heavy_ball_stability_ratio() -> None:
    """Heavy ball with a one-update-stale gradient, z² - (1+μ)z + μ + η·h, is stable while
    η·h < 1-μ; synchronous while η·h < 2(1+μ): ρ = (1-μ)/(2(1+μ)). Prediction widens it."""
    for momentum in (0.5, 0.9):
        stale = staleness_learning_rate_scale(1, momentum)
        assert stale == pytest.approx((1 - momentum) / (2 * (1 + momentum)), rel=1e-5)
        assert stale <= staleness_learning_rate_scale(1, momentum, predicted=True) < 1.0
    # at μ = 0.9 prediction widens the stable step 2.7 times: 0.27 / 3.8
    assert staleness_learning_rate_scale(1, 0.9, predicted=True) == pytest.approx(0.0711, abs=2e-4)
    deeper = [staleness_learning_rate_scale(tau, 0.9, predicted=True) for tau in (1, 2, 3)]
    assert deeper == sorted(deeper, reverse=True)  # the longer the delay, the smaller the step


def test_learning_rate_scale_shrinks_stale_steps_and_the_prediction() -> None:
    """Stage 0 of 2 with scale 1/2 steps with η/2 and predicts with η/2; the lr is restored."""
    w = _param([1.0, -2.0])
    optimizer = torch.optim.SGD([w], lr=0.2, momentum=0.9)
    predictor = make_weight_predictor(
        "v2", [w], optimizer, stage=0, stages=2, learning_rate_scale=0.5
    )
    assert isinstance(predictor, SpecTrainPrediction)
    g0, g1 = torch.tensor([1.0, 2.0]), torch.tensor([-3.0, 0.5])
    _update(predictor, optimizer, g0)
    assert optimizer.param_groups[0]["lr"] == 0.2  # restored after every update
    _update(predictor, optimizer, g1)
    buf1 = 0.9 * g0 + g1  # torch's heavy-ball buffer after two updates (buf0 = g0)
    w2 = torch.tensor([1.0, -2.0]) - 0.1 * g0 - 0.1 * buf1  # steps of η/2 = 0.1
    torch.testing.assert_close(w.detach(), w2)
    forward = predictor.forward_weights(0)
    assert forward is not None  # s = 1 update of η/2 along the buffer
    torch.testing.assert_close(forward[0], w2 - 0.1 * buf1)


def test_staleness_option_resolves_delay_momentum_and_correction() -> None:
    sgd = torch.optim.SGD([_param([1.0])], lr=0.1, momentum=0.9)
    adam = torch.optim.Adam([_param([1.0])], lr=0.1, betas=(0.8, 0.999))

    def scale(mode: str, optimizer: torch.optim.Optimizer, stage: int, stages: int) -> float:
        return make_weight_predictor(
            mode,
            [_param([1.0])],
            optimizer,
            stage=stage,
            stages=stages,
            learning_rate_scale="staleness",
        ).learning_rate_scale

    assert scale("v2", sgd, 0, 2) == staleness_learning_rate_scale(1, 0.9, predicted=True)
    assert scale("v1", sgd, 0, 3) == staleness_learning_rate_scale(2, 0.9, predicted=True)
    assert scale("none", sgd, 0, 3) == staleness_learning_rate_scale(2, 0.9)
    assert scale("stash", adam, 1, 3) == staleness_learning_rate_scale(1, 0.8)  # Adam's β1
    assert scale("2bw", sgd, 0, 4) == staleness_learning_rate_scale(1, 0.9)  # one update stale
    assert scale("v2", sgd, 2, 3) == scale("none", sgd, 1, 2) == 1.0  # last stage: never stale
