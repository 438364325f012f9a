"""Schedule tables: their rows, their drawing (the one in schedule.py's docstring), invariants."""

from __future__ import annotations

import re

import pytest

from lightning_parallel.pipeline import schedule as schedule_module
from lightning_parallel.pipeline.schedule import (
    Action,
    GPipeSchedule,
    OneFOneBSchedule,
    bubble_fraction,
    get_schedule,
    render,
    simulate,
    validate_table,
)

GPIPE_3x4 = """\
stage 0 | F0 F1 F2 F3 .. .. .. .. B0 B1 B2 B3
stage 1 | .. F0 F1 F2 F3 .. .. B0 B1 B2 B3 ..
stage 2 | .. .. F0 F1 F2 F3 B0 B1 B2 B3 .. .."""

ONE_F_ONE_B_3x4 = """\
stage 0 | F0 F1 F2 .. .. B0 F3 B1 .. B2 .. B3
stage 1 | .. F0 F1 .. B0 F2 B1 F3 B2 .. B3 ..
stage 2 | .. .. F0 B0 F1 B1 F2 B2 F3 B3 .. .."""


def _docstring_drawings() -> list[str]:
    doc = schedule_module.__doc__ or ""
    blocks = re.findall(r"((?:    stage \d \|[^\n]*\n)+)", doc)
    return ["\n".join(line.strip() for line in block.strip("\n").splitlines()) for block in blocks]


def test_drawings_in_the_docstring_are_what_render_returns() -> None:
    assert _docstring_drawings() == [GPIPE_3x4, ONE_F_ONE_B_3x4]
    assert render(GPipeSchedule().table(3, 4)) == GPIPE_3x4
    assert render(OneFOneBSchedule().table(3, 4)) == ONE_F_ONE_B_3x4


def test_tables_list_the_expected_actions() -> None:
    F, B = (lambda j: Action("F", j)), (lambda j: Action("B", j))
    assert GPipeSchedule().table(2, 3) == (
        (F(0), F(1), F(2), B(0), B(1), B(2)),
        (F(0), F(1), F(2), B(0), B(1), B(2)),
    )
    assert OneFOneBSchedule().table(3, 4) == (
        (F(0), F(1), F(2), B(0), F(3), B(1), B(2), B(3)),
        (F(0), F(1), B(0), F(2), B(1), F(3), B(2), B(3)),
        (F(0), B(0), F(1), B(1), F(2), B(2), F(3), B(3)),
    )


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize(
    ("stages", "micro_batches"), [(1, 1), (2, 1), (2, 4), (3, 6), (4, 2), (4, 8)]
)
def test_every_table_is_valid_and_has_the_fill_drain_bubble(
    name: str, stages: int, micro_batches: int
) -> None:
    table = get_schedule(name).table(stages, micro_batches)
    validate_table(table, micro_batches)
    expected = (stages - 1) / (micro_batches + stages - 1)
    assert bubble_fraction(table) == pytest.approx(expected)


@pytest.mark.parametrize(("stages", "micro_batches"), [(2, 4), (3, 6), (4, 8), (4, 2)])
def test_1f1b_holds_at_most_p_minus_k_micro_batches(stages: int, micro_batches: int) -> None:
    for stage, row in enumerate(OneFOneBSchedule().table(stages, micro_batches)):
        in_flight = peak = 0
        for action in row:
            in_flight += 1 if action.kind == "F" else -1
            peak = max(peak, in_flight)
        assert peak == min(micro_batches, stages - stage)
    for row in GPipeSchedule().table(stages, micro_batches):
        assert sum(a.kind == "F" for a in row[:micro_batches]) == micro_batches


def test_invalid_tables_are_rejected() -> None:
    with pytest.raises(ValueError, match="exactly once"):
        validate_table(((Action("F", 0),),), 1)
    with pytest.raises(ValueError, match="before F0"):
        validate_table(((Action("B", 0), Action("F", 0)),), 1)
    deadlock = ((Action("F", 0), Action("B", 0)), (Action("B", 0), Action("F", 0)))
    with pytest.raises(ValueError, match="deadlocks"):
        simulate(deadlock)
    with pytest.raises(ValueError, match="schedule must be one of"):
        get_schedule("interleaved")
    with pytest.raises(ValueError, match="micro_batches must be at least 1"):
        GPipeSchedule().table(2, 0)
