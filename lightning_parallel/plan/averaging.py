"""Predict the model-averaging strategies: ``model_averaging``/``local_sgd``, ``bmuf``, ``easgd``,
``diloco`` and streaming DiLoCo.

A replica steps on its own (``local`` = the profile's step, no gradient allreduce) and, with
the loss rules on (``rollback_on_spike``, the default; EASGD where it keeps its center to roll
back to), all-reduces its 8-byte loss every step. Every ``H`` steps (``period``) a round
averages the replicas:

- ``F`` fragments (``fragments``) each end a round every ``H`` steps at staggered phases, so a
  period holds ``F`` rounds of ``P/F`` bytes (``P``: parameter bytes);
- a round sends its fragment as an allreduce in ``fp32`` or at half the bytes in
  ``bf16``/``fp16``; ``int8`` and ``int4`` codes cannot be summed on the wire, so they are
  all-gathered (``(W − 1)·P/4`` and ``(W − 1)·P/8`` bytes a rank, block scales aside); the
  floating-point buffers (BatchNorm's statistics, ``buffers="average"``) are averaged with it
  in full precision;
- the round's work on the core (copies of the replica and the agreed point, the outer
  optimizer's step) is taken as one optimizer step for plain averaging and EASGD, two for an
  outer optimizer (DiLoCo, BMUF);
- with ``sync_delay = d`` the round's transfer runs behind the next ``d`` local steps and only
  what exceeds them is waited for.

So ``F`` steps of every ``H`` carry a round and the others are local: the median step is the
local step when rounds are fewer than half the steps (the bench's median), the mean adds
``F/H`` of a round, or over a run of given length the rounds its training steps run
(:func:`step_rounds`: a 30-step run of ``period=16`` runs one round, not 30/16; one due at an
epoch's last step runs before the validation, outside the steps).
"""

from __future__ import annotations

from typing import Any

from lightning_parallel.plan.memory import (
    EXTRA_PARAMETER_COPIES,
    PREVIOUS_POINT_COPIES,
    peak_rss_mb,
)
from lightning_parallel.plan.network import (
    Cluster,
    Transfer,
    all_gather,
    all_reduce,
    step_flag,
)
from lightning_parallel.plan.prediction import (
    STEADY,
    Prediction,
    RunLength,
    Traffic,
    mean_of_steps,
    median_of_steps,
)
from lightning_parallel.plan.profile import StepProfile

__all__: list[str] = []

#: bytes per float32 value that a round sends, by ``outer_dtype``
_CODE_FRACTION = {"fp32": 1.0, "bf16": 0.5, "fp16": 0.5, "int8": 0.25, "int4": 0.125}
_OUTER = ("outer_optimizer", "bmuf")


def round_transfer(cluster: Cluster, nbytes: float, dtype: str) -> Transfer:
    """One round's exchange of ``nbytes`` of float32 values in ``dtype`` (see above)."""
    fraction = _CODE_FRACTION.get(dtype, 1.0)
    if dtype in ("int8", "int4"):
        return all_gather(cluster, nbytes * fraction)
    return all_reduce(cluster, nbytes * fraction)


def _joined(first: Transfer, second: Transfer) -> Transfer:
    """Two exchanges of one round, one after the other."""
    return Transfer(
        first.seconds + second.seconds,
        first.payload_bytes + second.payload_bytes,
        first.wire_bytes + second.wire_bytes,
        first.messages + second.messages,
    )


def _rounds_in(steps: int, period: int, fragments: int) -> int:
    """Fragment rounds in ``steps`` local steps from a fresh schedule: fragment ``f`` ends one
    at step ``round((f + 1)·H/F)`` and every ``H`` steps after."""
    phases = [round((f + 1) * period / fragments) for f in range(fragments)]
    return sum((steps - phase) // period + 1 for phase in phases if phase <= steps)


def round_counts(run: RunLength, period: int, fragments: int) -> float:
    """Fragment rounds per step (a fragment round sends ``P/F`` bytes).

    Steady state: ``F/H``. Over a run of ``N`` steps with epochs of ``E`` steps, before each
    validation (``before_validation="round"``, the default) the replicas agree, and the
    schedule starts again after it:

    - unfragmented: one round, unless the epoch's last step ended one;
    - fragmented: a round of every fragment (``F`` fragment rounds) whenever a step was taken
      since the phases started, which is every epoch (measured: streaming DiLoCo on ``gpt``,
      40 steps, epochs of 32 and 16 on 4 and 8 hosts: 13 and 17 fragment rounds' bytes
      counted, where 9 were counted without them);
    - EASGD's replicas differ after a round, but an exact whole-model round gives their mean
      (:meth:`~lightning_parallel.averaging.Averager.mean_of_restarts`): nothing more is sent
      (streamed or quantized, see :func:`validation_means`).

    A round due at the run's last step, and the average at the end of ``fit``, come after the
    bench reads the interface counter, so they are not counted (measured: ``model_averaging``
    on ``vgg_mini``, 30 steps, epochs of 22: 3 rounds, 5.166 MB a step, not 4).
    """
    if not run.steps:
        return fragments / period
    epoch = run.epoch_steps or run.steps + 1
    total, left = 0, run.steps
    while left > epoch:
        total += _rounds_in(epoch, period, fragments)
        if fragments > 1:
            total += fragments
        else:
            total += 1 if epoch % period else 0
        left -= epoch
    # a round that ends with the run's last step is exchanged after the bench reads the counter
    total += _rounds_in(left - 1, period, fragments)
    return total / run.steps


def validation_means(run: RunLength) -> float:
    """Validations per step that exchange the replicas' mean in full precision: EASGD's with
    streamed or quantized rounds (unless ``before_validation="global"``, which validates the
    agreed points), after which the replicas differ and the round's own mean does not give
    theirs (one per validated epoch ended before the run's last step; measured
    before exact rounds gave it: 10 and 11 rounds' bytes in 40 steps of period 4 on 4 and 8
    hosts, 9 rounds each and 1 and 2 validations in epochs of 32 and 16)."""
    if not run.steps or not run.epoch_steps:
        return 0.0
    return ((run.steps - 1) // run.epoch_steps) / run.steps


def step_rounds(run: RunLength, period: int, fragments: int) -> float:
    """Fragment rounds run inside the bench's counted training steps, per counted step: what
    a step's time carries.

    Steady state ``F/H``. Over a run: a round due after step ``s`` runs as step ``s + 1``
    starts (the strategy's ``on_train_batch_start``), so only rounds with a training step
    after them in the same stretch count. The round due at a validated epoch's last step runs
    before the validation instead (``on_validation_start``, outside the steps) and the
    schedule starts afresh after it; the round due at the run's last
    step runs at the end of ``fit``. The bench leaves each rank's first ``warmup_steps`` out of
    its rates, and the rounds run in them. As in :func:`round_counts`, a run whose epoch length
    is known validates every epoch (the bench does), with the default
    ``before_validation="round"``; ``sync_delay`` is not counted here (a round it delays past an
    epoch's end waits outside the steps). Measured: timm's ViT-Tiny on 2 hosts at 100 Mbit/s,
    ``diloco`` (``period=16``, epochs of 32, 100 steps): 3.2 rounds' time inside the steps of
    the 6 rounds exchanged, where counting every round an epoch's steps end predicted 329
    samples/s against 444 measured.
    """
    if not run.steps:
        return fragments / period
    stretch = run.epoch_steps or run.steps
    warmup = min(run.warmup_steps, run.steps - 1)
    phases = [round((f + 1) * period / fragments) for f in range(fragments)]
    counted, start = 0, 0
    while start < run.steps:
        length = min(stretch, run.steps - start)
        for phase in phases:
            # due after the stretch's step ``due``; it runs in the next step, if one follows
            counted += sum(start + due >= warmup for due in range(phase, length, period))
        start += length
    return counted / (run.steps - warmup)


def predict_averaging(
    spec: str,
    profile: StepProfile,
    cluster: Cluster,
    options: dict[str, Any],
    run: RunLength = STEADY,
) -> Prediction:
    """One averaging strategy with its options (the registered defaults merged in)."""
    algorithm = str(options.get("algorithm", "periodic"))
    period = max(1, int(options.get("period", 8)))
    fragments = max(1, int(options.get("fragments") or 1))
    delay = int(options.get("sync_delay") or (1 if options.get("overlap") else 0))
    dtype = str(options.get("outer_dtype") or "fp32")
    # the loss rules' all-reduce each local step: one slot and one presence flag per replica
    # with the collapse rule (every algorithm), else the mean alone (EASGD only where it keeps
    # its center to roll back to on a regression: whole-model full-precision rounds applied at
    # once, the regression rule on); the rare replacements and roll-backs are not predicted
    per_replica = bool(options.get("replace_collapsed", True))
    whole_rounds = (
        fragments == 1 and dtype == "fp32" and options.get("before_validation") != "global"
    )
    mean_only = bool(options.get("rollback_on_spike", True)) and (
        algorithm != "easgd"
        or (whole_rounds and delay == 0 and options.get("spike_regression", 1.0) is not None)
    )
    loss_bytes = 16.0 * cluster.world if per_replica else 8.0 if mean_only else 0.0
    # the trainer's SIGTERM flag before every batch (plan.network.step_flag)
    flag = step_flag(cluster)
    traffic = Traffic().add(flag)
    local = profile.step_s + flag.seconds
    if loss_bytes:
        loss = all_reduce(cluster, loss_bytes, element_bytes=8)
        traffic.add(loss)
        local += loss.seconds
    # the floating-point buffers (BatchNorm's statistics) are averaged with the parameters,
    # in full precision (``buffers="average"``, the default)
    buffers = profile.float_buffer_bytes if options.get("buffers", "average") == "average" else 0
    if dtype == "fp32":  # one flat buffer of both
        transfer = round_transfer(cluster, (profile.parameter_bytes + buffers) / fragments, dtype)
    else:
        transfer = round_transfer(cluster, profile.parameter_bytes / fragments, dtype)
        if buffers:
            transfer = _joined(transfer, all_reduce(cluster, buffers / fragments))
    traffic.add(transfer, times=round_counts(run, period, fragments), waited=False)
    if (
        algorithm == "easgd"
        and (fragments > 1 or dtype != "fp32")
        and options.get("before_validation") != "global"  # it validates the agreed points
    ):
        # its replicas differ after a streamed or quantized round: a validation's mean
        model = all_reduce(cluster, profile.parameter_bytes + buffers)
        traffic.add(model, times=validation_means(run), waited=False)
    work = profile.optimizer_s * (2.0 if algorithm in _OUTER else 1.0) / fragments
    waited = max(0.0, transfer.seconds - delay * local)
    round_step = local + work + waited
    share = min(1.0, fragments / period)
    steps = [(local, 1.0 - share), (round_step, share)]
    # the mean over the run's own steps: a run shorter than a few periods holds fewer rounds
    # (or none) than the steady share says
    within = min(1.0, step_rounds(run, period, fragments))
    mean = mean_of_steps([(local, 1.0 - within), (round_step, within)])
    copies = EXTRA_PARAMETER_COPIES.get(algorithm, EXTRA_PARAMETER_COPIES["periodic"])
    if whole_rounds and mean_only:
        copies += PREVIOUS_POINT_COPIES.get(algorithm, 0.0)
    extra_bytes = copies * profile.parameter_bytes
    return Prediction(
        spec=spec,
        family="averaging",
        step_s=median_of_steps(steps),
        mean_step_s=mean,
        compute_s=profile.step_s + within * work,
        exposed_comm_s=mean - profile.step_s - within * work,
        bubble_s=0.0,
        wire_bytes_per_step=traffic.wire_bytes,
        payload_bytes_per_step=traffic.payload_bytes,
        peak_rss_mb=peak_rss_mb(profile, extra_bytes),
        samples_per_s=cluster.world * profile.batch_size / mean,
        detail={
            "period": period,
            "fragments": fragments,
            "round_s": transfer.seconds,
            "local_step_s": local,
            "round_step_s": round_step,
        },
    )
