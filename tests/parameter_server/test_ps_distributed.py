"""The parameter server on real gloo processes: equivalence, SSP bound, budget, faults."""

import os
import signal
import time

import pytest
import torch
from helpers.distributed import run_distributed, start_fork_server
from torch import nn

from lightning_parallel.parameter_server import ParameterServerRuntime, UpdatePolicy
from lightning_parallel.parameter_server.data import BudgetedLoader
from lightning_parallel.strategies.parameter_server import ParameterServerStrategy

_DIM, _OUT, _BATCH = 6, 3, 8


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(_DIM, 5), nn.Tanh(), nn.Linear(5, _OUT))


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(_BATCH, _DIM, generator=generator), torch.randint(
        0, _OUT, (_BATCH,), generator=generator
    )


#: seconds of heartbeat silence that declare a rank lost in the fault tests: long enough for a
#: busy machine (a CPU hog beside the run) to keep every heartbeat
BUSY_SAFE = 6.0


def _train(
    rank,
    world,
    policy,
    steps,
    shards=1,
    delay=None,
    keep_trace=False,
    timeout=30.0,
    on_step=None,
    overlap=False,
    continue_without_lost=True,
    lost=None,
):
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
    runtime = ParameterServerRuntime(
        optimizer,
        policy,
        shards=shards,
        timeout=timeout,
        keep_trace=keep_trace,
        overlap=overlap,
        continue_without_lost=continue_without_lost,
    )
    runtime.client.begin_epoch(steps)
    for step in range(steps):
        if on_step is not None:
            on_step(rank, step)
        optimizer.zero_grad()
        x, y = _batch(rank, step)
        nn.functional.cross_entropy(model(x), y).backward()
        if delay is not None:
            time.sleep(delay(rank))
        runtime.client.step(True, drain=step == steps - 1)
    if lost is not None:
        lost.extend(runtime.lost_workers())
    gathered = runtime.gather_state()
    trace = [host.server.statistics.trace for host in runtime.local_hosts.values()]
    runtime.close()
    weights = [p.detach().clone() for p in model.parameters()]
    return weights, gathered, trace


def _synchronous_reference(world, steps):
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
    for step in range(steps):
        optimizer.zero_grad()
        for rank in range(world):
            x, y = _batch(rank, step)
            (nn.functional.cross_entropy(model(x), y) / world).backward()
        optimizer.step()
    return model, optimizer


@pytest.mark.parametrize("shards", [1, 2])
def test_max_staleness_zero_equals_synchronous_training(shards):
    world, steps = 3, 6

    def fn(rank, world):
        # rank 1 is slow: without the SSP bound its gradients would be stale
        return _train(
            rank,
            world,
            UpdatePolicy(max_staleness=0),
            steps,
            shards=shards,
            delay=lambda r: 0.02 if r == 1 else 0.0,
        )

    results = run_distributed(fn, world, timeout=90)
    reference, reference_optimizer = _synchronous_reference(world, steps)
    for weights, _, _ in results:  # every worker ends the epoch with the same weights
        for got, want in zip(weights, reference.parameters()):
            torch.testing.assert_close(got, want.detach(), rtol=0, atol=1e-6)
    optimizer_state, server_state = results[0][1]
    assert server_state["versions"] == [steps] * shards
    expected = reference_optimizer.state_dict()
    assert optimizer_state["param_groups"] == expected["param_groups"]
    for index, values in expected["state"].items():
        torch.testing.assert_close(
            optimizer_state["state"][index]["momentum_buffer"],
            values["momentum_buffer"],
            rtol=0,
            atol=1e-6,
        )


@pytest.mark.parametrize("shards", [1, 2])
def test_overlap_computes_each_gradient_one_exchange_late_exactly(shards):
    """One worker with overlap: update t applies the gradient taken at the weights of t − 1.

    Reference: W₁ = opt(W₀, g(W₀)), W_{t+1} = opt(W_t, g(W_{t−1})); staleness 0 then 1.
    """
    world, steps = 2, 7

    def fn(rank, world):
        if rank == 1:  # the second rank only hosts shard 1 (or nothing) and leaves at once
            model = _model()
            optimizer = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
            runtime = ParameterServerRuntime(
                optimizer, UpdatePolicy(), shards=shards, keep_trace=True, overlap=True
            )
            runtime.client.begin_epoch(0)
            runtime.client.drain()
            trace = [host.server.statistics.trace for host in runtime.local_hosts.values()]
            runtime.gather_state()
            runtime.close()
            return None, None, trace
        return _train(
            rank, world, UpdatePolicy(), steps, keep_trace=True, overlap=True, shards=shards
        )

    results = run_distributed(fn, world, timeout=90)
    reference = _model()
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.2, momentum=0.9)
    computed_on = [p.detach().clone() for p in reference.parameters()]
    for step in range(steps):
        before = [p.detach().clone() for p in reference.parameters()]
        with torch.no_grad():  # the gradient of this step, taken at the weights of step − 1
            for p, w in zip(reference.parameters(), computed_on):
                p.copy_(w)
        optimizer.zero_grad()
        x, y = _batch(0, step)
        nn.functional.cross_entropy(reference(x), y).backward()
        with torch.no_grad():
            for p, w in zip(reference.parameters(), before):
                p.copy_(w)
        optimizer.step()
        computed_on = before
    weights, _, trace = results[0]
    for got, want in zip(weights, reference.parameters()):
        torch.testing.assert_close(got, want.detach(), rtol=0, atol=1e-6)
    staleness = [s for worker, s in trace[0] if worker == 0]
    assert staleness == [0] + [1] * (steps - 1)


def test_overlap_with_a_staleness_bound_is_refused():
    with pytest.raises(ValueError, match="max_staleness"):
        ParameterServerStrategy(overlap=True, max_staleness=2)


@pytest.mark.slow
def test_ssp_bound_holds_with_a_straggler():
    world, steps, bound = 3, 12, 2

    def fn(rank, world):
        return _train(
            rank,
            world,
            UpdatePolicy(max_staleness=bound),
            steps,
            keep_trace=True,
            delay=lambda r: 0.03 if r == 2 else 0.0,
        )

    results = run_distributed(fn, world, timeout=90)
    (trace,) = results[0][2]
    staleness = [s for _, s in trace]
    assert len(staleness) == world * steps
    assert max(staleness) <= bound
    assert max(staleness) > 0  # the straggler made it asynchronous


@pytest.mark.slow
def test_unbounded_run_is_stale_and_budget_favours_fast_workers():
    world, batches = 3, 8

    def fn(rank, world):
        model = _model()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        runtime = ParameterServerRuntime(
            optimizer, UpdatePolicy(staleness="inverse"), keep_trace=True
        )
        loader = BudgetedLoader([_batch(rank, i) for i in range(batches)], lambda: runtime.client)
        counts = []
        for _ in range(2):  # two epochs
            # the ranks meet before each epoch, as Lightning's validation makes them: a rank
            # that began alone could spend its own batches before the others' joined the pool
            torch.distributed.barrier()
            iterator, taken = iter(loader), 0
            batch = next(iterator)
            while batch is not None:
                following = next(iterator, None)  # prefetch one, as Lightning does
                optimizer.zero_grad()
                nn.functional.cross_entropy(model(batch[0]), batch[1]).backward()
                if rank == 2:
                    time.sleep(0.04)
                runtime.client.step(True, drain=following is None)
                taken += 1
                batch = following
            counts.append(taken)
        trace = [host.server.statistics.trace for host in runtime.local_hosts.values()]
        runtime.close()
        return counts, trace

    results = run_distributed(fn, world, timeout=90)
    counts = [r[0] for r in results]
    for epoch in range(2):
        per_rank = [c[epoch] for c in counts]
        assert sum(per_rank) == world * batches  # the epoch is exactly the pool
        assert per_rank[2] < batches < max(per_rank[:2])  # the straggler took less
    (trace,) = results[0][1]
    assert max(s for _, s in trace) >= 2


def test_a_begin_lends_its_grants_only_for_a_worker_that_reserves_one_batch_at_a_time():
    """The ``BEGIN`` request's flag, as the server reads it: lending with ``reserving=True``,
    keeping its grants without it, and kept whatever is said by a worker that may start
    several batches between requests (``overlap=True``)."""

    def fn(rank, world):
        seen = []
        for overlap, reserving in ((False, True), (False, False), (True, True)):
            model = _model()
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
            runtime = ParameterServerRuntime(optimizer, UpdatePolicy(), overlap=overlap)
            runtime.client.begin_epoch(4, reserving=reserving)
            (host,) = runtime.local_hosts.values()
            seen.append(host.server._worker(rank).lends)
            runtime.close()
        return seen

    assert run_distributed(fn, 1, timeout=60) == [[True, False, False]]


@pytest.mark.slow
def test_a_slow_worker_s_begin_grant_goes_to_the_fast_worker_at_the_epoch_s_end():
    """As under Lightning: the loader reserves each batch as it is fetched (one ahead) and the
    trainer spends the grant as the batch starts. Rank 1 takes 0.5 s a batch, rank 0 a few ms;
    4 batches each, a pool of 8. In epoch 2 the server knows rank 1 is slower, and when rank 0
    has emptied the pool it takes the second batch rank 1 was granted at its ``BEGIN``: rank 1
    trains one batch and skips one, and rank 0 does not wait for a second slow batch. Before,
    the ``BEGIN`` kept its grants (its request flagged ``KEEPS_GRANTS``) and epoch 2 went 6
    and 2, like epoch 1. The ranks meet before each epoch, as Lightning's validation makes
    them, and rank 0 takes 50 ms a batch: without either it may spend its own 4 batches
    before rank 1's ``BEGIN`` adds rank 1's to the pool."""
    world, batches = 2, 4

    def fn(rank, world):
        model = _model()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        runtime = ParameterServerRuntime(optimizer, UpdatePolicy(staleness="inverse"))
        loader = BudgetedLoader(
            [_batch(rank, i) for i in range(batches)], lambda: runtime.client, deferred=True
        )
        epochs = []
        for _ in range(2):
            torch.distributed.barrier()
            iterator, trained, skipped = iter(loader), 0, 0
            batch = next(iterator)
            while batch is not None:
                following = next(iterator, None)  # prefetch one, as Lightning does
                if runtime.client.start_batch():
                    optimizer.zero_grad()
                    nn.functional.cross_entropy(model(batch[0]), batch[1]).backward()
                    time.sleep(0.5 if rank == 1 else 0.05)
                    runtime.client.step(True, drain=following is None)
                    trained += 1
                else:
                    skipped += 1
                    if following is None:
                        runtime.client.drain()
                batch = following
            epochs.append((trained, skipped))
        runtime.close()
        return epochs

    fast, slow = run_distributed(fn, world, timeout=90)
    assert fast[0][0] + slow[0][0] == fast[1][0] + slow[1][0] == world * batches
    assert slow[0] == (2, 0)  # epoch 1: the server does not know rank 1's pace yet
    assert slow[1] == (1, 1) and fast[1] == (7, 0)


@pytest.mark.slow
def test_server_threads_and_default_group_collectives_do_not_interfere():
    """Server threads answer on their own group while the main threads allreduce on Lightning's."""
    world, steps = 3, 15

    def fn(rank, world):
        sums = []

        def collective(rank, step):
            value = torch.tensor([float(rank + step)])
            torch.distributed.all_reduce(value)  # the default group, from the main thread
            sums.append(value.item())

        _train(rank, world, UpdatePolicy(), steps, on_step=collective, delay=lambda r: 0.01 * r)
        return sums

    results = run_distributed(fn, world, timeout=90)
    expected = [float(sum(range(world)) + world * step) for step in range(steps)]
    assert all(sums == expected for sums in results)


@pytest.mark.faults
@pytest.mark.parametrize(
    "policy", [UpdatePolicy(), UpdatePolicy(max_staleness=0)], ids=["async", "ssp0"]
)
def test_killed_worker_stops_the_others_naming_it_when_told_to(policy):
    def fn(rank, world):
        def die(rank, step):
            if rank == 2 and step == 3:
                os._exit(1)

        _train(rank, world, policy, 200, on_step=die, timeout=20.0, continue_without_lost=False)

    start_fork_server()  # its first start is not the run's time
    start = time.monotonic()
    with pytest.raises(RuntimeError) as raised:
        run_distributed(fn, 3, timeout=60)
    assert time.monotonic() - start < 45  # far from the harness timeout: no hang
    assert "WorkerFailure" in str(raised.value)
    assert "worker rank 2 failed" in str(raised.value)


@pytest.mark.faults
@pytest.mark.parametrize("fault", ["kill", "freeze"])
@pytest.mark.parametrize(
    "policy",
    [UpdatePolicy(), UpdatePolicy(max_staleness=0), UpdatePolicy(softsync=3)],
    ids=["async", "ssp0", "softsync3"],
)
def test_the_others_go_on_without_a_lost_worker(policy, fault):
    """Rank 2 dies (or freezes) at its 4th step; ranks 0 and 1 finish every step of theirs,
    drain together (even synchronous SGD and 3-softsync no longer wait for rank 2) and learn
    at the drain that rank 2 was lost, and why."""
    steps = 30

    def fn(rank, world):
        def stop(rank, step):
            if rank == 2 and step == 3:
                if fault == "kill":
                    os._exit(1)
                os.kill(os.getpid(), signal.SIGSTOP)

        lost = []
        weights, _, trace = _train(
            rank, world, policy, steps, on_step=stop, timeout=BUSY_SAFE, lost=lost, keep_trace=True
        )
        return weights, lost, trace

    start_fork_server()  # its first start is not the run's time
    start = time.monotonic()
    results = run_distributed(fn, 3, timeout=60, may_vanish={2})
    assert time.monotonic() - start < 45
    assert results[2] is None
    (weights0, lost0, trace), (weights1, lost1, _) = results[0], results[1]
    assert [rank for rank, _ in lost0] == [rank for rank, _ in lost1] == [2]
    reason = lost0[0][1]
    assert ("connection" in reason) if fault == "kill" else ("no heartbeat" in reason)
    for left, right in zip(weights0, weights1):  # both left the epoch with the server's weights
        assert torch.equal(left, right)
    # the shard (on rank 0) took every gradient of ranks 0 and 1, and rank 2's first three
    workers = [worker for worker, _ in trace[0]]
    assert {rank: workers.count(rank) for rank in range(3)} == {0: steps, 1: steps, 2: 3}


@pytest.mark.faults
def test_frozen_worker_is_detected_by_its_silent_heartbeat():
    def fn(rank, world):
        def freeze(rank, step):
            if rank == 1 and step == 2:
                os.kill(os.getpid(), signal.SIGSTOP)

        _train(
            rank,
            world,
            UpdatePolicy(max_staleness=0),
            100,
            on_step=freeze,
            timeout=BUSY_SAFE,
            continue_without_lost=False,
        )

    start_fork_server()  # its first start is not the run's time
    start = time.monotonic()
    with pytest.raises(RuntimeError) as raised:
        run_distributed(fn, 3, timeout=60)
    assert time.monotonic() - start < 50
    assert "worker rank 1 failed" in str(raised.value)
    assert "no heartbeat" in str(raised.value)


@pytest.mark.faults
def test_dead_server_host_is_named_by_the_workers():
    def fn(rank, world):
        def die(rank, step):
            if rank == 0 and step == 3:
                os._exit(1)

        _train(rank, world, UpdatePolicy(), 200, on_step=die)

    with pytest.raises(RuntimeError) as raised:
        run_distributed(fn, 2, timeout=60)
    assert "shard 0 on rank 0" in str(raised.value) and "rank 0 failed or is unreachable" in str(
        raised.value
    )


def test_bfloat16_wire_halves_the_gradient_bytes_and_the_server_keeps_float32():
    """Rank 1 pushes g in bfloat16: the server applies w − η·bf16(g) in float32; rank 1 reads
    the weights rounded to bfloat16, rank 0 (the shard's own rank) reads them exactly."""
    from lightning_parallel.parameter_server.protocol import HEADER_SIZE

    def fn(rank, world):
        torch.manual_seed(0)
        layer = nn.Linear(4, 3)
        optimizer = torch.optim.SGD(layer.parameters(), lr=0.5)
        runtime = ParameterServerRuntime(optimizer, UpdatePolicy(), wire_dtype=torch.bfloat16)
        runtime.client.begin_epoch(1)
        if rank == 1:
            for p in layer.parameters():
                p.grad = torch.linspace(-1.0, 1.0, p.numel()).reshape(p.shape) / 3.0
            runtime.client.step(True, drain=True)
        else:
            runtime.client.drain()
        sent = runtime.client.take_bytes()
        weights = [p.detach().clone() for p in layer.parameters()]
        runtime.gather_state()
        runtime.close()
        return weights, sent

    (exact, _), (rounded, sent) = run_distributed(fn, 2, timeout=60)
    torch.manual_seed(0)
    reference = nn.Linear(4, 3)
    for p, got, got_rounded in zip(reference.parameters(), exact, rounded):
        g = (torch.linspace(-1.0, 1.0, p.numel()).reshape(p.shape) / 3.0).bfloat16().float()
        want = p.detach() - 0.5 * g
        torch.testing.assert_close(got, want, rtol=0, atol=0)
        torch.testing.assert_close(got_rounded, want.bfloat16().float(), rtol=0, atol=0)
    assert sent == 2 * HEADER_SIZE * 8 + 15 * 2  # BEGIN and STEP headers, 15 bfloat16 values
    with pytest.raises(ValueError, match="wire_dtype"):
        ParameterServerStrategy(wire_dtype="int8")
