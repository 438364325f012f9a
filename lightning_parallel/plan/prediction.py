"""What a plan predicts for one strategy on one cluster, and the traffic it adds up from.

A step is predicted as the bench measures it (``docs/benchmarking.md``): from the end of one
training step to the end of the next, on every rank, and the bench's figure is the *median*
over the ranks' steady steps. Where steps differ (an averaging round every ``H`` steps, a
parameter server's local and remote workers), the plan predicts the distribution's steps and
takes the same median, and gives the mean beside it (the mean decides throughput and time to
accuracy).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from lightning_parallel.plan.network import Transfer

__all__: list[str] = []

MB = 2.0**20


@dataclass
class Traffic:
    """Transfers of one step added up: the seconds a step waits for them, and the bytes one
    host sends (payload and as the interface counts them)."""

    seconds: float = 0.0
    payload_bytes: float = 0.0
    wire_bytes: float = 0.0

    def add(self, transfer: Transfer, times: float = 1.0, waited: bool = True) -> Traffic:
        """Count ``transfer`` ``times`` per step; its time only where the step waits for it."""
        if waited:
            self.seconds += transfer.seconds * times
        self.payload_bytes += transfer.payload_bytes * times
        self.wire_bytes += transfer.wire_bytes * times
        return self

    def add_all(self, transfers: Sequence[Transfer]) -> Traffic:
        """Count each of ``transfers`` once per step, waited for."""
        for transfer in transfers:
            self.add(transfer)
        return self


@dataclass(frozen=True)
class Prediction:
    """One strategy's predicted step on one cluster.

    Attributes:
        spec: the SPEC as given (``diloco:period=32``).
        family: the predictor that computed it (``ddp``, ``averaging``, ...).
        step_s: the median step (the bench's ``step_time_s.median``).
        mean_step_s: the mean step.
        compute_s: forward, backward, optimizer and the trainer's own time in a step.
        exposed_comm_s: communication the mean step waits for (not hidden behind compute).
        bubble_s: pipeline idle time in a step (fill and drain), 0 elsewhere.
        wire_bytes_per_step: bytes one host's interface sends per step (the bench's
            ``wire_bytes_per_step``: hosts' mean).
        payload_bytes_per_step: the same without framing (what the library reports).
        peak_rss_mb: the largest process's peak resident memory, or ``None`` where the
            profile did not measure memory.
        samples_per_s: samples the whole cluster trains per second.
        refused: why the strategy would refuse this model or cluster (then the figures are
            not meaningful), else ``None``.
        detail: the predictor's intermediate figures (rounds, buckets, stage times, ...).
    """

    spec: str
    family: str
    step_s: float
    mean_step_s: float
    compute_s: float
    exposed_comm_s: float
    bubble_s: float
    wire_bytes_per_step: float
    payload_bytes_per_step: float
    peak_rss_mb: float | None
    samples_per_s: float
    refused: str | None = None
    detail: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        """A JSON-ready record."""
        return asdict(self)


@dataclass(frozen=True)
class RunLength:
    """How long the run is whose bytes per step are predicted: the bench divides a run's
    bytes by its steps, so what happens once (a pipeline's link measurement, PowerSGD's first
    uncompressed steps, an averaging's consensus before each validation) counts in proportion.
    ``steps`` ``None``: the steady state alone.

    Attributes:
        steps: training steps of the run.
        epoch_steps: training steps of one epoch on one rank (``None``: not known).
        train_samples: samples of the training set (``None``: not known).
        validation_samples: samples of the validation set (``None``: not known).
        drop_last: the training loader drops an incomplete last batch.
        warmup_steps: each rank's first steps the bench leaves out of its step times and
            samples per second.
    """

    steps: int | None = None
    epoch_steps: int | None = None
    train_samples: int | None = None
    validation_samples: int | None = None
    drop_last: bool = False
    warmup_steps: int = 0

    def per_step(self, once: float) -> float:
        """``once`` (a one-off amount) per step of the run; 0 for the steady state."""
        return once / self.steps if self.steps else 0.0

    def validation_batches(self, replicas: int, batch_size: int) -> int:
        """Batches of one replica's validation (a distributed sampler pads to equal shares)."""
        if not self.validation_samples:
            return 0
        return math.ceil(math.ceil(self.validation_samples / replicas) / batch_size)

    def validations_over(self, replicas: int, batch_size: int) -> int:
        """Validations inside the run where the training set is split over ``replicas`` (a
        pipeline's stages count as one): one at each epoch's end, the run's last step
        included (Lightning validates there before ``fit`` ends; a run stopped by
        ``max_steps`` inside an epoch does not validate)."""
        if not self.steps or not self.train_samples:
            return 0
        share = math.ceil(self.train_samples / replicas)
        epoch = share // batch_size if self.drop_last else math.ceil(share / batch_size)
        return self.steps // epoch if epoch > 0 else 0


STEADY = RunLength()


def refused(spec: str, family: str, reason: str) -> Prediction:
    """A prediction that says only why the strategy would not run."""
    nan = float("nan")
    return Prediction(spec, family, nan, nan, nan, nan, nan, nan, nan, None, nan, refused=reason)


def median_of_steps(steps: list[tuple[float, float]]) -> float:
    """The median of a step distribution given as ``(seconds, share)`` pairs (shares sum to 1):
    the steps sorted, the first whose cumulative share reaches one half."""
    total = 0.0
    for seconds, share in sorted(steps):
        total += share
        if total >= 0.5 - 1e-12:
            return seconds
    return max(seconds for seconds, _ in steps)


def mean_of_steps(steps: list[tuple[float, float]]) -> float:
    """The mean of a step distribution of ``(seconds, share)`` pairs."""
    return sum(seconds * share for seconds, share in steps) / sum(share for _, share in steps)
