"""Rounds of model averaging over 2 and 3 gloo processes: closed forms, equivalences, resume."""

from __future__ import annotations

import io
import math
import os
from collections.abc import Callable

import pytest
import torch
from helpers.distributed import run_distributed
from torch import Tensor, nn

from lightning_parallel.averaging import (
    Averager,
    AveragingSchedule,
    BlockMomentumAverager,
    ElasticAverager,
    OuterOptimizerAverager,
    PeriodicAverager,
    ReplicaAveraging,
    build_reduction,
    diloco_outer_optimizer,
)
from lightning_parallel.comm.ledger import CommLedger
from lightning_parallel.comm.liveness import Liveness, default_store


def _batch(rank: int, step: int) -> tuple[Tensor, Tensor]:
    generator = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(8, 4, generator=generator), torch.randn(8, 2, generator=generator)


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 2))


def _engine(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    averager: Averager,
    period: int | None,
    warmup: int = 0,
    **kwargs: object,
) -> ReplicaAveraging:
    return ReplicaAveraging(
        model,
        [optimizer],
        averager,
        AveragingSchedule(period, warmup),
        build_reduction(str(kwargs.pop("reduce", "flat")), ranks_per_host=1),
        ledger=CommLedger(),
        **kwargs,  # type: ignore[arg-type]
    )


def _train_steps(
    engine: ReplicaAveraging,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    rank: int,
    steps: range,
) -> None:
    for step in steps:
        engine.synchronize()
        inputs, targets = _batch(rank, step)
        optimizer.zero_grad()
        nn.functional.mse_loss(model(inputs), targets).backward()
        if engine.in_warmup:
            engine.average_gradients()
        optimizer.step()
        engine.count_optimizer_step()


def _flat(model: nn.Module) -> Tensor:
    return torch.cat([parameter.detach().reshape(-1) for parameter in model.parameters()])


# ---------------------------------------------------------------------------- closed forms


@pytest.mark.parametrize("world_size", [2, 3])
def test_rank_r_holding_r_averages_to_the_closed_form(world_size: int) -> None:
    def run(rank: int, world: int) -> dict[str, object]:
        expected = (world - 1) / 2
        results: dict[str, object] = {}
        for buffers, optimizer_state in [("average", "average"), ("local", "reset")]:
            model = nn.Sequential(nn.Linear(3, 2), nn.BatchNorm1d(2))
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
            model(torch.randn(4, 3)).sum().backward()
            optimizer.step()  # creates the momentum buffers
            with torch.no_grad():
                for tensor in [*model.parameters(), *model.buffers()]:
                    if tensor.is_floating_point():
                        tensor.fill_(rank)
                for state in optimizer.state.values():
                    state["momentum_buffer"].fill_(rank)
            engine = _engine(
                model,
                optimizer,
                PeriodicAverager(),
                period=1,
                buffers=buffers,
                optimizer_state=optimizer_state,
            )
            averaged = engine.averaged_state_dict()  # the mean, without touching the replica
            results[f"{buffers}-saved-mean"] = all(
                torch.equal(value, torch.full_like(value, expected))
                for key, value in averaged.items()
                if value.is_floating_point() and (buffers == "average" or "running" not in key)
            )
            results[f"{buffers}-live-untouched"] = all(
                torch.equal(p, torch.full_like(p, rank)) for p in model.parameters()
            )
            engine.count_optimizer_step()
            engine.synchronize()
            results[f"{buffers}-parameters"] = all(
                torch.equal(p, torch.full_like(p, expected)) for p in model.parameters()
            )
            running = [b for b in model.buffers() if b.is_floating_point()]
            buffer_value = expected if buffers == "average" else rank
            results[f"{buffers}-buffers"] = all(
                torch.equal(b, torch.full_like(b, buffer_value)) for b in running
            )
            if optimizer_state == "average":
                results["momentum"] = all(
                    torch.equal(
                        s["momentum_buffer"], torch.full_like(s["momentum_buffer"], expected)
                    )
                    for s in optimizer.state.values()
                )
            else:
                results["reset"] = len(optimizer.state) == 0
            count = sum(p.numel() for p in model.parameters())
            results[f"{buffers}-divergence"] = math.isclose(
                engine.ledger.gauges["divergence"], abs(rank - expected) * math.sqrt(count)
            )
            results[f"{buffers}-rounds"] = engine.ledger.gauges["rounds"] == 1 == engine.rounds
        return results

    for results in run_distributed(run, world_size):
        assert all(results.values()), results


# ---------------------------------------------------------------------------- equivalences


@pytest.mark.parametrize("world_size", [2, 3])
def test_period_one_equals_ddp_and_warmup_is_ddp(world_size: int) -> None:
    def run(rank: int, world: int) -> list[float]:
        errors = []
        for momentum, period, warmup in [(0.0, 1, 0), (0.9, 1000, 5)]:
            reference = nn.parallel.DistributedDataParallel(_model())
            reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=momentum)
            for step in range(5):
                inputs, targets = _batch(rank, step)
                reference_optimizer.zero_grad()
                nn.functional.mse_loss(reference(inputs), targets).backward()
                reference_optimizer.step()
            model = _model()
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=momentum)
            engine = _engine(model, optimizer, PeriodicAverager(), period, warmup)
            engine.broadcast_replicas()
            _train_steps(engine, model, optimizer, rank, range(5))
            engine.synchronize()
            errors.append(float((_flat(model) - _flat(reference.module)).abs().max()))
        return errors

    for errors in run_distributed(run, world_size):
        assert max(errors) < 1e-6, errors


@pytest.mark.parametrize("world_size", [2, 3])
def test_bmuf_outer_sgd_and_easgd_reduce_to_periodic(world_size: int) -> None:
    def run(rank: int, world: int) -> dict[str, float]:
        candidates: dict[str, Callable[[], Averager]] = {
            "periodic": PeriodicAverager,
            "bmuf": lambda: BlockMomentumAverager(block_momentum=0.0, block_learning_rate=1.0),
            "outer_sgd": lambda: OuterOptimizerAverager(lambda p: torch.optim.SGD(p, lr=1.0)),
            "easgd": lambda: ElasticAverager(alpha=1.0, beta=1.0, center_first=True),
        }
        finals = {}
        for name, make in candidates.items():
            model = _model()
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
            engine = _engine(model, optimizer, make(), period=3)
            _train_steps(engine, model, optimizer, rank, range(9))
            engine.synchronize()
            finals[name] = _flat(model)
        return {
            name: float((final - finals["periodic"]).abs().max()) for name, final in finals.items()
        }

    for differences in run_distributed(run, world_size):
        assert max(differences.values()) < 1e-6, differences


def test_easgd_center_is_the_periodic_mean_with_alpha_one_over_m() -> None:
    def run(rank: int, world: int) -> bool:
        model = _model()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        easgd = ElasticAverager(alpha=1.0 / world, beta=1.0)
        engine = _engine(model, optimizer, easgd, period=2)
        _train_steps(engine, model, optimizer, rank, range(2))
        mean = engine.averaged_state_dict()  # what periodic averaging would restart from
        engine.synchronize()
        names = [name for name, _ in model.named_parameters()]
        return all(
            torch.allclose(center, mean[name], atol=1e-7)
            for center, name in zip(easgd.center, names, strict=True)
        )

    assert all(run_distributed(run, 2))


def test_evaluation_runs_a_round_first_or_swaps_the_mean() -> None:
    def run(rank: int, world: int) -> dict[str, bool]:
        results = {}
        for name, averager in [("periodic", PeriodicAverager()), ("easgd", ElasticAverager())]:
            model = nn.Linear(4, 2)
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
            engine = _engine(model, optimizer, averager, period=4)
            engine.broadcast_replicas()
            _train_steps(engine, model, optimizer, rank, range(3))
            local = _flat(model)
            mean = _flat(model).clone()
            torch.distributed.all_reduce(mean)
            mean /= world
            engine.prepare_evaluation(average_first=False)  # the mean, swapped in
            results[f"{name}-swap-mean"] = torch.allclose(_flat(model), mean, atol=1e-7)
            engine.restore_replica()
            results[f"{name}-restored"] = torch.equal(_flat(model), local)
            results[f"{name}-no-round"] = engine.rounds == 0
            engine.prepare_evaluation(average_first=True)  # a round first
            results[f"{name}-round"] = engine.rounds == 1
            results[f"{name}-consensus"] = engine.in_consensus == (name == "periodic")
            if name == "periodic":  # the replicas agree: evaluated as they are
                results["periodic-evaluated-mean"] = torch.allclose(_flat(model), mean, atol=1e-7)
            engine.restore_replica()
            _train_steps(engine, model, optimizer, rank, range(3, 7))
            results[f"{name}-next-round-4-steps-later"] = engine.rounds == 1
            _train_steps(engine, model, optimizer, rank, range(7, 8))
            engine.synchronize()
            results[f"{name}-then-round"] = engine.rounds == 2
        return results

    for results in run_distributed(run, 2):
        failed = [name for name, ok in results.items() if not ok]
        assert not failed, failed


# ---------------------------------------------------------------------------- overlap


def test_overlap_applies_one_step_later_and_keeps_that_steps_progress() -> None:
    def run(rank: int, world: int) -> list[bool]:
        model = nn.Linear(2, 2)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
        engine = _engine(model, optimizer, PeriodicAverager(), period=2, overlap=True)
        with torch.no_grad():
            for parameter in model.parameters():
                parameter.fill_(rank)
        checks = []
        engine.count_optimizer_step()
        engine.count_optimizer_step()  # step 2 ends a round
        engine.synchronize()  # the round starts, asynchronously
        checks.append(all(torch.equal(p, torch.full_like(p, rank)) for p in model.parameters()))
        with torch.no_grad():  # the next local step moves each replica by 10·(rank + 1)
            for parameter in model.parameters():
                parameter.add_(10.0 * (rank + 1))
        engine.synchronize()  # no step counted since: the round is not applied yet
        checks.append(
            all(torch.equal(p, torch.full_like(p, 11 * rank + 10)) for p in model.parameters())
        )
        engine.count_optimizer_step()
        engine.synchronize()  # applied: mean + this step's progress
        expected = (world - 1) / 2 + 10.0 * (rank + 1)
        checks.append(all(torch.equal(p, torch.full_like(p, expected)) for p in model.parameters()))
        return checks

    for checks in run_distributed(run, 2):
        assert all(checks), checks


# ---------------------------------------------------------------------------- resume


def test_resume_mid_round_continues_exactly() -> None:
    configurations: dict[str, tuple[Callable[[], Averager], dict[str, object]]] = {
        "periodic-momentum": (PeriodicAverager, {}),
        "periodic-overlap": (PeriodicAverager, {"overlap": True, "optimizer_state": "average"}),
        "bmuf-nesterov": (lambda: BlockMomentumAverager(block_momentum=0.5, nesterov=True), {}),
        "easgd": (lambda: ElasticAverager(beta=0.9), {"buffers": "local"}),
        "diloco": (lambda: OuterOptimizerAverager(diloco_outer_optimizer()), {}),
        "diloco-capped": (
            lambda: OuterOptimizerAverager(diloco_outer_optimizer(), step_cap=1.0),
            {},
        ),
    }

    def run(rank: int, world: int) -> dict[str, bool]:
        results = {}
        for name, (make, options) in configurations.items():
            model = _model()
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
            engine = _engine(model, optimizer, make(), period=3, warmup=1, **options)
            engine.broadcast_replicas()
            _train_steps(engine, model, optimizer, rank, range(10))
            engine.finish()
            uninterrupted = _flat(model)
            rounds = engine.rounds
            for stop in (4, 5):  # step 4 ends a round (in flight when overlapped); 5 is mid-round
                model = _model()
                optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
                engine = _engine(model, optimizer, make(), period=3, warmup=1, **options)
                engine.broadcast_replicas()
                _train_steps(engine, model, optimizer, rank, range(stop))
                engine.synchronize()  # what a checkpoint does first
                buffer = io.BytesIO()
                torch.save(
                    {"shared": engine.state_dict(), "local": engine.local_state_dict()}, buffer
                )
                buffer.seek(0)
                saved = torch.load(buffer, weights_only=False)
                model = _model(seed=123)  # different weights: everything must come from the save
                optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
                engine = _engine(model, optimizer, make(), period=3, warmup=1, **options)
                engine.load_state_dict(saved["shared"])
                engine.load_local_state_dict(saved["local"])
                _train_steps(engine, model, optimizer, rank, range(stop, 10))
                engine.finish()
                results[f"{name}-stop{stop}"] = torch.equal(_flat(model), uninterrupted)
                results[f"{name}-stop{stop}-rounds"] = engine.rounds == rounds == 3
        return results

    for results in run_distributed(run, 2):
        failed = [name for name, ok in results.items() if not ok]
        assert not failed, failed


# ---------------------------------------------------------------------------- failures


@pytest.mark.parametrize("overlap", [False, True])
def test_a_dead_peer_makes_the_round_raise_not_hang(overlap: bool) -> None:
    """Rank 1 dies before the round: rank 0's round raises (gloo's closed connection), and the
    diagnosis the strategies attach to it (the heartbeats) names rank 1."""

    def run(rank: int, world: int) -> None:
        store = default_store()
        assert store is not None
        liveness = Liveness(store, rank, world, interval=0.25)
        model = nn.Linear(4, 2)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        engine = _engine(model, optimizer, PeriodicAverager(), period=1, overlap=overlap)
        engine.broadcast_replicas()
        if rank == 1:
            os._exit(1)  # the peer dies before the round
        engine.count_optimizer_step()
        try:
            engine.synchronize()
            engine.finish()
        except RuntimeError as error:
            raise RuntimeError(f"the round failed: {liveness.diagnose().text}") from error

    with pytest.raises(RuntimeError, match=r"rank 0 failed:(.|\n)*the round failed: rank 1 \("):
        run_distributed(run, 2, timeout=60)


def _resume_on_meta(rank: int, world: int) -> set[str]:
    """Load a CPU checkpoint into an engine whose model lives on ``meta``; the devices of the
    averager's state and of the pending round afterwards."""
    source = _model()
    optimizer = torch.optim.SGD(source.parameters(), lr=0.1, momentum=0.9)
    averager = BlockMomentumAverager(block_momentum=0.5)
    averager.reset([p.detach() for p in source.parameters()], 2)
    parameters = [p.detach().clone() for p in source.parameters()]
    local = {
        "model": source.state_dict(),
        "optimizers": [optimizer.state_dict()],
        "pending_round": {
            "snapshot": parameters,
            "sums": [torch.cat([p.reshape(-1) for p in parameters])],
            "num_parameters": len(parameters),
            "started_at": 3,
        },
    }
    shared = {"schedule": AveragingSchedule(3, 1).state_dict(), "averager": averager.state_dict()}
    model = _model().to("meta")
    meta_optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    engine = _engine(model, meta_optimizer, BlockMomentumAverager(block_momentum=0.5), 3, 1)
    engine.load_state_dict(shared)
    engine.load_local_state_dict(local)
    state = engine.averager.state_dict()
    pending = engine.local_state_dict()["pending_rounds"][0]
    tensors = [*state["global_model"], *state["block_momentum"], *pending["snapshot"]]
    return {t.device.type for t in [*tensors, *pending["sums"]]}


def test_a_resume_puts_the_averager_and_the_pending_round_on_the_models_device() -> None:
    """The checkpoint and the replica file are loaded onto the CPU; the model here lives on
    ``meta`` (standing for a GPU): the averager's state and the round in flight move to it."""
    assert run_distributed(_resume_on_meta, 1) == [{"meta"}]


@pytest.mark.parametrize("center_first", [True, False])
def test_easgd_evaluates_its_replicas_mean_from_the_rounds_mean_without_an_exchange(
    center_first: bool,
) -> None:
    """EASGD's replicas do not agree after a round, but their mean follows from the round's
    mean: a validation right after a round (its own, or one the schedule ended) evaluates the
    replicas' mean with the round's exchange alone; after a local step it exchanges once."""

    def run(rank: int, world: int) -> dict[str, bool]:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3), nn.Linear(3, 2))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        engine = _engine(model, optimizer, ElasticAverager(center_first=center_first), period=4)
        calls = [0]
        all_reduce = engine.reduction.all_reduce

        def counting(*args: object, **kwargs: object) -> object:
            calls[0] += 1
            return all_reduce(*args, **kwargs)  # type: ignore[arg-type]

        engine.reduction.all_reduce = counting  # type: ignore[method-assign]
        engine.broadcast_replicas()

        def model_tensors() -> Tensor:
            return torch.cat(
                [
                    t.detach().reshape(-1).double()
                    for t in model.state_dict().values()
                    if t.is_floating_point()
                ]
            )

        def evaluate(name: str, **policy: object) -> None:
            before = calls[0]
            engine.prepare_evaluation(**policy)  # type: ignore[arg-type]
            results[f"{name}-exchanges"] = calls[0] - before == 1
            evaluated = model_tensors()
            engine.restore_replica()
            mean = model_tensors()
            torch.distributed.all_reduce(mean)
            results[f"{name}-is-the-mean"] = torch.allclose(evaluated, mean / world, atol=1e-6)
            results[f"{name}-replicas-differ"] = not engine.in_consensus

        results: dict[str, bool] = {}
        _train_steps(engine, model, optimizer, rank, range(3))
        evaluate("own-round")  # the round it runs, nothing more
        results["own-round-ran"] = engine.rounds == 1
        _train_steps(engine, model, optimizer, rank, range(3, 7))  # the 4th step ends a round
        evaluate("scheduled-round")  # lands as the validation starts; no round of its own
        results["scheduled-round-ran"] = engine.rounds == 2
        _train_steps(engine, model, optimizer, rank, range(7, 8))
        evaluate("mean-after-a-step", average_first=False)  # one exchange: the mean
        results["no-round"] = engine.rounds == 2
        return results

    for results in run_distributed(run, 3):
        failed = [name for name, ok in results.items() if not ok]
        assert not failed, failed
