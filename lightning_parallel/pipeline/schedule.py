"""Pipeline schedules written as tables: for every stage, the ordered forward/backward actions.

A schedule table for ``p`` stages and ``m`` micro-batches is a tuple of ``p`` rows; row ``k``
lists the actions stage ``k`` runs in one training step, ``Action("F", j)`` (forward of
micro-batch ``j``) or ``Action("B", j)`` (its backward). A stage runs its row in order; a
forward waits for the activation of the previous stage, a backward for the gradient of the next
one. Both schedules here flush: every micro-batch of the step leaves the pipeline before the
optimizer steps, so training is exactly mini-batch SGD.

:func:`render` draws a table by simulating it with unit-time actions (an action starts at the
first tick at which its inputs exist); the drawings below are what :func:`render` returns and a
test asserts them.

GPipe, fill-drain (Huang et al., 2019), 3 stages, 4 micro-batches: all forwards, then all
backwards; each stage keeps the activations of all ``m`` micro-batches, and the bubble (idle
share of the step) is (p-1)/(m+p-1) = 2/6::

    stage 0 | F0 F1 F2 F3 .. .. .. .. B0 B1 B2 B3
    stage 1 | .. F0 F1 F2 F3 .. .. B0 B1 B2 B3 ..
    stage 2 | .. .. F0 F1 F2 F3 B0 B1 B2 B3 .. ..

1F1B, one-forward-one-backward (PipeDream-Flush, Narayanan et al., 2021), same sizes: stage
``k`` runs ``p-k-1`` warm-up forwards, then alternates forward and backward, then drains; the
bubble is the same as GPipe's but stage ``k`` holds at most ``p-k`` micro-batches' activations
instead of ``m``::

    stage 0 | F0 F1 F2 .. .. B0 F3 B1 .. B2 .. B3
    stage 1 | .. F0 F1 .. B0 F2 B1 F3 B2 .. B3 ..
    stage 2 | .. .. F0 B0 F1 B1 F2 B2 F3 B3 .. ..
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import NamedTuple

__all__: list[str] = []


class Action(NamedTuple):
    """One entry of a schedule table: ``kind`` is ``"F"`` (forward) or ``"B"`` (backward)."""

    kind: str
    micro_batch: int

    def __str__(self) -> str:
        return f"{self.kind}{self.micro_batch}"


ScheduleTable = tuple[tuple[Action, ...], ...]


class Schedule(ABC):
    """A flushing pipeline schedule: builds the table of one training step."""

    name: str = ""

    @abstractmethod
    def table(self, stages: int, micro_batches: int) -> ScheduleTable:
        """Actions of every stage for ``micro_batches`` micro-batches on ``stages`` stages."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class GPipeSchedule(Schedule):
    """Fill-drain: every stage runs all forwards, then all backwards in micro-batch order."""

    name = "gpipe"

    def table(self, stages: int, micro_batches: int) -> ScheduleTable:
        _check_sizes(stages, micro_batches)
        row = tuple(Action("F", j) for j in range(micro_batches)) + tuple(
            Action("B", j) for j in range(micro_batches)
        )
        return tuple(row for _ in range(stages))


class OneFOneBSchedule(Schedule):
    """1F1B: ``p-k-1`` warm-up forwards on stage ``k``, then forward/backward alternate.

    Steps for stage ``k`` of ``p`` with ``m`` micro-batches:

    1. warm-up: forwards ``0 .. w-1`` with ``w = min(p-k-1, m)``;
    2. steady state: for ``i = 0 .. m-w-1``: forward ``w+i``, then backward ``i``;
    3. cool-down: backwards ``m-w .. m-1``.
    """

    name = "1f1b"

    def table(self, stages: int, micro_batches: int) -> ScheduleTable:
        _check_sizes(stages, micro_batches)
        rows = []
        for stage in range(stages):
            warmup = min(stages - stage - 1, micro_batches)
            row = [Action("F", j) for j in range(warmup)]
            for i in range(micro_batches - warmup):
                row += [Action("F", warmup + i), Action("B", i)]
            row += [Action("B", j) for j in range(micro_batches - warmup, micro_batches)]
            rows.append(tuple(row))
        return tuple(rows)


SCHEDULES: dict[str, type[Schedule]] = {"gpipe": GPipeSchedule, "1f1b": OneFOneBSchedule}


def get_schedule(name: str | Schedule) -> Schedule:
    """The schedule called ``name`` (``"gpipe"`` or ``"1f1b"``), or ``name`` itself."""
    if isinstance(name, Schedule):
        return name
    key = name.lower()
    if key not in SCHEDULES:
        raise ValueError(f"schedule must be one of {sorted(SCHEDULES)}, got {name!r}")
    return SCHEDULES[key]()


def _check_sizes(stages: int, micro_batches: int) -> None:
    if stages < 1:
        raise ValueError(f"stages must be at least 1, got {stages}")
    if micro_batches < 1:
        raise ValueError(f"micro_batches must be at least 1, got {micro_batches}")


def validate_table(table: ScheduleTable, micro_batches: int) -> None:
    """Check that every stage runs each forward and backward once, each forward first.

    Raises:
        ValueError: naming the stage and the faulty action.
    """
    expected = {Action(kind, j) for kind in "FB" for j in range(micro_batches)}
    for stage, row in enumerate(table):
        if len(row) != len(set(row)) or set(row) != expected:
            raise ValueError(
                f"stage {stage} must run F and B of micro-batches 0..{micro_batches - 1} exactly "
                f"once each, got {[str(a) for a in row]}"
            )
        for position, action in enumerate(row):
            if action.kind == "B" and Action("F", action.micro_batch) not in row[:position]:
                raise ValueError(f"stage {stage} runs {action} before F{action.micro_batch}")


def simulate(table: ScheduleTable) -> list[list[Action | None]]:
    """Run ``table`` with unit-time actions; cell ``[k][t]`` is stage ``k``'s action at tick ``t``.

    A forward on stage ``k`` needs the same forward done on stage ``k-1``; a backward needs its
    own forward and the same backward done on stage ``k+1``. Each stage runs its row in order.

    Raises:
        ValueError: the table deadlocks (an action waits for one that can never run).
    """
    stages = len(table)
    done: dict[tuple[int, Action], int] = {}
    position = [0] * stages
    grid: list[list[Action | None]] = [[] for _ in range(stages)]
    tick = 0
    while any(position[k] < len(table[k]) for k in range(stages)):
        progressed = False
        ran: list[tuple[int, Action]] = []
        for stage in range(stages):
            if position[stage] >= len(table[stage]):
                grid[stage].append(None)
                continue
            action = table[stage][position[stage]]
            needs = []
            if action.kind == "F" and stage > 0:
                needs.append((stage - 1, action))
            if action.kind == "B":
                needs.append((stage, Action("F", action.micro_batch)))
                if stage < stages - 1:
                    needs.append((stage + 1, action))
            if all(need in done and done[need] < tick for need in needs):
                grid[stage].append(action)
                ran.append((stage, action))
                position[stage] += 1
                progressed = True
            else:
                grid[stage].append(None)
        for key in ran:
            done[key] = tick
        if not progressed:  # nothing new can become ready: every later tick looks the same
            stuck = {
                k: str(table[k][position[k]]) for k in range(stages) if position[k] < len(table[k])
            }
            raise ValueError(f"schedule deadlocks: stages wait forever at {stuck}")
        tick += 1
    return grid


def render(table: ScheduleTable) -> str:
    """Draw ``table`` as the ASCII grid of :func:`simulate` (``..`` marks an idle tick)."""
    grid = simulate(table)
    width = max((len(str(a)) for row in grid for a in row if a is not None), default=2)
    lines = []
    for stage, row in enumerate(grid):
        cells = [(str(a) if a is not None else "..").ljust(width) for a in row]
        lines.append(f"stage {stage} | " + " ".join(cells).rstrip())
    return "\n".join(lines)


def bubble_fraction(table: ScheduleTable) -> float:
    """Idle share of the stage-ticks of :func:`simulate` (unit-time forward and backward)."""
    grid = simulate(table)
    total = sum(len(row) for row in grid)
    idle = sum(1 for row in grid for cell in row if cell is None)
    return idle / total
