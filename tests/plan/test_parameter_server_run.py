"""The parameter server's run simulated exchange by exchange (plan/parameter_server_run.py)."""

import pytest

from lightning_parallel.plan.parameter_server_run import WorkerTimes, simulate_run


def _remote(compute_s, link_s):
    return WorkerTimes(compute_s, push_s=link_s, reply_s=link_s, ask_s=0.0, fetch_s=link_s)


@pytest.mark.parametrize(
    ("workers", "epoch_batches", "run_batches", "trained"),
    [
        ([WorkerTimes(0.1), _remote(0.1, 0.01)], 10, 40, 40),  # two epochs of 20
        ([WorkerTimes(0.1), _remote(0.5, 0.01)], 10, 40, 40),  # a slow remote worker
        ([WorkerTimes(0.1), WorkerTimes(0.1), _remote(0.3, 0.1)], 7, 60, 60),  # epochs of 21
        ([WorkerTimes(0.1), _remote(0.1, 0.01)], 10, None, 20),  # one epoch, no run limit
        ([WorkerTimes(0.1), _remote(2.0, 4.0)], None, 40, 40),
    ],
)
def test_every_batch_of_the_run_is_trained_once(workers, epoch_batches, run_batches, trained):
    counts = simulate_run(workers, epoch_batches, run_batches)
    assert sum(counts.pushes) == trained
    # a step the bench counts is a pushed gradient or a batch whose grant went elsewhere
    assert all(s >= p for s, p in zip(counts.steps, counts.pushes))
    # a remote worker hears back for every gradient, and at least once more where its last
    # batch was skipped or a later epoch began
    assert all(r >= p for r, p in zip(counts.replies, counts.pushes))


def test_a_short_run_on_a_slow_link_ends_as_measured():
    """``vgg16`` on 2 hosts at 10 Mbit/s, 60 steps a rank (120 batches in the run's budget): the
    server's worker steps in 36.5 ms, the remote one's gradient and weights (3.7 MB) take 3.1 s
    each way. Traced (the client's requests and replies, timed): the remote worker's first
    ``BEGIN`` reply came at 3.08 s and rank 0's first step only then; rank 0 took 119 batches,
    the remote worker trained 1 (its second grant went to rank 0, ``granted -1``) and drained
    with an exchange of its own: 2 replies in the counting window."""
    workers = [WorkerTimes(0.0365), WorkerTimes(0.0348, 3.09, 3.10, 0.0012, 3.09)]
    counts = simulate_run(workers, epoch_batches=64, run_batches=120)
    assert counts.steps == [119, 2]
    assert counts.pushes == [119, 1]
    assert counts.replies[1] == 2


def test_a_slow_worker_s_begin_grant_is_lent_at_the_run_s_end():
    """torchvision's ResNet-18 on 2 hosts at 100 Mbit/s, 50 steps a rank (100 batches, epochs
    of 32 a worker): the server's worker steps in 106 ms, the remote worker's gradient and
    weights (44.7 MB) take 3.7 s each way. Traced (the server's budget printed every grant):
    in epoch 2 rank 0 emptied the run's budget and took the second batch the remote worker was
    granted at its ``BEGIN``; the remote worker skipped it (``granted -1``): 98 and 4 steps, 2
    remote gradients, 5 replies. While the client's ``BEGIN`` kept its grants, the remote
    worker trained that batch (97 and 4 steps, 3 gradients, traced too) and rank 0 waited
    7.5 s for it; a simulation that keeps them gives those counts."""
    workers = [WorkerTimes(0.106), WorkerTimes(0.089, 3.736, 3.753, 0.0008, 3.736)]
    counts = simulate_run(workers, epoch_batches=32, run_batches=100)
    assert counts.steps == [98, 4]
    assert counts.pushes == [98, 2]
    assert counts.replies[1] == 5


def test_training_starts_once_the_slowest_worker_has_its_first_begin_reply():
    """Rank 0 (in-process) waits for the remote worker's first ``BEGIN`` reply (traced in 4
    runs: 0.44 to 4.3 s) before its first step; the wait is outside its steps. It matters to
    the counts: the server learns the remote worker's pace from its requests, and only then
    lends the remote worker's spare batch to rank 0 at the epoch's end. Started together (as
    the simulation did before) the remote worker trains 12 batches here; after the 5-second
    reply, 11."""
    quick = [WorkerTimes(0.1), WorkerTimes(0.1, 0.5, 0.5, 0.001, 0.001)]
    slow = [WorkerTimes(0.1), WorkerTimes(0.1, 0.5, 0.5, 0.001, 5.0)]
    assert simulate_run(quick, 64, 120).steps == [109, 12]
    waited = simulate_run(slow, 64, 120)
    assert waited.steps == [110, 11]
    # the 5 s wait is in no step: the remote worker's first step is its compute and exchange
    assert waited.step_log[1][0][0] == pytest.approx(0.1 + 0.5 + 0.5, rel=0.01)


def test_the_workers_meet_between_epochs():
    """Validation ends every epoch with a collective: a fast worker beside the server does not
    take the next epoch alone while the remote worker's drain reply (the weights, 4.3 s at
    100 Mbit/s) is still on the way. Measured (``vgg_mini`` at 100 Mbit/s, 40 steps a rank):
    4 remote steps in a 40-second run; without the meeting the simulation gave 16 in 135 s."""
    workers = [WorkerTimes(0.112), WorkerTimes(0.094, 4.31, 4.33, 0.0008, 4.31)]
    met = simulate_run(workers, epoch_batches=22, run_batches=80)
    alone = simulate_run(workers, epoch_batches=22, run_batches=80, epochs_meet=False)
    assert met.steps[1] == 4 and alone.steps[1] == 16
    assert sum(met.pushes) == sum(alone.pushes) == 80
    # the steps' time: the meetings and the begin exchanges are outside the bench's steps
    assert max(met.seconds) < 30 < min(alone.seconds)


def test_the_rate_leaves_each_worker_s_first_steps_out_as_the_bench_does():
    """The bench's samples per second skip each rank's first ``warmup_steps`` (at most all but
    one of rank 0's): a remote worker that steps 3 times in the run counts nothing with 5."""
    workers = [WorkerTimes(0.1), _remote(0.1, 2.0)]
    counts = simulate_run(workers, epoch_batches=30, run_batches=60)
    assert counts.steps[1] <= 5 < counts.steps[0]
    steady = counts.samples_per_s(32, warmup_steps=5)
    log = counts.step_log[0][5:]
    assert steady == pytest.approx(32 * sum(t for _, t in log) / sum(s for s, _ in log))
    assert counts.samples_per_s(32) > steady  # the remote worker's batches count without it


def test_a_run_needs_a_length():
    with pytest.raises(ValueError, match="epoch length or a run length"):
        simulate_run([WorkerTimes(0.1)], None, None)


def test_the_run_s_rate_counts_the_waits_at_the_epochs_drains():
    """Each worker's trained batches over its own clock: a fast worker beside the server that
    waits at every epoch's drain for a slow remote exchange trains fewer samples a second than
    its steps alone say (vgg16 at 10 Mbit/s: 401 samples/s measured, 878 from the steady rates,
    615 from the run)."""
    counts = simulate_run([WorkerTimes(0.1), _remote(0.1, 2.0)], epoch_batches=10, run_batches=40)
    assert len(counts.seconds) == 2 and all(s > 0 for s in counts.seconds)
    expected = sum(32 * p / s for p, s in zip(counts.pushes, counts.seconds))
    assert counts.samples_per_s(32) == pytest.approx(expected)
    # the server's worker alone would train 320 samples a second without the drains
    assert counts.samples_per_s(32) < 320


def test_the_plan_ranks_the_parameter_server_by_its_run():
    from lightning_parallel.plan.network import Cluster
    from lightning_parallel.plan.parameter_server import predict_parameter_server
    from lightning_parallel.plan.prediction import RunLength
    from lightning_parallel.plan.profile import ParameterShape, StepProfile

    profile = StepProfile(
        batch_size=32, forward_s=0.02, backward_s=0.04, optimizer_s=0.005,
        parameters=(ParameterShape("w", (1024, 1024)),), optimizer_state_bytes=4 * 2**20,
        activation_bytes=10**6, trainer_step_s=0.07, peak_rss_bytes=500 * 2**20,
    )  # fmt: skip
    cluster = Cluster.parse(2, 1, "10mbit", "1ms")
    steady = predict_parameter_server("parameter_server", profile, cluster, {})
    run = predict_parameter_server(
        "parameter_server", profile, cluster, {}, RunLength(steps=40, epoch_steps=10)
    )
    # 4 MB each way at 10 Mbit/s: every epoch's drain waits seconds for the remote exchange
    assert run.samples_per_s < 0.7 * steady.samples_per_s
