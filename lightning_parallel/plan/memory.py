"""Predict a rank's peak resident memory from the profile's one-process run.

The profile's ``fit`` runs under ``ddp`` on one process (:mod:`lightning_parallel.bench.plan`):
its peak holds the interpreter and libraries, the data, the model's parameters, gradients and
optimizer state, the activations of one batch, and DDP's gradient buckets (one more copy of
the gradients). A strategy's peak is that peak plus what the strategy holds besides, in bytes
of the parameters ``P``, minus what it does without:

- the data-parallel strategies with a codec, model averaging and the parameter server: copies
  of the flat parameters (residuals, the agreed point, exchange buffers, an outer optimizer's
  state, the server's weights and state), :data:`EXTRA_PARAMETER_COPIES` of them;
- a pipeline stage (no DDP wrapper): the one-process peak less the whole model's state and
  activations, plus its share of the parameters, gradients and optimizer state and the
  activations of the micro-batches it holds in flight.
"""

from __future__ import annotations

from lightning_parallel.plan.profile import StepProfile

__all__: list[str] = []

MB = 2.0**20


#: what each family's largest process holds beyond the one-process ``ddp`` peak, in bytes of
#: the parameters ``P``. Measured, not derived: the bench's peak resident memory of each
#: strategy less its ``ddp`` run's, over ``P``, on ``vgg_mini`` (2 hosts, 40 steps at
#: 100 Mbit/s, ``P`` = 51.5 MB, a ``ddp`` peak of 747 MB): copies of the flat parameters that
#: the implementations keep (the agreed point, exchange buffers, residuals) and what the
#: allocator keeps of freed buffers of that size. They are checked on the other models
#: (``docs/choosing.md``), not fitted to them.
EXTRA_PARAMETER_COPIES = {
    "ddp": 0.0,
    "ddp_powersgd": 4.2,
    "hylo": 4.7,
    "periodic": 4.85,
    "outer_optimizer": 6.9,
    "bmuf": 6.9,
    "easgd": 5.85,
    "parameter_server": 5.9,
}

#: what unfragmented full-precision averaging with the roll-back on holds on top: the point
#: before a round, kept until a step from the round has shown it healthy. Measured as above,
#: the package before and after that change: +0.80 ``P`` (periodic), +1.44 (DiLoCo), +1.49
#: (BMUF); EASGD, whose center is kept after each round applied at once since it goes back
#: there on a regression (it had kept one unused copy of the starting point): +0.95 (median
#: of 6 runs, 3 seeds, ``easgd`` and ``easgd:period=4``); streaming or quantized rounds keep
#: no second point.
PREVIOUS_POINT_COPIES = {"periodic": 0.8, "outer_optimizer": 1.45, "bmuf": 1.5, "easgd": 0.95}


def peak_rss_mb(profile: StepProfile, extra_bytes: float) -> float | None:
    """The one-process peak plus ``extra_bytes`` (negative: less), in MiB; ``None`` where the
    profile measured no memory."""
    if profile.peak_rss_bytes is None:
        return None
    return (profile.peak_rss_bytes + extra_bytes) / MB


def model_state_bytes(profile: StepProfile) -> float:
    """Parameters, gradients and optimizer state of the whole model."""
    return 2.0 * profile.parameter_bytes + profile.optimizer_state_bytes
