"""The predictors: v1/v2 equal the hand computation, stash/2bw keep the versions they promise,
every option holds the memory the docs say, and the factory resolves its options or names the fix."""

from __future__ import annotations

import pytest
import torch
from helpers.predictors import apply_update, drive_stage, make_parameter

from lightning_parallel.pipeline.noflush import (
    DoubleBufferedWeights,
    ScheduledLearningRate,
    SpecTrainPrediction,
    WeightStashing,
    default_prediction,
    make_weight_predictor,
    staleness_learning_rate_scale,
)


def test_v2_equals_hand_computation_and_reuses_forward_weights_for_backward() -> None:
    w = make_parameter([1.0, -2.0, 3.0])
    optimizer = torch.optim.SGD([w], lr=0.1)
    predictor = make_weight_predictor("v2", [w], optimizer, stage=0, stages=3, gamma=0.5)
    assert isinstance(predictor, SpecTrainPrediction)
    g0, g1 = torch.tensor([1.0, 2.0, -1.0]), torch.tensor([3.0, 0.0, 1.0])
    apply_update(predictor, optimizer, g0)
    apply_update(predictor, optimizer, g1)
    w2 = torch.tensor([1.0, -2.0, 3.0]) - 0.1 * g0 - 0.1 * g1
    v1 = 0.5 * (0.5 * g0) + 0.5 * g1  # v_{-1}=0, v_0=(1-gamma)g_0, v_1=gammav_0+(1-gamma)g_1
    expected = w2 - 2 * 0.1 * v1  # s = N-k-1 = 2
    forward = predictor.forward_weights(7)
    assert forward is not None
    torch.testing.assert_close(forward[0], expected, rtol=0, atol=1e-7)
    apply_update(predictor, optimizer, torch.tensor([5.0, 5.0, 5.0]))
    backward = predictor.backward_weights(7)
    assert backward is not None
    torch.testing.assert_close(backward[0], expected, rtol=0, atol=1e-7)


def test_v1_equals_hand_computation_forward_and_backward_horizons() -> None:
    w = make_parameter([0.5, 1.5])
    optimizer = torch.optim.SGD([w], lr=0.2)
    # N=4, k=2: forward s = floor(2/2) + 4-2-1 = 2, backward s = floor(2/2) = 1
    predictor = make_weight_predictor("v1", [w], optimizer, stage=2, stages=4, gamma=0.8)
    assert isinstance(predictor, SpecTrainPrediction)
    assert (predictor.forward_horizon, predictor.backward_horizon) == (2, 1)
    g0, g1 = torch.tensor([1.0, -1.0]), torch.tensor([2.0, 4.0])
    apply_update(predictor, optimizer, g0)
    v0 = 0.2 * g0
    w1 = torch.tensor([0.5, 1.5]) - 0.2 * g0
    forward = predictor.forward_weights(0)
    assert forward is not None
    torch.testing.assert_close(forward[0], w1 - 2 * 0.2 * v0, rtol=0, atol=1e-7)
    apply_update(predictor, optimizer, g1)
    v1 = 0.8 * v0 + 0.2 * g1
    w2 = w1 - 0.2 * g1
    backward = predictor.backward_weights(0)
    assert backward is not None
    torch.testing.assert_close(backward[0], w2 - 1 * 0.2 * v1, rtol=0, atol=1e-7)


def test_v1_and_v2_predict_nothing_where_the_horizon_is_zero() -> None:
    w = make_parameter([1.0])
    optimizer = torch.optim.SGD([w], lr=0.1)
    last = make_weight_predictor("v2", [w], optimizer, stage=1, stages=2)
    assert last.forward_weights(0) is None and last.backward_weights(0) is None
    assert last.peak_bytes() == 0  # no smoothed gradient kept where nothing is predicted
    first = make_weight_predictor("v1", [w], optimizer, stage=1, stages=3)
    assert isinstance(first, SpecTrainPrediction)
    assert (first.forward_horizon, first.backward_horizon) == (1, 0)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_stash_backward_sees_the_forward_version_and_holds_n_minus_k_minus_1_copies(
    stage: int,
) -> None:
    w = make_parameter([1.0, 2.0])
    optimizer = torch.optim.SGD([w], lr=0.1)
    predictor = make_weight_predictor("stash", [w], optimizer, stage=stage, stages=4)
    assert isinstance(predictor, WeightStashing)
    seen = drive_stage(predictor, optimizer, 12, lambda b: torch.tensor([1.0 + b, -float(b)]))
    for forward, backward in seen.values():
        torch.testing.assert_close(forward, backward, rtol=0, atol=0)
    assert predictor.peak_bytes() == (4 - stage - 1) * predictor.stage_bytes
    assert predictor.held_bytes() == 0  # drained: every snapshot freed


def test_no_snapshot_when_no_update_happens_between_forward_and_backward() -> None:
    w = make_parameter([1.0])
    predictor = WeightStashing([w], stage=0, stages=3)
    predictor.forward_weights(0)
    assert predictor.backward_weights(0) is None
    predictor.release(0)
    assert predictor.peak_bytes() == 0


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_2bw_updates_every_n_micro_batches_with_at_most_two_versions(stage: int) -> None:
    w = make_parameter([0.0])
    optimizer = torch.optim.SGD([w], lr=1.0)
    predictor = make_weight_predictor("2bw", [w], optimizer, stage=stage, stages=3)
    assert isinstance(predictor, DoubleBufferedWeights) and predictor.update_period == 3
    seen = drive_stage(predictor, optimizer, 9, lambda b: torch.tensor([float(b)]))
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
        w = make_parameter([1.0, 2.0, 3.0])
        optimizer = torch.optim.SGD([w], lr=0.1, momentum=0.9)
        predictor = make_weight_predictor(mode, [w], optimizer, stage=stage, stages=stages)
        drive_stage(predictor, optimizer, 8, lambda b: torch.tensor([1.0, 0.0, -1.0]))
        size = predictor.stage_bytes
        if mode == "v2":  # predictions in flight; the direction is SGD's momentum buffer
            expected = (stages - stage) * size if stage < stages - 1 else 0
        elif mode == "v1":
            expected = size  # one transient prediction
        else:
            expected = 0
        assert predictor.peak_bytes() == expected, mode


def test_bad_arguments_name_the_fix() -> None:
    w = make_parameter([1.0])
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


def test_learning_rate_scale_shrinks_stale_steps_and_the_prediction() -> None:
    """Stage 0 of 2 with scale 1/2 steps with η/2 and predicts with η/2; the lr is restored."""
    w = make_parameter([1.0, -2.0])
    optimizer = torch.optim.SGD([w], lr=0.2, momentum=0.9)
    predictor = make_weight_predictor(
        "v2", [w], optimizer, stage=0, stages=2, learning_rate_scale=0.5
    )
    assert isinstance(predictor, SpecTrainPrediction)
    g0, g1 = torch.tensor([1.0, 2.0]), torch.tensor([-3.0, 0.5])
    apply_update(predictor, optimizer, g0)
    assert optimizer.param_groups[0]["lr"] == 0.2  # restored after every update
    apply_update(predictor, optimizer, g1)
    buf1 = 0.9 * g0 + g1  # torch's heavy-ball buffer after two updates (buf0 = g0)
    w2 = torch.tensor([1.0, -2.0]) - 0.1 * g0 - 0.1 * buf1  # steps of η/2 = 0.1
    torch.testing.assert_close(w.detach(), w2)
    forward = predictor.forward_weights(0)
    assert forward is not None  # s = 1 update of η/2 along the buffer
    torch.testing.assert_close(forward[0], w2 - 0.1 * buf1)


def test_staleness_option_resolves_delay_momentum_and_correction() -> None:
    sgd = torch.optim.SGD([make_parameter([1.0])], lr=0.1, momentum=0.9)
    adam = torch.optim.Adam([make_parameter([1.0])], lr=0.1, betas=(0.8, 0.999))

    def scale(mode: str, optimizer: torch.optim.Optimizer, stage: int, stages: int) -> float:
        return make_weight_predictor(
            mode,
            [make_parameter([1.0])],
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


def test_auto_prediction_is_v2_under_adam_or_two_stages_else_none() -> None:
    parameters = [torch.nn.Parameter(torch.zeros(3))]
    sgd = torch.optim.SGD(parameters, lr=0.1, momentum=0.9)
    for stages in (2, 4):
        assert default_prediction(torch.optim.AdamW(parameters), stages) == "v2"
        assert default_prediction(torch.optim.Adam(parameters), stages) == "v2"
    assert default_prediction(sgd, 2) == "v2"
    assert default_prediction(sgd, 4) == "none"
    assert default_prediction(None, 3) == "none"
