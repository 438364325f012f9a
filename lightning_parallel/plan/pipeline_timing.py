"""The length of one flushing pipeline step, replayed operation by operation.

A closed form (fill, then ``m − 1`` slots of the slowest stage) charges every stage its whole
backward in the fill and every cut its transfer at full length. Measured on timelines of the
bench's runs (``vgg_mini`` at 100 Mbit/s, 2 stages, 4 micro-batches) the step is shorter:

- the last stage computes its linear layers' weight gradients once, after its last backward
  (:mod:`~lightning_parallel.pipeline.weight_grad`): 20 ms there, while stage 0 runs its own
  last backward beside it, so only the longer of the two counts;
- an activation of 64 kB fits the token bucket the link refilled during a micro-batch, and
  passes at once (the bench's shaped hosts; a real link has no bucket);
- a message between neighbours costs the point-to-point latency (0.2-0.3 ms there), not a
  collective's round (1.2 ms).

:func:`flushing_step_seconds` replays a schedule table
(:mod:`~lightning_parallel.pipeline.schedule`) with each operation's time: a stage runs its
actions in order, a forward of micro-batch ``j`` on stage ``k`` once stage ``k − 1``'s forward
of ``j`` has crossed the cut, a backward once stage ``k + 1``'s backward of ``j`` has crossed
back. A receive blocks and is posted when the stage reaches it, and a gloo send starts only
once its receive is posted: a message leaves at ``max(sent, posted + L)``, crosses the link
after the direction's earlier messages, through the shaper's token bucket where there is one,
and arrives ``L`` later. After its last backward a stage runs its deferred weight gradients.
Plain Python, no torch.

Not modelled: the shaper is per host (one queue a host and direction), where the replay keeps
one bucket per cut and direction, so a middle stage of 3 or more across hosts gets its two
cuts' bursts; and a receive's notice that queues behind a gradient its stage is sending (the
no-flush pipeline's law counts it, :mod:`~lightning_parallel.plan.spectrain`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from lightning_parallel.pipeline.schedule import ScheduleTable

__all__: list[str] = []


@dataclass(frozen=True)
class StageTimes:
    """One stage's operations, in seconds: a micro-batch's forward, its backward without the
    deferred weight gradients, and the deferred weight gradients of the whole step."""

    forward: float
    backward: float
    deferred: float = 0.0


@dataclass(frozen=True)
class CutLink:
    """The link a cut's messages cross: ``seconds_per_byte`` on the wire (framing counted),
    one-way ``latency`` of a message, and the ``burst_bytes`` of a token-bucket shaper (the
    bench's simulated hosts; 0 for a real link)."""

    seconds_per_byte: float
    latency: float
    burst_bytes: float = 0.0


class _Bucket:
    """One direction of a cut: messages one after the other through a token bucket that
    starts full (it refilled while the link idled between steps)."""

    def __init__(self, link: CutLink) -> None:
        self.rate = 1.0 / link.seconds_per_byte if link.seconds_per_byte > 0 else float("inf")
        self.burst = link.burst_bytes
        self.tokens = link.burst_bytes
        self.free = 0.0

    def send(self, start: float, nbytes: float) -> float:
        """When a message of ``nbytes`` that may leave at ``start`` has left."""
        start = max(start, self.free)
        self.tokens = min(self.burst, self.tokens + (start - self.free) * self.rate)
        passed = min(self.tokens, nbytes)
        self.tokens -= passed
        self.free = start + (nbytes - passed) / self.rate
        return self.free


def flushing_step_seconds(
    table: ScheduleTable,
    stages: Sequence[StageTimes],
    forward_bytes: Sequence[float],
    backward_bytes: Sequence[float],
    link: CutLink,
) -> list[float]:
    """When each stage ends its step (its last backward and its deferred weight gradients),
    from the step's start.

    Args:
        table: the schedule's actions of every stage.
        stages: each stage's times.
        forward_bytes: per cut, an activation's bytes.
        backward_bytes: per cut, a gradient's bytes (0: none crosses back over an integer
            cut; the replay still charges the message's latency, an upper bound).
        link: the link every cut crosses.

    Raises:
        ValueError: the table and the times disagree, or the table deadlocks.
    """
    count = len(table)
    if len(stages) != count or {len(forward_bytes), len(backward_bytes)} != {count - 1}:
        raise ValueError("one StageTimes per stage and one message size per cut are needed")
    free = [0.0] * count
    position = [0] * count
    forward_end: list[dict[int, float]] = [{} for _ in range(count)]
    backward_end: list[dict[int, float]] = [{} for _ in range(count)]
    ahead = [_Bucket(link) for _ in range(count - 1)]
    back = [_Bucket(link) for _ in range(count - 1)]

    def arrival(bucket: _Bucket, sent: float, posted: float, nbytes: float) -> float:
        return bucket.send(max(sent, posted + link.latency), nbytes) + link.latency

    moved = True
    while moved:
        moved = False
        for k in range(count):
            while position[k] < len(table[k]):
                action = table[k][position[k]]
                j = action.micro_batch
                if action.kind == "F":
                    if k == 0:
                        start = free[k]
                    elif j in forward_end[k - 1]:
                        sent = forward_end[k - 1][j]
                        start = arrival(ahead[k - 1], sent, free[k], forward_bytes[k - 1])
                    else:
                        break
                    free[k] = forward_end[k][j] = start + stages[k].forward
                else:
                    if k == count - 1:
                        start = max(free[k], forward_end[k][j])
                    elif j in backward_end[k + 1]:
                        sent = backward_end[k + 1][j]
                        start = arrival(back[k], sent, free[k], backward_bytes[k])
                    else:
                        break
                    free[k] = backward_end[k][j] = start + stages[k].backward
                position[k] += 1
                moved = True
    if any(position[k] < len(table[k]) for k in range(count)):
        raise ValueError("the schedule table deadlocks")
    return [free[k] + stages[k].deferred for k in range(count)]
