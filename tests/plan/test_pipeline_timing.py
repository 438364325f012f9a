"""The replay of a flushing pipeline step (plan.pipeline_timing) against timelines worked out by
hand."""

from __future__ import annotations

import pytest

from lightning_parallel.pipeline.schedule import Action, get_schedule
from lightning_parallel.plan.pipeline_timing import CutLink, StageTimes, flushing_step_seconds

FREE = CutLink(seconds_per_byte=0.0, latency=0.0)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_equal_stages_on_a_free_link_take_m_plus_p_minus_1_slots(schedule: str) -> None:
    table = get_schedule(schedule).table(3, 4)
    stages = [StageTimes(forward=1.0, backward=2.0)] * 3
    ends = flushing_step_seconds(table, stages, [0.0, 0.0], [0.0, 0.0], FREE)
    assert max(ends) == pytest.approx((4 + 3 - 1) * 3.0)
    # stage k ends k slots' backwards before stage 0: the last stage first
    assert ends[2] < ends[1] < ends[0]


def test_a_message_leaves_once_its_receive_is_posted_and_costs_its_latency() -> None:
    """1F1B on 2 stages, 4 micro-batches, 8 ms forward and 16 ms backward, 1 ms a message:
    stage 1 ends its last backward at 111 ms, stage 0 at 128 ms (its receive of micro-batch
    0's gradient is posted at 16 ms, the gradient sent at 33 ms, arrives at 34 ms)."""
    table = get_schedule("1f1b").table(2, 4)
    stages = [StageTimes(forward=0.008, backward=0.016)] * 2
    ends = flushing_step_seconds(
        table, stages, [0.0], [0.0], CutLink(seconds_per_byte=0.0, latency=0.001)
    )
    assert ends == pytest.approx([0.128, 0.111])


def test_the_last_stage_s_deferred_weight_gradients_run_beside_stage_0_s_last_backward() -> None:
    table = get_schedule("1f1b").table(2, 4)
    plain = [StageTimes(1.0, 2.0), StageTimes(1.0, 2.0)]
    (first, last) = flushing_step_seconds(table, plain, [0.0], [0.0], FREE)
    assert (first, last) == pytest.approx((15.0, 13.0))
    # stage 1 computes 1.5 of its backward once at the end: stage 0 still waits for every
    # micro-batch's input gradient, and the flush ends before stage 0's last backward
    deferred = [StageTimes(1.0, 2.0), StageTimes(1.0, 2.0 - 1.5 / 4, deferred=1.5)]
    ends = flushing_step_seconds(table, deferred, [0.0], [0.0], FREE)
    assert max(ends) < first
    assert ends[1] <= ends[0]


def test_a_shaper_s_burst_lets_small_messages_pass_and_queues_the_rest() -> None:
    """One byte a second: four 1-byte activations from a stage that forwards in no time; with
    a 4-byte bucket all pass at once, without one they leave a second apart."""
    row = tuple(Action("F", j) for j in range(4)) + tuple(Action("B", j) for j in range(4))
    table = (row, row)
    stages = [StageTimes(0.0, 0.0), StageTimes(0.0, 0.0)]
    shaped = CutLink(seconds_per_byte=1.0, latency=0.0, burst_bytes=4.0)
    assert max(flushing_step_seconds(table, stages, [1.0], [0.0], shaped)) == pytest.approx(0.0)
    plain = CutLink(seconds_per_byte=1.0, latency=0.0)
    assert max(flushing_step_seconds(table, stages, [1.0], [0.0], plain)) == pytest.approx(4.0)
    # half the bucket: two pass at once, the next two take their seconds
    half = CutLink(seconds_per_byte=1.0, latency=0.0, burst_bytes=2.0)
    assert max(flushing_step_seconds(table, stages, [1.0], [0.0], half)) == pytest.approx(2.0)


def test_a_table_that_cannot_finish_is_refused() -> None:
    backward_first = ((Action("B", 0), Action("F", 0)), (Action("F", 0), Action("B", 0)))
    stages = [StageTimes(1.0, 1.0)] * 2
    with pytest.raises(ValueError, match="deadlocks"):
        flushing_step_seconds(backward_first, stages, [0.0], [0.0], FREE)
    table = get_schedule("1f1b").table(2, 2)
    for forward, backward in (([0.0], []), ([], [0.0]), ([0.0, 0.0], [0.0, 0.0])):
        with pytest.raises(ValueError, match="one message size per cut"):
            flushing_step_seconds(table, stages, forward, backward, FREE)
