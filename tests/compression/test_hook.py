"""The Hylo DDP communication hook on real gloo process groups, with torch's DDP."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.distributed as dist
from helpers.distributed import run_distributed
from helpers.spies import recording
from torch import nn

from lightning_parallel.compression import CostModel, HyloHook, HyloPolicy
from lightning_parallel.compression.exchange import PIECE_NUMEL, resolve_piece_numel


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 16, 3),  # 432 weights: kernel top-k
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(16 * 4 * 4, 32),  # 8192 weights: 2-bit
        nn.ReLU(),
        nn.Linear(32, 5),  # small: dense
    )


def _policy(**kwargs: Any) -> HyloPolicy:
    return HyloPolicy(**{"min_compress_numel": 400, "conv_rate": 0.2, **kwargs})


def _batch(rank: int, step: int) -> torch.Tensor:
    return torch.randn(4, 3, 6, 6, generator=torch.Generator().manual_seed(100 * step + rank))


def _ddp(module: nn.Module) -> nn.parallel.DistributedDataParallel:
    # Tiny buckets: several per step, and DDP rebuilds them after the first iteration.
    return nn.parallel.DistributedDataParallel(module, bucket_cap_mb=0.01)


def _grads(module: nn.Module) -> list[torch.Tensor]:
    return [p.grad.detach().clone() for p in module.parameters()]  # type: ignore[union-attr]


def _step(ddp: nn.parallel.DistributedDataParallel, rank: int, step: int) -> list[torch.Tensor]:
    ddp.zero_grad()
    ddp(_batch(rank, step)).square().mean().backward()
    return _grads(ddp.module)


def _equal_to_ddp(rank: int, world: int, codec: str, warmup_steps: int, overlap: bool) -> bool:
    reference = _ddp(_model())
    hooked = _ddp(_model())
    policy = _policy(codec=codec)
    hook = HyloHook(hooked.module.named_parameters(), policy, warmup_steps, overlap=overlap)
    hook.register(hooked)
    for step in range(4):
        expected, got = _step(reference, rank, step), _step(hooked, rank, step)
        if not all(torch.equal(a, b) for a, b in zip(expected, got)):
            return False
    return True


@pytest.mark.parametrize("overlap", [True, False], ids=["background thread", "in the hook"])
@pytest.mark.parametrize(("codec", "warmup_steps"), [("none", 0), ("hylo", 4)])
def test_without_compression_the_hook_equals_ddp_bit_for_bit(
    codec: str, warmup_steps: int, overlap: bool
) -> None:
    assert run_distributed(_equal_to_ddp, 2, codec, warmup_steps, overlap) == [True, True]


def _conservation(rank: int, world: int, mode: str, overlap: bool) -> dict[str, Any]:
    """Sum of averaged gradients + residuals == sum of true mean gradients, per parameter."""
    ddp = _ddp(_model())
    hook = HyloHook(
        ddp.module.named_parameters(), _policy(), 0, two_bit_exchange=mode, overlap=overlap
    )
    hook.register(ddp)
    local = copy.deepcopy(ddp.module)  # same weights (no optimizer step): the local gradients
    names = [name for name, _ in ddp.module.named_parameters()]
    sent = [torch.zeros_like(p) for p in ddp.module.parameters()]
    true = [torch.zeros_like(p) for p in ddp.module.parameters()]
    for step in range(5):
        for total, grad in zip(sent, _step(ddp, rank, step)):
            total += grad
        local.zero_grad()
        local(_batch(rank, step)).square().mean().backward()
        for total, param in zip(true, local.parameters()):
            mean = param.grad.detach().clone()  # type: ignore[union-attr]
            dist.all_reduce(mean)
            total += mean / world
    residual_mean = []
    for name, param in zip(names, ddp.module.parameters()):
        worker = hook.memory.residual(name)
        worker = torch.zeros_like(param) if worker is None else worker.reshape(param.shape).clone()
        dist.all_reduce(worker)
        residual_mean.append(worker / world)
    servers: list[dict[str, torch.Tensor]] = [{} for _ in range(world)]
    dist.all_gather_object(servers, hook.server_memory.state_dict())
    return {
        "names": names,
        "sent": sent,
        "true": true,
        "residual": residual_mean,
        "server": servers,
        "calls": hook.calls,
        "step": hook.step,
        "residual_keys": sorted(hook.memory),
    }


@pytest.mark.parametrize(
    ("mode", "overlap"), [("two_phase", True), ("two_phase", False), ("allgather", True)]
)
def test_nothing_is_lost_across_steps_and_bucket_rebuilds(mode: str, overlap: bool) -> None:
    world = 2
    results = run_distributed(_conservation, world, mode, overlap)
    result = results[0]
    assert result["step"] == 5
    assert result["calls"] > 5  # several buckets per step
    assert result["residual_keys"] == ["0.weight", "3.weight"]  # keyed by name, not bucket
    for index, name in enumerate(result["names"]):
        total = result["sent"][index] + result["residual"][index]
        # The second residuals live with the chunk owners, in rank order.
        chunks = [c for server in result["server"] for k, c in server.items() if k.startswith(name)]
        if chunks:
            total = total + torch.cat(chunks)[: total.numel()].reshape(total.shape)
        torch.testing.assert_close(total, result["true"][index], rtol=1e-5, atol=1e-5)
    for other in results[1:]:  # every rank applies the same averaged gradients
        assert all(torch.equal(a, b) for a, b in zip(other["sent"], result["sent"]))


def _resume(rank: int, world: int, every_route: bool) -> bool:
    model = _every_route_model if every_route else _model
    first = _ddp(model())
    hook = HyloHook(first.module.named_parameters(), _policy(rank=2), warmup_steps=1)
    hook.register(first)
    for step in range(3):
        _step(first, rank, step)
    state = copy.deepcopy(hook.state_dict())
    second = _ddp(model())
    resumed = HyloHook(second.module.named_parameters(), _policy(rank=2), warmup_steps=1)
    resumed.load_state_dict(state)
    resumed.register(second)
    for step in range(3, 6):
        a, b = _step(first, rank, step), _step(second, rank, step)
        if not all(torch.equal(x, y) for x, y in zip(a, b)):
            return False
    return resumed.step == hook.step == 6


@pytest.mark.parametrize("every_route", [False, True], ids=["2-bit", "with low rank"])
def test_state_dict_resume_is_exact(every_route: bool) -> None:
    # with low rank: the warm-start factors come back with the state, or step 4 differs
    assert run_distributed(_resume, 2, every_route) == [True, True]


def _cost_model(rank: int, world: int, bandwidth: float) -> dict[str, Any]:
    ddp = _ddp(_model())
    cost = CostModel(bandwidth=bandwidth)
    hook = HyloHook(
        ddp.module.named_parameters(), _policy(), 1, cost_model=cost, calibration_steps=2
    )
    hook.register(ddp)
    synchronized: list[bool] = []  # per exchange: whether it timed the device's work (CUDA)
    start = hook.exchange.start

    def recording(layers: Any) -> Any:
        synchronized.append(hook.exchange.calibrating)
        return start(layers)

    hook.exchange.start = recording  # type: ignore[method-assign]
    local = copy.deepcopy(ddp.module)
    sent = [torch.zeros_like(p) for p in ddp.module.parameters()]
    true = [torch.zeros_like(p) for p in ddp.module.parameters()]
    for step in range(5):
        for total, grad in zip(sent, _step(ddp, rank, step)):
            total += grad
        local.zero_grad()
        local(_batch(rank, step)).square().mean().backward()
        for total, param in zip(true, local.parameters()):
            mean = param.grad.detach().clone()  # type: ignore[union-attr]
            dist.all_reduce(mean)
            total += mean / world
    return {
        "compress": {name: d.compress for name, d in cost.decisions.items()},
        "routes": {name: plan.route for name, plan in hook.plans.items()},
        "residuals": sorted(hook.memory) + sorted(hook.server_memory),
        "sent": sent,
        "true": true,
        "synchronized": synchronized,
    }


def test_cost_model_keeps_layers_uncompressed_when_the_link_is_fast() -> None:
    fast = run_distributed(_cost_model, 2, 1e15)  # bytes per second: transfer is free
    slow = run_distributed(_cost_model, 2, 1e3)  # transfer is dear
    for result in (fast, slow):  # every rank decides the same
        assert result[0]["compress"] == result[1]["compress"]
        assert result[0]["routes"] == result[1]["routes"]
    assert fast[0]["compress"] == {"0.weight": False, "3.weight": False}
    assert set(fast[0]["routes"].values()) == {"dense"}
    # Back to dense, the layers flushed what they kept while compressed: nothing is lost.
    assert fast[0]["residuals"] == []
    for sent, true in zip(fast[0]["sent"], fast[0]["true"]):
        torch.testing.assert_close(sent, true, rtol=1e-5, atol=1e-6)
    assert slow[0]["compress"] == {"0.weight": True, "3.weight": True}
    # the two calibration steps time the device's work (synchronising on CUDA); later ones not
    calibrating = len(fast[0]["synchronized"])  # 2 steps of every compressed bucket
    assert calibrating >= 2 and fast[0]["synchronized"] == [True] * calibrating
    assert slow[0]["synchronized"] == [True] * calibrating + [False] * calibrating
    assert slow[0]["routes"]["0.weight"] == "kernel" and slow[0]["routes"]["3.weight"] == "two_bit"


def test_cost_model_needs_a_calibration_step() -> None:
    with pytest.raises(ValueError, match="calibration_steps must be >= 1"):
        HyloHook(_model().named_parameters(), cost_model=CostModel(), calibration_steps=0)


def _failing_exchange(rank: int, world: int) -> str:
    ddp = _ddp(_model())
    hook = HyloHook(ddp.module.named_parameters(), _policy(), warmup_steps=0, overlap=True)
    hook.register(ddp)

    def broken(layers: Any) -> Any:
        raise ValueError("codec exploded")

    hook.exchange.start = broken  # type: ignore[method-assign]
    try:
        _step(ddp, rank, 0)
    except Exception as error:  # DDP re-raises the background thread's error
        return str(error)
    return "no error"


def test_an_error_on_the_background_thread_raises_in_backward_instead_of_hanging() -> None:
    messages = run_distributed(_failing_exchange, 2, timeout=60)
    assert all("codec exploded" in message for message in messages)


def _settings_differ(rank: int, world: int, setting: str, overlap: bool) -> dict[str, Any]:
    ddp = _ddp(_model())
    odd = rank == 1  # rank 1 was given (or resumed) another value of `setting`
    hook = HyloHook(
        ddp.module.named_parameters(),
        _policy(conv_rate=0.1 if odd and setting == "plans" else 0.2),
        warmup_steps=1 if odd and setting == "warmup_steps" else 0,
        overlap=overlap,
        piece_numel=1024 if odd and setting == "piece_numel" else 2048,
    )
    if odd and setting == "step":  # a checkpoint of another step, on one rank
        hook.load_state_dict(dict(hook.state_dict(), step=5))
    hook.register(ddp)
    try:
        _step(ddp, rank, 0)
        first = "no error"
    except Exception as error:  # DDP re-raises what the hook raised
        first = str(error)
    params = list(ddp.module.parameters())
    flat = torch.zeros(sum(p.numel() for p in params))
    with recording(dist, "all_reduce") as reductions:
        try:  # a later exchange raises the same error, without communicating
            hook.average_flat(flat, params)
            later = "no error"
        except ValueError as error:
            later = str(error)
    return {"first": first, "later": later, "reductions": len(reductions)}


@pytest.mark.parametrize(
    ("setting", "overlap"),
    [
        ("piece_numel", True),
        ("piece_numel", False),
        ("warmup_steps", True),
        ("plans", False),
        ("step", True),
    ],
)
def test_ranks_with_different_settings_raise_instead_of_hanging(
    setting: str, overlap: bool
) -> None:
    results = run_distributed(_settings_differ, 2, setting, overlap, timeout=60)
    for rank, result in enumerate(results):
        expected = f"HyloHook: {setting} differ across ranks (rank {rank} has {setting}="
        assert expected in result["first"], result["first"]
        assert result["later"].startswith(expected) and result["reductions"] == 0


def _resume_after_decisions(rank: int, world: int) -> dict[str, Any]:
    """Five steps with a cost model (decisions made), then a new hook resumed from them."""
    ddp = _ddp(_model())
    hook = HyloHook(ddp.module.named_parameters(), _policy(), 1, cost_model=CostModel(1e15))
    hook.register(ddp)
    for step in range(5):
        _step(ddp, rank, step)
    resumed_ddp = _ddp(copy.deepcopy(ddp.module))
    resumed = HyloHook(
        resumed_ddp.module.named_parameters(), _policy(), 1, cost_model=CostModel(1e15)
    )
    resumed.load_state_dict(hook.state_dict())
    resumed.register(resumed_ddp)
    _step(resumed_ddp, rank, 5)  # the settings check passes: the ranks share the decisions
    return {"routes": {n: plan.route for n, plan in resumed.plans.items()}, "step": resumed.step}


def test_a_resume_after_cost_model_decisions_passes_the_settings_check() -> None:
    results = run_distributed(_resume_after_decisions, 2, timeout=60)
    assert results[0] == results[1] and results[0]["step"] == 6
    assert set(results[0]["routes"].values()) == {"dense"}  # the decisions came back


def _pieces_through_the_hook(
    rank: int, world: int, mode: str, piece_numel: int | None
) -> dict[str, Any]:
    """Four DDP steps with the 2-bit layer (8192 weights, blocks of 512) cut into pieces."""
    ddp = _ddp(_model())
    hook = HyloHook(
        ddp.module.named_parameters(),
        _policy(),
        two_bit_exchange=mode,
        overlap=True,
        piece_numel=piece_numel,
    )
    hook.register(ddp)
    with recording(dist, "all_gather") as gathers, recording(dist, "all_to_all_single") as sends:
        grads = [_step(ddp, rank, step) for step in range(4)]
    calls = {"all_gather": len(gathers), "all_to_all_single": len(sends)}
    return {"grads": grads, "calls": calls}


@pytest.mark.parametrize(("mode", "world"), [("allgather", 2), ("two_phase", 3)])
def test_the_hook_pipelines_pieces_with_the_same_gradients(mode: str, world: int) -> None:
    whole = run_distributed(_pieces_through_the_hook, world, mode, None)
    pieces = run_distributed(_pieces_through_the_hook, world, mode, 1024)
    for rank in range(world):
        for expected, got in zip(whole[rank]["grads"], pieces[rank]["grads"]):
            assert all(torch.equal(a, b) for a, b in zip(expected, got))
    # the 2-bit layer's collectives: one per step in one piece, one per piece of 1024 values
    # (2 blocks; two-phase: 1536, 3 blocks, one per rank's chunk) with pieces
    route = "all_gather" if mode == "allgather" else "all_to_all_single"
    expected_messages = 8192 // 1024 if mode == "allgather" else -(-8192 // 1536)
    assert whole[0]["calls"][route] == 4
    assert pieces[0]["calls"][route] == 4 * expected_messages


def test_piece_numel_auto_pipelines_cpu_gradients_only() -> None:
    assert resolve_piece_numel("auto", torch.device("cpu")) == PIECE_NUMEL
    assert resolve_piece_numel("auto", torch.device("cuda", 0)) is None
    assert resolve_piece_numel(4096, torch.device("cuda", 0)) == 4096
    for wrong in (0, -5, "many", 2.5):
        with pytest.raises(ValueError, match="piece_numel must be"):
            HyloHook(_model().named_parameters(), piece_numel=wrong)  # type: ignore[arg-type]


def _every_route_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 16, 3),  # 432 weights: kernel top-k
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(16 * 4 * 4, 64),  # 16,384 weights: rank 2 (2,560 bytes against 4,224)
        nn.ReLU(),
        nn.Linear(64, 20),  # 1,280 weights: 2-bit (332 bytes against 672 at rank 2)
        nn.ReLU(),
        nn.Linear(20, 5),  # small: dense
    )


def _overlapped_buckets(rank: int, world: int, overlap_buckets: bool) -> dict[str, Any]:
    ddp = _ddp(_every_route_model())
    hook = HyloHook(
        ddp.module.named_parameters(),
        _policy(rank=2),
        two_bit_exchange="two_phase",
        overlap=True,
        overlap_buckets=overlap_buckets,
    )
    hook.register(ddp)
    grads = [_step(ddp, rank, step) for step in range(4)]
    return {
        "grads": grads,
        "overlapped": hook.overlapped,
        "routes": sorted({plan.route for plan in hook.plans.values()}),
    }


def test_overlapped_buckets_give_the_serial_gradients_bit_for_bit() -> None:
    serial = run_distributed(_overlapped_buckets, 3, False)
    overlapped = run_distributed(_overlapped_buckets, 3, True)
    assert overlapped[0]["routes"] == ["dense", "kernel", "low_rank", "two_bit"]
    for rank in range(3):
        for expected, got in zip(serial[rank]["grads"], overlapped[rank]["grads"]):
            assert all(torch.equal(a, b) for a, b in zip(expected, got))
    # the overlap really ran (buckets finished after the next one started: at least once a
    # step after DDP's bucket rebuild), and never without it
    assert overlapped[0]["overlapped"] >= 3 and serial[0]["overlapped"] == 0


def _candidates_by_cost(rank: int, world: int) -> dict[str, Any]:
    ddp = _ddp(_every_route_model())
    cost = CostModel(bandwidth=1e3)  # bytes per second: every byte is dear
    policy = _policy(rank=2, low_rank_min_numel=400)  # every compressed layer: two candidates
    hook = HyloHook(ddp.module.named_parameters(), policy, cost_model=cost)
    hook.register(ddp)
    before = {name: plan.route for name, plan in hook.plans.items()}
    for step in range(4):
        _step(ddp, rank, step)
    return {
        "before": before,
        "after": {name: plan.route for name, plan in hook.plans.items()},
        "errors": {name: d.error for name, d in cost.decisions.items()},
    }


def test_the_cost_model_keeps_each_layers_cheapest_candidate() -> None:
    results = run_distributed(_candidates_by_cost, 2)
    assert results[0] == results[1]  # every rank decides the same
    before, after, errors = results[0]["before"], results[0]["after"], results[0]["errors"]
    # 3.weight (64 x 256): rank-2 factors 2,560 bytes against 4,224 of 2-bit codes; 5.weight
    # (20 x 64): 2-bit codes 332 bytes against 672 (first candidate: the fewer bytes)
    assert before["3.weight"] == after["3.weight"] == "low_rank"
    assert before["5.weight"] == after["5.weight"] == "two_bit"
    # both layers' candidates were tried on the calibration steps: a measured error each
    assert 0 < errors["3.weight"] < 1 and 0 < errors["5.weight"] < 1


def _thread_gauges(rank: int, world: int, overlap: bool) -> dict[str, Any]:
    ddp = _ddp(_every_route_model())
    hook = HyloHook(ddp.module.named_parameters(), _policy(low_rank_min_numel=400), overlap=overlap)
    hook.register(ddp)
    for step in range(4):
        _step(ddp, rank, step)
    thread = hook._thread
    return {
        "gauges": hook.gauges(per_layer=False),
        "total_ms": None if thread is None else thread.cpu_seconds * 1e3,
    }


def test_the_exchange_threads_processor_time_and_tail_are_gauged_as_means_per_step() -> None:
    threaded = run_distributed(_thread_gauges, 2, True)[0]
    gauges = threaded["gauges"]
    # means per step: no cost model, so all four steps count
    assert gauges["hylo/thread_cpu_ms"] > 0
    assert gauges["hylo/thread_cpu_ms"] * 4 == pytest.approx(threaded["total_ms"])
    assert gauges["hylo/tail_ms"] > 0
    inline = run_distributed(_thread_gauges, 2, False)[0]["gauges"]
    assert "hylo/thread_cpu_ms" not in inline and "hylo/tail_ms" not in inline
