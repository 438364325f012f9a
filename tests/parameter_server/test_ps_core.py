"""Single-process tests of the parameter server's pieces: policies, shard server, budget, layout."""

import math
import weakref

import pytest
import torch
from torch.optim import SGD

from lightning_parallel.parameter_server import (
    EpochBudget,
    ShardLayout,
    ShardServer,
    UpdatePolicy,
    WorkerStatus,
    staleness_scaling,
)
from lightning_parallel.parameter_server.protocol import (
    Reply,
    ReplyFlag,
    ReplyKind,
    Request,
    RequestFlag,
    RequestKind,
)


def _server(policy, weights, workers=(0, 1), lr=0.5, budget=None, momentum=0.0):
    return ShardServer(
        [weights],
        lambda params: SGD(params, lr=lr, momentum=momentum),
        policy,
        workers,
        budget=budget,
    )


def _begin(server, worker):
    (reply,) = server.handle(Request(RequestKind.BEGIN, worker))
    return reply


def _push(server, worker, read_version, gradient, drain=False):
    flags = RequestFlag.HAS_GRADIENT | (RequestFlag.DRAIN if drain else RequestFlag.NONE)
    return server.handle(
        Request(RequestKind.STEP, worker, read_version, flags, gradient=gradient.clone())
    )


# ---------------------------------------------------------------------------- policies


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("none", [1.0, 1.0, 1.0, 1.0]),
        ("inverse", [1.0, 1 / 2, 1 / 3, 1 / 5]),
        ("sqrt", [1.0, 1 / math.sqrt(2), 1 / math.sqrt(3), 1 / math.sqrt(5)]),
        ("exp", [1.0, math.exp(-0.5), math.exp(-1.0), math.exp(-2.0)]),
    ],
)
def test_staleness_factors_at_0_1_2_4(name, expected):
    scaling = staleness_scaling(name)
    assert [scaling.factor(t) for t in (0, 1, 2, 4)] == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"staleness": "linear"}, "staleness must be one of"),
        ({"softsync": 0}, "softsync must be an integer >= 1"),
        ({"max_staleness": -1}, "max_staleness must be an integer >= 0"),
        ({"drop_staleness": 1.5}, "drop_staleness must be an integer"),
        ({"delay_compensation": -0.1}, "delay_compensation"),
        ({"staleness": "exp", "staleness_decay": 0.0}, "staleness_decay must be > 0"),
    ],
)
def test_policy_rejects_bad_arguments_with_the_fix(kwargs, message):
    with pytest.raises(ValueError, match=message):
        UpdatePolicy(**kwargs)


def test_policy_reads_inf_and_text_as_unbounded():
    assert UpdatePolicy(max_staleness=math.inf).max_staleness is None
    with pytest.raises(ValueError, match="max_staleness must be an integer"):
        UpdatePolicy(max_staleness="inf")  # type: ignore[arg-type]  (text: converted at edges)
    assert UpdatePolicy(max_staleness=float("inf")).max_staleness is None
    assert UpdatePolicy(max_staleness=2.0).max_staleness == 2


def test_group_size_rules():
    # fully asynchronous: one gradient at a time
    assert UpdatePolicy().group_size([0], [0, 0], version=0) == 1
    # softsync: wait for n, unless nobody is computing any more (flush)
    assert UpdatePolicy(softsync=2).group_size([0], [0], version=0) == 0
    assert UpdatePolicy(softsync=2).group_size([0, 0], [0], version=0) == 2
    assert UpdatePolicy(softsync=3).group_size([0, 0], [], version=0) == 2
    # SSP s=0: all gradients read at the current version go in one update
    assert UpdatePolicy(max_staleness=0).group_size([0], [0], version=0) == 0
    assert UpdatePolicy(max_staleness=0).group_size([0, 0], [], version=0) == 2
    # SSP s=1: a worker computing on version 0 allows one more update, not two
    assert UpdatePolicy(max_staleness=1).group_size([0], [0], version=0) == 1
    assert UpdatePolicy(max_staleness=1).group_size([1], [0], version=1) == 0


# ---------------------------------------------------------------------------- hand computations


@pytest.mark.parametrize("scaling", ["none", "inverse", "sqrt", "exp"])
def test_staleness_scaled_update_equals_hand_computation(scaling):
    """Two workers read w0; A's gradient is applied fresh, B's one update stale."""
    w0 = torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64)
    g_a = torch.tensor([0.3, 0.1, -0.2], dtype=torch.float64)
    g_b = torch.tensor([-0.4, 0.6, 0.9], dtype=torch.float64)
    lr = 0.5
    server = _server(UpdatePolicy(staleness=scaling), w0.clone(), lr=lr)
    _begin(server, 0)
    _begin(server, 1)
    (reply_a,) = _push(server, 0, 0, g_a)
    (reply_b,) = _push(server, 1, 0, g_b)
    f = staleness_scaling(scaling).factor
    w1 = w0 - lr * f(0) * g_a
    w2 = w1 - lr * f(1) * g_b
    assert (reply_a.staleness, reply_b.staleness) == (0, 1)
    torch.testing.assert_close(reply_a.weights, w1, rtol=0, atol=1e-15)
    torch.testing.assert_close(server.weights, w2, rtol=0, atol=1e-15)
    assert server.version == 2


def test_inverse_scaling_with_three_updates_of_staleness():
    w0 = torch.zeros(2, dtype=torch.float64)
    server = _server(UpdatePolicy(staleness="inverse"), w0.clone(), workers=(0, 1), lr=1.0)
    _begin(server, 0)
    _begin(server, 1)
    one = torch.ones(2, dtype=torch.float64)
    for _ in range(3):  # worker 0 moves the server three versions ahead
        _push(server, 0, server.version, one)
    (stale,) = _push(server, 1, 0, one)
    assert stale.staleness == 3
    # three fresh gradients at η, then one three updates stale at η/(3+1)
    torch.testing.assert_close(server.weights, -(3 + 1 / 4) * one, rtol=0, atol=1e-15)


def test_dc_asgd_update_equals_hand_computation():
    lam, lr = 0.04, 0.5
    w0 = torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64)
    g_a = torch.tensor([0.3, 0.1, -0.2], dtype=torch.float64)
    g_b = torch.tensor([-0.4, 0.6, 0.9], dtype=torch.float64)
    server = _server(UpdatePolicy(delay_compensation=lam), w0.clone(), lr=lr)
    _begin(server, 0)
    _begin(server, 1)
    _push(server, 0, 0, g_a)
    _push(server, 1, 0, g_b)
    w1 = w0 - lr * g_a  # A: fresh, w_now == w_used, no compensation
    compensated = g_b + lam * g_b * g_b * (w1 - w0)  # B used w0, the server holds w1
    w2 = w1 - lr * compensated
    torch.testing.assert_close(server.weights, w2, rtol=0, atol=1e-15)


def test_drop_beyond_bound_keeps_weights_and_counts():
    w0 = torch.zeros(2, dtype=torch.float64)
    server = _server(UpdatePolicy(drop_staleness=0), w0.clone(), lr=1.0)
    _begin(server, 0)
    _begin(server, 1)
    _push(server, 0, 0, torch.ones(2, dtype=torch.float64))
    (reply,) = _push(server, 1, 0, torch.full((2,), 100.0, dtype=torch.float64))
    assert ReplyFlag.DROPPED in reply.flags and reply.staleness == 1
    torch.testing.assert_close(server.weights, -torch.ones(2, dtype=torch.float64))
    assert (server.statistics.applied, server.statistics.dropped, server.version) == (1, 1, 1)


def test_softsync_group_is_the_mean_with_one_optimizer_step():
    w0 = torch.zeros(3, dtype=torch.float64)
    policy = UpdatePolicy(softsync=2)  # softsync_wait=True: the worker waits for its group
    server = _server(policy, w0.clone(), workers=(0, 1, 2), lr=1.0)
    for worker in range(3):
        _begin(server, worker)
    g = [torch.full((3,), float(k + 1), dtype=torch.float64) for k in range(3)]
    assert _push(server, 0, 0, g[0]) == []  # waits for a second gradient
    replies = _push(server, 2, 0, g[2])
    assert sorted(r.worker for r in replies) == [0, 2]
    torch.testing.assert_close(server.weights, -(g[0] + g[2]) / 2)
    assert server.version == 1 and server.statistics.groups == []  # trace is off by default


def test_softsync_without_waiting_answers_at_once_and_applies_in_groups():
    """Zhang et al.'s n-softsync: push and pull at once; the gradient waits for its group."""
    server = _server(
        UpdatePolicy(softsync=2, softsync_wait=False),
        torch.zeros(2, dtype=torch.float64),
        workers=(0, 1, 2),
        lr=1.0,
    )
    for worker in range(3):
        _begin(server, worker)
    one = torch.ones(2, dtype=torch.float64)
    (first,) = _push(server, 0, 0, one)  # answered with the unchanged weights, version 0
    assert (first.worker, first.version) == (0, 0) and torch.equal(first.weights, 0 * one)
    buffer = 10 * one
    (second,) = _push(server, 0, 0, buffer)  # worker 0 again: a group of its two gradients
    buffer.fill_(1e6)  # the receive buffer is reused; the server kept copies
    assert second.version == 1
    torch.testing.assert_close(server.weights, -(one + 10 * one) / 2)
    (third,) = _push(server, 1, 0, 3 * one)  # waits for a partner, answered at version 1
    assert third.version == 1 and server.version == 1
    (fourth,) = _push(server, 2, 0, 5 * one)
    # group {3g (staleness 1), 5g (staleness 1)}: w = -5.5 - (3 + 5) / 2
    torch.testing.assert_close(server.weights, -9.5 * one)
    assert fourth.version == 2 and server.statistics.applied == 4


def test_momentum_state_and_learning_rate_mirror():
    """The shard's optimizer keeps momentum; the hyperparameters come from the template."""
    template = SGD([torch.zeros(2)], lr=0.1, momentum=0.9)
    server = ShardServer(
        [torch.zeros(2)],
        lambda params: SGD(params, lr=0.1, momentum=0.9),
        UpdatePolicy(),
        [0],
        before_update=lambda opt: opt.param_groups[0].update(lr=template.param_groups[0]["lr"]),
    )
    _begin(server, 0)
    _push(server, 0, 0, torch.ones(2))
    template.param_groups[0]["lr"] = 1.0  # a scheduler changed the user's learning rate
    _push(server, 0, 1, torch.ones(2))
    # step 1: buf = 1, w = -0.1; step 2: buf = 0.9 + 1 = 1.9, w = -0.1 - 1.0 * 1.9
    torch.testing.assert_close(server.weights, torch.full((2,), -2.0))


# ---------------------------------------------------------------------------- drain, failure


def test_drain_answers_only_when_every_worker_has_drained():
    server = _server(UpdatePolicy(), torch.zeros(2), workers=(0, 1, 2), lr=1.0)
    for worker in range(3):
        _begin(server, worker)
    assert _push(server, 0, 0, torch.ones(2), drain=True) == []
    assert server.handle(Request(RequestKind.STEP, 1, 0, RequestFlag.DRAIN)) == []
    replies = _push(server, 2, 0, torch.ones(2), drain=True)
    assert sorted(r.worker for r in replies) == [0, 1, 2]
    assert all(torch.equal(r.weights, torch.full((2,), -2.0)) for r in replies)
    assert all(server.status(w) == WorkerStatus.IDLE for w in range(3))


def test_softsync_remainder_is_flushed_when_nobody_computes():
    server = _server(UpdatePolicy(softsync=2), torch.zeros(1), workers=(0, 1), lr=1.0)
    _begin(server, 0)
    _begin(server, 1)
    assert _push(server, 0, 0, torch.ones(1), drain=True) == []
    replies = server.handle(Request(RequestKind.STEP, 1, 0, RequestFlag.DRAIN))
    assert sorted(r.worker for r in replies) == [0, 1] and server.version == 1


def test_failed_worker_aborts_waiting_and_later_requests():
    server = _server(UpdatePolicy(max_staleness=0), torch.zeros(1), workers=(0, 1, 2))
    for worker in range(3):
        _begin(server, worker)
    assert _push(server, 0, 0, torch.ones(1)) == []  # waits for workers 1 and 2 (SSP s=0)
    (abort,) = server.fail(2, "connection closed")
    assert (abort.worker, abort.kind, abort.failed_rank) == (0, ReplyKind.ABORT, 2)
    (later,) = _push(server, 1, 0, torch.ones(1))
    assert later.kind == ReplyKind.ABORT and later.failed_rank == 2
    assert server.fail(1, "second failure") == []  # the first failure is the one reported


def test_state_dict_round_trip():
    server = _server(UpdatePolicy(), torch.zeros(2), workers=(0,), momentum=0.9)
    _begin(server, 0)
    _push(server, 0, 0, torch.ones(2))
    state = server.state_dict()
    other = _server(UpdatePolicy(), torch.zeros(2), workers=(0,), momentum=0.9)
    other.load_state_dict(state)
    assert other.version == 1 and torch.equal(other.weights, server.weights)
    _begin(other, 0)
    _begin(server, 0)
    _push(server, 0, 1, torch.ones(2))
    _push(other, 0, 1, torch.ones(2))
    assert torch.equal(other.weights, server.weights)  # momentum came along


def test_wire_headers_round_trip():
    request = Request(RequestKind.STEP, 3, 17, RequestFlag.HAS_GRADIENT | RequestFlag.DRAIN, 2, 9)
    decoded = Request.from_header(request.header())
    assert (decoded.kind, decoded.worker, decoded.read_version, decoded.flags, decoded.want) == (
        RequestKind.STEP,
        3,
        17,
        RequestFlag.HAS_GRADIENT | RequestFlag.DRAIN,
        2,
    )
    reply = Reply(1, ReplyKind.WEIGHTS, 5, torch.zeros(1), 2, ReplyFlag.EPOCH_OVER, 4, -1)
    back = Reply.from_header(1, reply.header(), torch.zeros(1))
    assert (back.version, back.granted, back.flags, back.staleness) == (
        5,
        2,
        ReplyFlag.EPOCH_OVER,
        4,
    )


# ---------------------------------------------------------------------------- budget, layout


def test_epoch_budget_spends_exactly_the_pool():
    budget = EpochBudget()
    granted = [budget.begin(0, 5, 2)[0], budget.begin(1, 5, 2)[0]]
    total = sum(granted)
    while True:
        count, flags = budget.grant(0, 1)
        total += count
        if ReplyFlag.EPOCH_OVER in flags:
            break
    assert total == 10
    assert budget.grant(1, 3) == (0, ReplyFlag.EPOCH_OVER)
    budget.close_epoch()
    assert budget.begin(1, 4, 1)[0] == 1  # a new epoch opens a new pool


def test_run_budget_raises_run_over():
    budget = EpochBudget(run_batches=3)
    assert budget.begin(0, 10, 2) == (2, ReplyFlag.NONE)
    count, flags = budget.grant(0, 5)
    assert count == 1 and ReplyFlag.RUN_OVER in flags and ReplyFlag.EPOCH_OVER in flags


def test_restarted_begin_refunds_the_workers_batches():
    budget = EpochBudget(run_batches=100)
    budget.begin(0, 4, 2)
    budget.begin(1, 4, 2)
    budget.grant(0, 1)  # worker 0 holds 3, worker 1 holds 2, pool 3
    assert budget.begin(0, 4, 2, restart=True) == (2, ReplyFlag.NONE)  # 3 back, 2 out again
    assert (budget.pool, budget.granted, budget.run_remaining) == (4, 4, 96)


def test_layout_cuts_whole_parameters_evenly():
    shapes = [torch.Size([6]), torch.Size([2]), torch.Size([3]), torch.Size([5])]
    layout = ShardLayout.balanced(shapes, 2)
    assert layout.bounds == ((0, 2), (2, 4))
    assert layout.elements_of(0) == (0, 8) and layout.elements_of(1) == (8, 16)
    assert ShardLayout.balanced(shapes, 4).bounds == ((0, 1), (1, 2), (2, 3), (3, 4))
    with pytest.raises(ValueError, match="use shards <= 4"):
        ShardLayout.balanced(shapes, 5)


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_empty_pool_lends_a_slower_workers_spare_batches_to_a_faster_one():
    """Spare = granted and unstarted minus the one batch a worker starts right after a reply;
    an asker with the pool empty takes the spare of workers slower than itself."""
    clock = _Clock()
    budget = EpochBudget(clock=clock)
    assert budget.begin(0, 3, 3)[0] == 3  # the straggler holds all of its 3
    assert budget.begin(1, 3, 1)[0] == 1
    clock.now = 1.0
    budget.grant(1, 0, held=0)  # worker 1: a request every second
    clock.now = 3.0
    budget.grant(0, 0, held=2)  # worker 0: every 3 s; holds 2, starts 1 now: 1 spare
    clock.now = 3.5
    assert budget.grant(1, 3, held=0) == (3, ReplyFlag.EPOCH_OVER)  # 2 from the pool, 1 lent
    clock.now = 6.0
    # the straggler (it started one of its 2 since) learns it lent one: it holds none now
    assert budget.grant(0, 1, held=1) == (-1, ReplyFlag.EPOCH_OVER)
    assert budget.granted == 6  # still exactly the epoch's batches
    # the slower worker never takes from the faster one
    clock.now = 7.0
    assert budget.grant(0, 2, held=0) == (0, ReplyFlag.EPOCH_OVER)


def test_at_the_tail_a_slow_worker_returns_everything_the_fast_ones_finish_sooner():
    """Worker 0 needs 3 s a batch, worker 1 needs 1 s: with 1 batch in the pool and 1 held by
    worker 0, worker 1 does both in 2 s < 3 s, so worker 0 returns its batch (also the one it
    would have started) and stops; the epoch still trains exactly its batches."""
    clock = _Clock()
    budget = EpochBudget(clock=clock)
    budget.begin(0, 2, 1)
    budget.begin(1, 2, 1)  # pool 2
    clock.now = 1.0
    budget.grant(1, 0, held=0)
    clock.now = 2.0
    budget.grant(1, 0, held=0)  # worker 1: every second
    clock.now = 3.0
    assert budget.grant(0, 1, held=0) == (1, ReplyFlag.NONE)  # 3 s: pool 1 left, it holds 1
    clock.now = 6.0
    # worker 0 still holds its batch (held=1); worker 1 would finish it and the pool's in 2 s
    assert budget.grant(0, 1, held=1) == (-1, ReplyFlag.EPOCH_OVER)
    assert budget.pool == 2
    clock.now = 6.5
    assert budget.grant(1, 2, held=0) == (2, ReplyFlag.EPOCH_OVER)
    assert budget.granted == 4 and budget.grant(0, 1, held=0)[0] == 0  # it stays out


def test_a_worker_that_keeps_its_grants_lends_nothing():
    clock = _Clock()
    budget = EpochBudget(clock=clock)
    budget.begin(0, 3, 3, lends=False)
    budget.begin(1, 3, 3)
    for now in (1.0, 2.0, 3.0):
        clock.now = now
        budget.grant(0, 0, held=2, lends=False)
        budget.grant(1, 0, held=2)
    clock.now, _ = 3.5, budget.grant(1, 0, held=2)  # worker 1 asks more often: faster
    assert budget.grant(1, 5, held=0) == (0, ReplyFlag.EPOCH_OVER)


def test_unshared_budget_gives_each_worker_exactly_its_own_batches():
    budget = EpochBudget(share=False)  # synchronous training: each worker its own share, as DDP
    assert budget.begin(0, 3, 2)[0] == 2 and budget.begin(1, 3, 2)[0] == 2
    assert budget.grant(0, 2, held=0) == (1, ReplyFlag.EPOCH_OVER)  # not worker 1's batches
    assert budget.grant(1, 2, held=0) == (1, ReplyFlag.EPOCH_OVER)


def test_lr_scale_multiplies_every_update_and_auto_is_softsync_over_workers():
    """w1 = w0 - lr * lr_scale * f(tau) * g, by hand, with inverse scaling on top."""
    policy = UpdatePolicy(staleness="inverse", lr_scale=0.25)
    server = _server(policy, torch.zeros(2, dtype=torch.float64), workers=(0, 1), lr=0.5)
    _begin(server, 0)
    _begin(server, 1)
    one = torch.ones(2, dtype=torch.float64)
    _push(server, 0, 0, 4 * one)  # fresh: w = -0.5 * 0.25 * 4 = -0.5
    _push(server, 1, 0, 4 * one)  # staleness 1, factor 1/2: w = -0.5 - 0.5 * 0.25 * 0.5 * 4
    torch.testing.assert_close(server.weights, -0.75 * one)
    with pytest.raises(ValueError, match="lr_scale must be a finite value > 0"):
        UpdatePolicy(lr_scale=0)

    from lightning_parallel.strategies.parameter_server import ParameterServerStrategy

    strategy = ParameterServerStrategy(softsync=2, lr_scale="auto")
    assert strategy.lr_scale_auto and strategy.policy.lr_scale == 1.0  # resolved at setup


def test_gradient_of_the_read_before_last_is_compensated_against_those_weights():
    """An overlapping worker tags its gradient with the version before its last read."""
    server = _server(UpdatePolicy(delay_compensation=0.1), torch.zeros(1), lr=1.0)
    _begin(server, 0)
    _begin(server, 1)
    (reply,) = _push(server, 1, 0, torch.ones(1))  # applied: w = -1, worker 1 reads version 1
    assert reply.version == 1 and torch.equal(reply.weights, torch.full((1,), -1.0))
    # computed on version 0 (w = 0) while the exchange was in flight: staleness 1 and
    # DC-ASGD's g + λ·g⊙g⊙(w_now − w_read) = 2 + 0.1·4·(−1 − 0) = 1.6
    (reply,) = _push(server, 1, 0, torch.full((1,), 2.0))
    assert reply.staleness == 1
    torch.testing.assert_close(reply.weights, torch.full((1,), -2.6))
    with pytest.raises(ValueError, match="version 7"):
        _push(server, 0, 7, torch.ones(1))


def test_a_reply_s_weights_stay_as_read_while_held_and_released_snapshots_are_reused():
    # the server reuses snapshot buffers (a fresh vector costs its page faults every version):
    # one held by a reply must never be overwritten, one released must be reused
    lr = 0.5
    w0 = torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64)
    server = _server(UpdatePolicy(), w0.clone(), lr=lr)
    _begin(server, 0)
    _begin(server, 1)
    (held,) = _push(server, 0, 0, torch.ones(3, dtype=torch.float64))
    as_read = held.weights.clone()
    torch.testing.assert_close(as_read, w0 - lr)
    (second,) = _push(server, 1, 0, torch.ones(3, dtype=torch.float64))
    (third,) = _push(server, 0, 1, torch.ones(3, dtype=torch.float64))
    assert held.weights.data_ptr() not in (second.weights.data_ptr(), third.weights.data_ptr())
    torch.testing.assert_close(held.weights, as_read, rtol=0, atol=0)
    torch.testing.assert_close(third.weights, w0 - 3 * lr)
    released = weakref.ref(second.weights)
    del second
    (fourth,) = _push(server, 1, 2, torch.ones(3, dtype=torch.float64))
    assert fourth.weights is released()  # the same buffer, not a new one
    torch.testing.assert_close(fourth.weights, w0 - 4 * lr)
    torch.testing.assert_close(held.weights, as_read, rtol=0, atol=0)
