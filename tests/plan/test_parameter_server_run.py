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
    # vgg_mini on 2 hosts at 100 Mbit/s, 20 steps a rank (40 batches in the run's budget): the
    # server's worker steps in 0.26 s, the remote one's gradient and weights (51.5 MB) take
    # 4.3 s each way. Measured (bench --predict): rank 0 38 steps, rank 1 3 steps of which 2
    # gradients; its host sent 2 parameter vectors, the server's host 3 (2 replies, 1 drain)
    counts = simulate_run(
        [WorkerTimes(0.259), WorkerTimes(0.2, push_s=4.3, reply_s=4.4, fetch_s=4.3)],
        epoch_batches=23,
        run_batches=40,
    )
    assert counts.steps == [38, 3]
    assert counts.pushes[1] == 2
    assert counts.replies[1] == 3


def test_a_run_needs_a_length():
    with pytest.raises(ValueError, match="epoch length or a run length"):
        simulate_run([WorkerTimes(0.1)], None, None)
