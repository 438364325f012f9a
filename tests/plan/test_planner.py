"""The predictors' laws on a hand-made profile: what each family adds to a step, and bytes."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from lightning_parallel.pipeline.profile import LayerCost
from lightning_parallel.plan.averaging import round_counts
from lightning_parallel.plan.memory import EXTRA_PARAMETER_COPIES, PREVIOUS_POINT_COPIES
from lightning_parallel.plan.network import (
    Cluster,
    Link,
    all_gather,
    all_reduce,
    send,
    step_flag,
)
from lightning_parallel.plan.planner import DEFAULT_SPECS, PREDICTORS, predict, ranked, scaling
from lightning_parallel.plan.prediction import RunLength, median_of_steps
from lightning_parallel.plan.profile import LayerProfile, ParameterShape, StepProfile

MB = 2**20


def _profile(layers: bool = True) -> StepProfile:
    """Four equal layers of 1 MB of parameters, 10 ms forward and 20 ms backward each (per
    whole batch of 32; half that per micro-batch of 8 is not linear on purpose: 4 ms / 8 ms)."""

    def chain(forward: float, backward: float, output: int) -> tuple[LayerCost, ...]:
        return tuple(LayerCost(forward, backward, 4 * output, output, MB) for _ in range(4))

    profiles = (
        LayerProfile(32, chain(0.010, 0.020, 64_000), 4_000),
        LayerProfile(8, chain(0.004, 0.008, 16_000), 1_000),
    )
    return StepProfile(
        batch_size=32, forward_s=0.040, backward_s=0.080, optimizer_s=0.010,
        parameters=tuple(ParameterShape(f"w{i}", (512, 512)) for i in range(4)),
        optimizer_state_bytes=4 * MB, activation_bytes=1_000_000, trainer_step_s=0.150,
        peak_rss_bytes=500 * MB, layer_profiles=profiles if layers else (),
    )  # fmt: skip


def _cluster(bandwidth: str = "100mbit", hosts: int = 2) -> Cluster:
    return Cluster.parse(hosts=hosts, processes_per_host=1, bandwidth=bandwidth, latency="1ms")


def _one(spec: str, profile: StepProfile, cluster: Cluster, **options: object):
    name = spec.partition(":")[0]
    (prediction,) = predict(profile, cluster, [(spec, name, dict(options))])
    assert prediction.refused is None, prediction.refused
    return prediction


def test_ddp_without_layer_times_waits_for_the_whole_allreduce() -> None:
    profile, cluster = _profile(layers=False), _cluster()
    transfer, flag = all_reduce(cluster, 4 * MB), step_flag(cluster)
    ddp = _one("ddp", profile, cluster)
    # the trainer's SIGTERM flag before every batch: waited for, its bytes counted
    assert ddp.step_s == pytest.approx(profile.step_s + transfer.seconds + flag.seconds)
    assert ddp.wire_bytes_per_step == pytest.approx(transfer.wire_bytes + flag.wire_bytes)
    assert ddp.peak_rss_mb == pytest.approx(500.0)


def test_a_token_bucket_burst_passes_at_once_after_the_compute() -> None:
    """The simulated hosts' shaper: 70 kB refilled while the link idled pass at once, 56 ms
    at 10 Mbit/s; at most what the compute's idle link refilled."""
    profile = _profile(layers=False)
    plain = Cluster.parse(2, 1, "10mbit", "0")
    shaped = Cluster.parse(2, 1, "10mbit", "0", burst_bytes=70_000)
    saved = _one("ddp", profile, plain).step_s - _one("ddp", profile, shaped).step_s
    assert saved == pytest.approx(70_000 / 1.25e6)
    assert shaped.inter.burst_seconds(0.01) == pytest.approx(0.01)


def test_ddp_overlaps_buckets_with_backward_on_a_fast_link() -> None:
    profile = _profile()
    slow = _one("ddp", profile, _cluster("100mbit"))
    fast = _one("ddp", profile, _cluster("100gbit"))
    # on a fast link only the last bucket's allreduce after backward shows
    assert fast.exposed_comm_s < 0.01 < slow.exposed_comm_s
    assert fast.wire_bytes_per_step == pytest.approx(slow.wire_bytes_per_step)
    fp16 = _one("ddp_fp16", profile, _cluster(), compression_ratio=2.0)
    assert fp16.payload_bytes_per_step == pytest.approx(slow.payload_bytes_per_step / 2, rel=0.01)


def test_averaging_median_is_the_local_step_and_rounds_are_counted() -> None:
    profile, cluster = _profile(), _cluster()
    averaging = _one("model_averaging", profile, cluster, algorithm="periodic", period=8)
    # each local step's loss: one slot and one presence flag per replica (replace_collapsed)
    loss = all_reduce(cluster, 16.0 * cluster.world, element_bytes=8)
    flag = step_flag(cluster)  # the trainer's SIGTERM flag before every batch
    assert averaging.step_s == pytest.approx(profile.step_s + loss.seconds + flag.seconds)
    mean_only = _one(
        "model_averaging", profile, cluster, algorithm="periodic", period=8,
        replace_collapsed=False,
    )  # fmt: skip
    mean_loss = all_reduce(cluster, 8.0, element_bytes=8)
    assert mean_only.step_s == pytest.approx(profile.step_s + mean_loss.seconds + flag.seconds)
    # EASGD watches the mean where it keeps its center to go back to: not with delayed rounds
    easgd = _one("easgd", profile, cluster, algorithm="easgd", period=8, replace_collapsed=False)
    assert easgd.step_s == pytest.approx(profile.step_s + mean_loss.seconds + flag.seconds)
    unwatched = _one(
        "easgd", profile, cluster, algorithm="easgd", period=8, replace_collapsed=False,
        sync_delay=2,
    )  # fmt: skip
    assert unwatched.step_s == pytest.approx(profile.step_s + flag.seconds)
    for options in ({"overlap": True}, {"spike_regression": None}):  # late rounds; spikes only
        alike = _one(
            "easgd", profile, cluster, algorithm="easgd", period=8, replace_collapsed=False,
            **options,
        )  # fmt: skip
        assert alike.step_s == pytest.approx(profile.step_s + flag.seconds)
    model = all_reduce(cluster, profile.parameter_bytes)
    assert averaging.wire_bytes_per_step == pytest.approx(
        model.wire_bytes / 8 + loss.wire_bytes + flag.wire_bytes
    )
    assert averaging.mean_step_s > averaging.step_s
    # int8 codes are all-gathered: a quarter of the values' bytes
    streaming = _one(
        "diloco:int8", profile, cluster, algorithm="outer_optimizer", period=16, fragments=4,
        sync_delay=4, outer_dtype="int8",
    )  # fmt: skip
    gathered = all_gather(cluster, profile.parameter_bytes / 4 / 4)
    assert streaming.wire_bytes_per_step == pytest.approx(
        4 / 16 * gathered.wire_bytes + loss.wire_bytes + flag.wire_bytes
    )


def test_round_counts_over_a_run() -> None:
    assert round_counts(RunLength(), 8, 1) == 1 / 8
    # the bench's vgg_mini runs (40 steps, epochs of 22): H = 8 rounds at 8, 16, 22 (the
    # validation's), then 8 and 16 steps later; H = 16 at 16, 22 and 16 steps later
    assert round_counts(RunLength(steps=40, epoch_steps=22), 8, 1) == 5 / 40
    assert round_counts(RunLength(steps=40, epoch_steps=22), 16, 1) == 3 / 40
    # 30 steps: the round due at step 30 is not counted (8, 16, 22)
    assert round_counts(RunLength(steps=30, epoch_steps=22), 8, 1) == 3 / 30
    # an epoch ending on a round needs no extra one
    assert round_counts(RunLength(steps=32, epoch_steps=16), 8, 1) == 3 / 32
    # 4 fragments of H = 16 end rounds at 4, 8, 12, 16, ... (not at the last step, 32)
    assert round_counts(RunLength(steps=32), 16, 4) == 7 / 32
    # fragmented, every validation runs a round of every fragment, then the phases restart:
    # 40 steps in epochs of 32 (streaming DiLoCo on gpt, 4 hosts) are 8 + 4 + 1 rounds
    assert round_counts(RunLength(steps=40, epoch_steps=32), 16, 4) == 13 / 40
    assert round_counts(RunLength(steps=40, epoch_steps=32), 4, 1) == 9 / 40


def test_easgd_s_validations_exchange_only_where_its_rounds_are_quantized() -> None:
    """Exact EASGD rounds give the replicas' mean after them: a validation sends nothing more
    than the round before it (as periodic averaging); after streamed or quantized ones each
    validation exchanges the mean in full precision (one in 40 steps of epochs of 32)."""
    profile, cluster, run = _profile(), _cluster(), RunLength(steps=40, epoch_steps=32)

    def wire(spec: str, **options: object) -> float:
        name = spec.partition(":")[0]
        (prediction,) = predict(profile, cluster, [(spec, name, dict(options))], run)
        return prediction.wire_bytes_per_step

    common = {"period": 4, "replace_collapsed": False, "rollback_on_spike": False}
    periodic = wire("model_averaging", algorithm="periodic", **common)
    assert wire("easgd", algorithm="easgd", **common) == pytest.approx(periodic)
    quantized = {**common, "outer_dtype": "int8"}
    extra = all_reduce(cluster, profile.parameter_bytes).wire_bytes / 40  # one validation
    assert wire("easgd", algorithm="easgd", **quantized) == pytest.approx(
        wire("model_averaging", algorithm="periodic", **quantized) + extra
    )
    streamed = {**common, "period": 8, "fragments": 2}
    assert wire("easgd", algorithm="easgd", **streamed) == pytest.approx(
        wire("model_averaging", algorithm="periodic", **streamed) + extra
    )
    # before_validation="global" validates the fragments' agreed points: no mean is exchanged
    agreed = {**streamed, "before_validation": "global"}
    assert wire("easgd", algorithm="easgd", **agreed) == pytest.approx(
        wire("model_averaging", algorithm="periodic", **agreed)
    )


def test_the_parameter_server_mixes_fast_local_and_slow_remote_steps() -> None:
    profile, cluster = _profile(), _cluster()
    ps = _one("parameter_server", profile, cluster)
    remote = ps.detail["remote_worker_step_s"]
    transfer = send(cluster, profile.parameter_bytes)
    assert remote == pytest.approx(
        profile.step_s - profile.optimizer_s + 2 * transfer.seconds + profile.optimizer_s
    )
    # the server's worker steps more often: it holds the median
    assert ps.step_s == pytest.approx(ps.detail["server_worker_step_s"])
    assert ps.step_s < ps.mean_step_s < remote


def test_the_parameter_server_s_vectors_pass_a_burst_through_a_refilled_token_bucket() -> None:
    """On the bench's shaped links each direction idles between a remote worker's exchanges,
    so each of its two vectors passes the bucket's burst at once (``gpt`` at 10 Mbit/s: an
    exchange of 0.845 s where the vectors' bytes take 0.919 s)."""
    profile = _profile()
    plain = _one("parameter_server", profile, _cluster("10mbit"))
    bucket = Cluster.parse(2, 1, "10mbit", "1ms", burst_bytes=70_000)
    shaped = _one("parameter_server", profile, bucket)
    saved = plain.detail["remote_worker_step_s"] - shaped.detail["remote_worker_step_s"]
    assert saved == pytest.approx(2 * 70_000 * 8 / 10e6, rel=0.01)


def test_a_remote_gradient_into_a_computing_host_takes_the_probe_s_extra() -> None:
    """The gradient arrives while the server's worker computes: the probe's ``busy_receive``
    lengthens each remote step once (the reply goes to a worker that waits for it)."""
    profile = _profile()
    plain = _one("parameter_server", profile, _cluster())
    busy = Cluster.parse(2, 1, "100mbit", "1ms", busy_receive="3ms")
    slowed = _one("parameter_server", profile, busy)
    added = slowed.detail["remote_worker_step_s"] - plain.detail["remote_worker_step_s"]
    assert added == pytest.approx(0.003)
    # fewer remote gradients for each of the server's worker's steps
    assert slowed.detail["remote_pushes_per_step"] < plain.detail["remote_pushes_per_step"]
    with pytest.raises(ValueError, match="latencies >= 0"):
        Link(1e9, 0.0, busy_receive=-1.0)


def test_gropipe_takes_fill_drain_and_refuses_an_odd_world() -> None:
    profile = _profile()
    fast = _one("gropipe", profile, _cluster("100gbit"), stages=2, micro_batches=4)
    # stages of two layers: 8 ms forward, 16 ms backward a micro-batch; 1F1B replayed with
    # 1 ms a message, each sent once its receive is posted (bytes take no time at 100 Gbit/s):
    # stage 1 ends B3 at 111 ms, stage 0 ends B3 at 128 ms (the slots' 120 ms and 8 ms of
    # messages on the critical path); then the optimizer's half and the trainer's time
    assert fast.detail["boundaries"] == [2]
    summary = all_reduce(_cluster("100gbit"), 64.0).seconds
    expected = 0.128 + 0.005 + profile.overhead_s + summary
    assert fast.step_s == pytest.approx(expected, rel=0.01)
    assert fast.bubble_s == pytest.approx(0.128 - 4 * 0.024, rel=0.02)
    (odd,) = predict(profile, _cluster(hosts=3), [("gropipe", "gropipe", {"stages": 2})])
    assert odd.refused is not None and "multiple of stages" in odd.refused


def test_spectrain_is_paced_by_its_slowest_stage_or_its_cut() -> None:
    """No barrier between the stages (the trainer's flag is read a batch late): each runs at
    its own pace. Stage 0 (two layers, 60 ms) predicts its weights before each forward (no
    ``pass_seconds`` in the profile: the optimizer's time on its half, 5 ms) and steps its
    half (5 ms); the last stage predicts nothing, and waits for each activation, which crosses
    once it has posted the receive after its update, behind what of its gradient is still on
    the link then. Where the cut is fast, stage 0 paces the pipeline; where it is slow, stage
    1's busy time, the gradient's remainder and the activation do."""
    profile = _profile()
    fast = _one("spectrain", profile, _cluster("100gbit"), stages=2)
    busy = [0.060 + 0.010 + profile.overhead_s, 0.060 + 0.005 + profile.overhead_s]
    assert fast.detail["stage_busy_s"] == pytest.approx(busy)
    assert fast.step_s == pytest.approx(busy[0], rel=0.01)
    slow = _one("spectrain", profile, _cluster("1mbit"), stages=2)
    cut = send(_cluster("1mbit"), 64_000).seconds
    assert cut > busy[0]
    after_backward = 0.005 + profile.overhead_s  # the update and the trainer's time
    assert slow.step_s == pytest.approx(busy[1] + (cut - after_backward) + cut, rel=0.01)


def test_spectrain_s_messages_pass_at_once_through_a_refilled_token_bucket() -> None:
    """The bench's shaped links let a bucket's bytes through at once after they idled: a
    64 kB gradient and a 64 kB activation a step, with the link idle most of the step, delay
    stage 1 by their latencies alone (measured: ``gpt`` at 10 Mbit/s waited 1.4 ms for 16 kB
    that take 13 ms at the link's rate)."""
    profile = _profile()
    bucket = Cluster.parse(2, 1, "100mbit", "1ms", burst_bytes=250_000)
    last = 0.060 + 0.005 + profile.overhead_s
    first = last + 0.005  # stage 0's weight prediction
    assert _one("spectrain", profile, bucket, stages=2).step_s == pytest.approx(
        max(first, last + 0.001), rel=0.01
    )
    # without a bucket (a real link) the activation's bytes take their time
    plain = _one("spectrain", profile, _cluster("100mbit"), stages=2)
    cut = send(_cluster("100mbit"), 64_000).seconds
    late = max(0.0, cut - 0.005 - profile.overhead_s)  # the gradient after the update
    assert plain.step_s == pytest.approx(max(first, last + late + cut), rel=0.01)


def test_spectrain_s_prediction_is_the_profiled_pass_on_the_stale_stages_only() -> None:
    """With ``pass_seconds`` measured per layer, stage 0 of 2 spends its layers' passes before
    each forward (on the critical path: stage 1 waits for it), the last stage none; with
    ``prediction="none"`` no stage does."""
    profile = _profile()
    layers = tuple(
        replace(p, layers=tuple(replace(c, pass_seconds=0.003) for c in p.layers))
        for p in profile.layer_profiles
    )
    measured = replace(profile, layer_profiles=layers)
    cluster = _cluster("100gbit")
    cut = send(cluster, 64_000).seconds
    busy = 0.060 + 0.005 + profile.overhead_s
    predicted = _one("spectrain", measured, cluster, stages=2)
    assert predicted.detail["stage_busy_s"] == pytest.approx([0.006 + busy, busy])
    assert predicted.step_s == pytest.approx(max(0.006 + busy, busy + cut), rel=0.01)
    stale = _one("spectrain", measured, cluster, stages=2, prediction="none")
    assert stale.step_s == pytest.approx(busy + cut, rel=0.01)


def test_a_run_shorter_than_its_periods_holds_only_the_rounds_its_steps_end() -> None:
    """30 steps of DiLoCo (``period=16``) end one round: the mean step over the run adds one
    round's extra time over 30 steps, not one over 16."""
    from lightning_parallel.plan.averaging import step_rounds

    assert step_rounds(RunLength(), 16, 1) == 1 / 16
    assert step_rounds(RunLength(steps=30), 16, 1) == 1 / 30
    # epochs of 22 validated: rounds at 8 and 16 in each, the schedule fresh after each
    assert step_rounds(RunLength(steps=40, epoch_steps=22, validation_samples=64), 8, 1) == 4 / 40
    # the round due at a validated epoch's last step runs before the validation, outside the
    # steps (timm's ViT-Tiny, epochs of 32, 100 steps: 3 of the 6 rounds' time in the steps)
    validated = RunLength(steps=100, epoch_steps=32, validation_samples=256)
    assert step_rounds(validated, 16, 1) == 3 / 100
    # an epoch length known means a validation every epoch, as round_counts takes it
    assert step_rounds(RunLength(steps=100, epoch_steps=32), 16, 1) == 3 / 100
    # without epochs the schedule runs on: every round but one due at the run's end
    assert step_rounds(RunLength(steps=96), 16, 1) == 5 / 96
    # the bench's rate leaves each rank's first steps out: their rounds too
    assert step_rounds(RunLength(steps=100, epoch_steps=32, validation_samples=256,
                                 warmup_steps=5), 16, 1) == 3 / 95  # fmt: skip
    assert step_rounds(RunLength(steps=40, warmup_steps=9), 8, 1) == 3 / 31
    # staggered fragments (4 of a period of 16): phases 4, 8, 12, 16
    assert step_rounds(RunLength(steps=32, epoch_steps=32, validation_samples=64), 16, 4) == 7 / 32
    profile, cluster = _profile(), _cluster()
    steady = _one("diloco", profile, cluster, algorithm="outer_optimizer", period=16)
    (short,) = predict(
        profile, cluster, [("diloco", "diloco", {"algorithm": "outer_optimizer", "period": 16})],
        RunLength(steps=30),
    )  # fmt: skip
    extra = steady.detail["round_step_s"] - steady.detail["local_step_s"]
    assert steady.mean_step_s == pytest.approx(steady.detail["local_step_s"] + extra / 16)
    assert short.mean_step_s == pytest.approx(short.detail["local_step_s"] + extra / 30)


def test_every_default_family_plans_ranks_and_scales() -> None:
    profile, cluster = _profile(), _cluster()
    strategies = [(name, name, {}) for name in DEFAULT_SPECS]
    predictions = ranked(predict(profile, cluster, strategies))
    assert {p.spec for p in predictions} == set(DEFAULT_SPECS)
    speeds = [p.samples_per_s for p in predictions]
    assert speeds == sorted(speeds, reverse=True)
    assert all(math.isfinite(p.step_s) and p.step_s > 0 for p in predictions)
    curves = scaling(profile, cluster, strategies, [2, 4, 1024])
    assert [point[0] for point in curves["ddp"]] == [2, 4, 1024]
    # a ring allreduce's bytes per host level off: 2 (W - 1) / W of the gradients
    assert curves["ddp"][2][1] > curves["ddp"][0][1]
    (unknown,) = predict(profile, cluster, [("nope", "nope", {})])
    assert unknown.refused is not None and "no predictor" in unknown.refused
    assert set(DEFAULT_SPECS) <= set(PREDICTORS)


def test_median_of_a_step_mix() -> None:
    assert median_of_steps([(1.0, 0.9), (5.0, 0.1)]) == 1.0
    assert median_of_steps([(1.0, 0.3), (5.0, 0.7)]) == 5.0


def test_a_straggler_paces_synchronous_steps_but_only_itself_on_the_parameter_server() -> None:
    profile, cluster = _profile(layers=False), _cluster("100gbit", hosts=4)
    strategies = [("ddp", "ddp", {}), ("parameter_server", "parameter_server", {})]
    even = {p.spec: p for p in predict(profile, cluster, strategies)}
    slow = {p.spec: p for p in predict(profile, cluster, strategies, straggler=3.0)}
    assert slow["ddp"].step_s == pytest.approx(even["ddp"].step_s + 2 * profile.compute_s, rel=0.01)
    ps = slow["parameter_server"]
    assert ps.detail["straggler_step_s"] > 2.5 * profile.compute_s
    # the others keep their pace: the median step is unchanged, throughput barely drops
    assert ps.step_s == pytest.approx(even["parameter_server"].step_s, rel=0.05)
    assert ps.samples_per_s > 0.8 * even["parameter_server"].samples_per_s


def test_synchronous_steps_wait_for_the_slowest_replica_of_the_profile_s_spread() -> None:
    from dataclasses import replace

    # 101 timed steps of 100 to 200 ms: the median 150 ms; the slowest of 2 replicas has its
    # median at the 0.5^(1/2) = 70.7% quantile, 170.7 ms; of 8 at the 91.7% quantile
    steps = [0.100 + 0.001 * i for i in range(101)]
    profile = replace(_profile(layers=False), notes={"step_seconds": steps}, flops=1e9)
    assert profile.slowest_replica_factor(2) == pytest.approx(0.17071 / 0.150, rel=1e-3)
    assert profile.slowest_replica_factor(8) == pytest.approx(0.19170 / 0.150, rel=1e-3)
    assert profile.slowest_replica_factor(1) == 1.0
    assert _profile().slowest_replica_factor(8) == 1.0  # no steps kept: no spread known
    carried = profile.on_accelerator(1e12)  # this machine's spread says nothing of a GPU's
    assert carried.slowest_replica_factor(8) == 1.0
    strategies = [("ddp", "ddp", {}), ("parameter_server", "parameter_server", {})]
    cluster = _cluster("100gbit", hosts=2)
    plain = {p.spec: p for p in predict(replace(profile, notes={}), cluster, strategies)}
    spread = {p.spec: p for p in predict(profile, cluster, strategies)}
    factor = profile.slowest_replica_factor(2)
    assert spread["ddp"].compute_s == pytest.approx(
        plain["ddp"].compute_s + (factor - 1) * profile.compute_s, rel=1e-6
    )
    # the parameter server's workers wait for no one
    assert spread["parameter_server"].step_s == pytest.approx(
        plain["parameter_server"].step_s, rel=1e-6
    )
    # a straggler slower than the spread paces the step instead (not both at once)
    slow = {p.spec: p for p in predict(profile, cluster, strategies, straggler=3.0)}
    assert slow["ddp"].compute_s == pytest.approx(
        plain["ddp"].compute_s + 2 * profile.compute_s, rel=1e-6
    )


def _tied(profile: StepProfile) -> StepProfile:
    """``profile`` with its first and last layers sharing one 1 MB tensor (an embedding and the
    head that reuses it): 3 MB of parameters, each layer's bytes still counting it."""
    from dataclasses import replace

    layers = tuple(replace(p, tied=((MB, (0, 3)),)) for p in profile.layer_profiles)
    return replace(profile, parameters=profile.parameters[:3], layer_profiles=layers)


def test_ddp_counts_a_tied_tensor_once() -> None:
    from lightning_parallel.plan.data_parallel import ready_times

    profile = _tied(_profile())
    ready = ready_times(profile)
    assert sum(r.nbytes for r in ready) == pytest.approx(3 * MB)
    # ready once backward has passed its first use: the first layer, the last backward reaches
    assert [r.nbytes for r in ready] == [0.0, 0.0, MB, MB, MB]
    cluster = _cluster()
    assert _one("ddp", profile, cluster).wire_bytes_per_step == pytest.approx(
        all_reduce(cluster, 3 * MB).wire_bytes, rel=1e-3
    )


def test_the_pipelines_exchange_a_tied_tensor_between_its_stages() -> None:
    """GroPipe sums the copies' gradients once a step (blocking); SpecTrain sums them and
    broadcasts the owner's value at every update (asynchronous, on the cut's links): on 2
    hosts, the hosts' mean is the tensor's bytes, and one and a half times them."""
    from lightning_parallel.plan.network import broadcast

    plain, tied, cluster = _profile(), _tied(_profile()), _cluster()
    pair = Cluster.parse(hosts=2, processes_per_host=1, bandwidth="100mbit", latency="1ms")
    reduce, cast = all_reduce(pair, MB), broadcast(pair, MB)
    gropipe = [_one("gropipe", p, cluster, stages=2, micro_batches=4) for p in (plain, tied)]
    assert gropipe[1].wire_bytes_per_step - gropipe[0].wire_bytes_per_step == pytest.approx(
        reduce.wire_bytes
    )
    assert gropipe[1].step_s - gropipe[0].step_s == pytest.approx(reduce.seconds)
    spectrain = [_one("spectrain", p, cluster, stages=2) for p in (plain, tied)]
    assert spectrain[1].wire_bytes_per_step - spectrain[0].wire_bytes_per_step == pytest.approx(
        reduce.wire_bytes + cast.wire_bytes / 2
    )
    # nothing waits for it, but it shares the link with the activations: here the link, at
    # 100 Mbit/s, is slower than the stages
    (cut,) = spectrain[1].detail["cut_bytes"]
    link_s = send(pair, cut).seconds + reduce.seconds + cast.seconds
    assert link_s > spectrain[0].step_s
    assert spectrain[1].step_s == pytest.approx(link_s)


def test_the_pipelines_count_the_validations_inside_the_run() -> None:
    """A validation at an epoch's end sends every validation batch's micro-batches forward over
    the cut, nothing back; both stages validate the pipeline's one share of the set."""
    profile, cluster = _profile(), _cluster()
    bare = RunLength(steps=60)
    # one pipeline: epochs of 1438 // 32 = 44 steps, so one validation in 60 steps (of 12
    # batches: 359 samples)
    run = RunLength(steps=60, train_samples=1438, validation_samples=359, drop_last=True)
    assert run.validations_over(1, 32) == 1 and run.validation_batches(1, 32) == 12
    assert RunLength(steps=88, train_samples=1438, drop_last=True).validations_over(1, 32) == 2
    for spec, micro in (("gropipe", 4), ("spectrain", 1)):
        (without,) = predict(profile, cluster, [(spec, spec, {})], bare)
        (counted,) = predict(profile, cluster, [(spec, spec, {})], run)
        (cut,) = counted.detail["cut_bytes"]
        expected = 12 * micro * send(cluster, cut).wire_bytes / 60 / cluster.hosts
        assert counted.wire_bytes_per_step - without.wire_bytes_per_step == pytest.approx(expected)
        assert counted.step_s == without.step_s


def test_ddp_broadcasts_the_buffers_before_every_forward_and_averaging_averages_them() -> None:
    """BatchNorm's statistics: DDP sends rank 0's to every rank each step (waited for, the
    hosts' mean of a binomial tree's bytes); a round averages the floating-point ones with
    the parameters in one flat buffer (in full precision beside quantized parameters)."""
    from dataclasses import replace

    from lightning_parallel.plan.network import broadcast, broadcast_mean

    plain, cluster = _profile(layers=False), _cluster()
    with_buffers = replace(plain, buffer_bytes=40_000, float_buffer_bytes=38_000)
    for spec in ("ddp", "ddp_powersgd", "hylo"):
        before, after = _one(spec, plain, cluster), _one(spec, with_buffers, cluster)
        sent = broadcast_mean(cluster, 40_000)
        assert after.wire_bytes_per_step - before.wire_bytes_per_step == pytest.approx(
            sent.wire_bytes
        )
    off = _one("ddp", with_buffers, cluster, broadcast_buffers=False)
    assert off.wire_bytes_per_step == pytest.approx(_one("ddp", plain, cluster).wire_bytes_per_step)
    # (the low-rank codecs of this hand-made profile are timed at each call: ddp's step alone)
    before, after = _one("ddp", plain, cluster), _one("ddp", with_buffers, cluster)
    assert after.step_s - before.step_s == pytest.approx(sent.seconds)
    # 2 hosts: the root sends the one copy, the other host nothing: half of it a host
    assert broadcast_mean(cluster, 40_000).payload_bytes == pytest.approx(20_000)
    # 8 hosts: 7 copies over 8 hosts, where the root's host sends 3
    eight = _cluster(hosts=8)
    assert broadcast_mean(eight, 8_000).payload_bytes == pytest.approx(7_000)
    assert broadcast(eight, 8_000).payload_bytes == pytest.approx(24_000)
    averaging = _one("model_averaging", with_buffers, cluster, algorithm="periodic", period=8)
    alone = _one("model_averaging", plain, cluster, algorithm="periodic", period=8)
    grown = all_reduce(cluster, plain.parameter_bytes + 38_000).wire_bytes
    model = all_reduce(cluster, plain.parameter_bytes).wire_bytes
    assert averaging.wire_bytes_per_step - alone.wire_bytes_per_step == pytest.approx(
        (grown - model) / 8
    )
    local = _one("model_averaging", with_buffers, cluster, algorithm="periodic", buffers="local")
    assert local.wire_bytes_per_step == pytest.approx(alone.wire_bytes_per_step)
    options = {"algorithm": "outer_optimizer", "period": 16, "outer_dtype": "int8"}
    quantized = _one("diloco:int8", with_buffers, cluster, **options)
    bare = _one("diloco:int8", plain, cluster, **options)
    assert quantized.wire_bytes_per_step - bare.wire_bytes_per_step == pytest.approx(
        all_reduce(cluster, 38_000).wire_bytes / 16
    )


def test_no_gradient_comes_back_over_a_cut_after_integer_outputs() -> None:
    """A cut after a layer that passes token ids on (``gpt``'s first) carries activations
    forward and nothing back: the runtime sends gradients only for floating-point tensors."""
    from dataclasses import replace

    def integer_cut(layers: LayerProfile) -> LayerProfile:
        # the 4 equal layers split 2 + 2: the cut is after layer 1
        costs = list(layers.layers)
        costs[1] = replace(costs[1], gradient_bytes=0)
        return replace(layers, layers=tuple(costs))

    floating = _profile()
    integer = replace(floating, layer_profiles=tuple(map(integer_cut, floating.layer_profiles)))
    cluster = _cluster("1gbit")
    for spec, micro, output in (("gropipe", 4, 16_000), ("spectrain", 1, 64_000)):
        both, forward_only = _one(spec, floating, cluster), _one(spec, integer, cluster)
        assert both.detail["boundaries"] == forward_only.detail["boundaries"] == [2]
        # per step and host (the mean of 2): one gradient of `output` bytes a micro-batch
        back = send(cluster, output).wire_bytes * micro / 2
        assert both.wire_bytes_per_step - forward_only.wire_bytes_per_step == pytest.approx(
            back, rel=1e-6
        ), spec


def test_ddp_buckets_by_parameter_start_from_the_last_and_close_the_first_at_1_mib() -> None:
    from lightning_parallel.plan.data_parallel import parameter_buckets

    shapes = [ParameterShape(f"w{i}", (256, 512)) for i in range(60)]  # 0.5 MiB each
    buckets = parameter_buckets(shapes)
    assert [len(b) for b in buckets] == [2, 50, 8]
    assert [p.name for p in buckets[0]] == ["w59", "w58"]
    assert sum(len(b) for b in buckets) == 60


def test_hylo_counts_its_calibration_steps_in_proportion_and_each_bucket_s_rounds() -> None:
    """Hylo's first two steps send a large convolution as kernel top-k (the policy's first
    candidate); the steady state as rank-8 factors. A run of N steps holds both in proportion;
    each DDP bucket is exchanged in its own rounds."""
    from lightning_parallel.compression.policy import HyloPolicy
    from lightning_parallel.plan.data_parallel import _factor_bytes

    conv = ParameterShape("conv", (256, 256, 3, 3))  # 2.25 MiB: kernel top-k, then factors
    profile = StepProfile(
        batch_size=32, forward_s=0.040, backward_s=0.080, optimizer_s=0.010,
        parameters=(conv, ParameterShape("bias", (256,))), optimizer_state_bytes=4 * MB,
        activation_bytes=1_000_000, trainer_step_s=0.150, peak_rss_bytes=500 * MB,
    )  # fmt: skip
    cluster = _cluster("1gbit")
    steady = _one("hylo", profile, cluster)
    assert steady.detail["low_rank_layers"] == 1
    kernel = HyloPolicy().assign("conv", conv.shape)
    assert kernel.route == "kernel"
    # the bias closes no bucket: one bucket of both, rounds dense, P and Q
    factors = _factor_bytes([conv], 8)
    dense = 256 * 4
    flag_and_buffers = steady.payload_bytes_per_step - dense - factors
    assert 0 <= flag_and_buffers <= 8
    calibration = kernel.codec.wire_nbytes(conv.shape) + dense
    for steps in (2, 10, 50):
        (run,) = predict(profile, cluster, [("hylo", "hylo", {})], RunLength(steps=steps))
        expected = (2 * calibration + (steps - 2) * (dense + factors)) / steps
        assert run.payload_bytes_per_step - flag_and_buffers == pytest.approx(expected)
    # without the cost model there is no calibration
    (plain,) = predict(
        profile, cluster, [("hylo", "hylo", {"cost_model": False})], RunLength(steps=10)
    )
    assert plain.payload_bytes_per_step == pytest.approx(steady.payload_bytes_per_step)


def test_hylo_exchanges_each_ddp_bucket_in_rounds_of_its_own() -> None:
    from lightning_parallel.compression.policy import HyloPolicy
    from lightning_parallel.plan.hylo import _chosen, _first_candidates, _hylo_rounds

    convs = [ParameterShape(name, (256, 256, 3, 3)) for name in ("a", "b")]
    profile = StepProfile(
        batch_size=32, forward_s=0.040, backward_s=0.080, optimizer_s=0.010,
        parameters=(*convs, ParameterShape("bias", (256,))), optimizer_state_bytes=4 * MB,
        activation_bytes=1_000_000,
    )  # fmt: skip
    cluster = _cluster("1gbit")
    # buckets [bias, b] and [a]: the dense bias, P and Q; then P and Q
    steady = _hylo_rounds(profile, cluster, _chosen({"a", "b"}, 8))
    assert len(steady) == 5
    # calibrating: each bucket's kernel norms, then its dense values with the selected kernels
    calibrating = _hylo_rounds(profile, cluster, _first_candidates(HyloPolicy()))
    assert len(calibrating) == 4
    codec = HyloPolicy().assign("a", convs[0].shape).codec
    assert sum(t.payload_bytes for t in calibrating) == pytest.approx(
        2 * codec.wire_nbytes(convs[0].shape) + 256 * 4
    )


def test_hylo_sends_codes_where_the_profile_s_trial_put_the_factors_over_the_budget() -> None:
    """The cost model keeps a layer's low-rank factors only within its error budget (0.9);
    over it the 2-bit codes go instead (transformers' GPT-2: the token embedding at 0.94,
    its bytes −18.9% against the run where the plan took the factors)."""
    from lightning_parallel.compression.low_rank import matrix_shape
    from lightning_parallel.compression.policy import HyloPolicy

    profile = _profile()
    name, shape = profile.parameters[0].name, profile.parameters[0].shape
    plain = _one("hylo", profile, _cluster())
    over = replace(profile, codec_errors={name: {"low_rank@8": 0.95, "two_bit": 0.46}})
    coded = _one("hylo", over, _cluster())
    assert coded.detail["over_budget_layers"] == [name]
    codes = HyloPolicy().two_bit_codec.wire_nbytes(shape)
    factors = 4.0 * sum(matrix_shape(shape)) * 8
    added = coded.wire_bytes_per_step - plain.wire_bytes_per_step
    assert added == pytest.approx(codes - factors, rel=0.05)
    # within the budget, a raised budget, or a trial at another rank: the factors stay
    within = replace(profile, codec_errors={name: {"low_rank@8": 0.85, "two_bit": 0.46}})
    assert _one("hylo", within, _cluster()).detail["over_budget_layers"] == []
    assert _one("hylo", over, _cluster(), error_budget=0.97).detail["over_budget_layers"] == []
    assert _one("hylo", over, _cluster(), rank=4).detail["over_budget_layers"] == []
    # a run without 2-bit codes keeps its factors, whatever their error
    assert _one("hylo", over, _cluster(), fc_bits=32).detail["over_budget_layers"] == []


def test_averaging_counts_the_point_kept_before_a_round_where_it_is_kept() -> None:
    # unfragmented full-precision rounds with the roll-back keep the point before a round
    # (EASGD: its center, with rounds applied at once); streaming rounds and runs without the
    # roll-back do not
    profile, cluster = _profile(layers=False), _cluster()
    parameters_mb = 4 * 512 * 512 * 4 / MB

    def extra(spec: str, **options: object) -> float:
        return (_one(spec, profile, cluster, **options).peak_rss_mb - 500.0) / parameters_mb

    kept = PREVIOUS_POINT_COPIES["outer_optimizer"]
    base = EXTRA_PARAMETER_COPIES["outer_optimizer"]
    assert extra("diloco", algorithm="outer_optimizer") == pytest.approx(base + kept)
    assert extra("diloco", algorithm="outer_optimizer", fragments=4) == pytest.approx(base)
    assert extra("diloco", algorithm="outer_optimizer", rollback_on_spike=False) == pytest.approx(
        base
    )
    easgd = EXTRA_PARAMETER_COPIES["easgd"]
    assert extra("easgd", algorithm="easgd") == pytest.approx(
        easgd + PREVIOUS_POINT_COPIES["easgd"]
    )
    assert extra("easgd", algorithm="easgd", sync_delay=2) == pytest.approx(easgd)
