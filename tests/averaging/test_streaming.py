"""Streaming rounds (fragments, delayed rounds) and quantized outer deltas, against references."""

from __future__ import annotations

import io
import math
from collections.abc import Sequence

import pytest
import torch
import torch.distributed as dist
from helpers.distributed import run_distributed
from torch import Tensor, nn

from lightning_parallel.averaging import (
    AveragingSchedule,
    ElasticAverager,
    OuterOptimizerAverager,
    PeriodicAverager,
    ReplicaAveraging,
    build_reduction,
    diloco_outer_optimizer,
)
from lightning_parallel.averaging.fragments import due_fragments, plan_fragments
from lightning_parallel.averaging.plateau import LossSpike
from lightning_parallel.averaging.policies import trainable_parameters
from lightning_parallel.averaging.quantize import BlockQuantizer
from lightning_parallel.averaging.quantized_gather import QuantizedAllGather
from lightning_parallel.comm.accounting import track_collectives
from lightning_parallel.comm.ledger import CommLedger


def _deep(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3), nn.Linear(3, 2)
    )


def _batch(rank: int, step: int) -> tuple[Tensor, Tensor]:
    generator = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(8, 4, generator=generator), torch.randn(8, 2, generator=generator)


def _sgd_step(model: nn.Module, optimizer: torch.optim.Optimizer, rank: int, step: int) -> None:
    inputs, targets = _batch(rank, step)
    optimizer.zero_grad()
    nn.functional.mse_loss(model(inputs), targets).backward()
    optimizer.step()


def _flat(model: nn.Module) -> Tensor:
    return torch.cat([parameter.detach().reshape(-1) for parameter in model.parameters()])


def _engine(
    model: nn.Module, optimizer: torch.optim.Optimizer, **options: object
) -> ReplicaAveraging:
    period = int(options.pop("period", 4))  # type: ignore[call-overload]
    averager = options.pop("averager", None) or PeriodicAverager()
    dtype = options.pop("outer_dtype", None)
    reduce = str(options.pop("reduce", "flat"))
    return ReplicaAveraging(
        model,
        [optimizer],
        averager,  # type: ignore[arg-type]
        AveragingSchedule(period, int(options.pop("warmup", 0))),  # type: ignore[call-overload]
        build_reduction(reduce, ranks_per_host=2),
        ledger=CommLedger(),
        quantized=None if dtype is None else QuantizedAllGather(BlockQuantizer(str(dtype))),
        **options,  # type: ignore[arg-type]
    )


def _train(engine: ReplicaAveraging, model: nn.Module, optimizer, rank: int, steps: range) -> None:  # type: ignore[no-untyped-def]
    for step in steps:
        engine.synchronize()
        _sgd_step(model, optimizer, rank, step)
        engine.count_optimizer_step()


# ---------------------------------------------------------------------------- the plan


def test_fragments_are_whole_layers_balanced_by_bytes_with_staggered_phases() -> None:
    model = nn.Sequential(
        nn.Linear(10, 10),
        nn.BatchNorm1d(10),
        nn.Linear(10, 100),
        nn.Linear(100, 10),
        nn.Linear(10, 2),
    )
    parameters = trainable_parameters(model)
    buffers = [b for b in model.buffers() if b.is_floating_point()]
    plan = plan_fragments(model, parameters, buffers, 3, 12)
    assert [f.phase for f in plan] == [4, 8, 12]
    owned = sorted(i for fragment in plan for i in fragment.parameters)
    assert owned == list(range(len(parameters)))  # every parameter in exactly one fragment
    for fragment in plan:  # a Linear's weight and bias together
        assert len(fragment.parameters) % 2 == 0
    sizes = [sum(parameters[i].numel() for i in f.parameters) for f in plan]
    # layers of 110, 20 (BatchNorm), 1100, 1010, 22: the best 3-way contiguous cut
    assert sizes == [130, 1100, 1032]
    assert plan[0].buffers == (0, 1)  # BatchNorm's statistics go with BatchNorm's parameters
    # a dominant layer is a fragment of its own; four fragments of four layers or fewer
    assert [len(f.parameters) for f in plan_fragments(model, parameters, [], 5, 8)] == [
        2,
        2,
        2,
        2,
        2,
    ]
    with pytest.raises(ValueError, match="layers with trainable"):
        plan_fragments(model, parameters, [], 6, 8)
    with pytest.raises(ValueError, match="period"):
        plan_fragments(model, parameters, [], 4, 3)


def test_each_fragment_is_due_once_per_period_at_its_phase() -> None:
    model = _deep()
    plan = plan_fragments(model, trainable_parameters(model), [], 4, 16)
    due = {step: due_fragments(plan, step, 16) for step in range(1, 33)}
    assert {step: f for step, f in due.items() if f} == {
        4: [0],
        8: [1],
        12: [2],
        16: [3],
        20: [0],
        24: [1],
        28: [2],
        32: [3],
    }


# ---------------------------------------------------------------------------- quantizers


@pytest.mark.parametrize(
    ("dtype", "per_value"), [("bf16", 2.0), ("int8", 1.0 + 4 / 256), ("int4", 0.5 + 4 / 256)]
)
def test_quantizer_bytes_and_error_bound(dtype: str, per_value: float) -> None:
    quantizer = BlockQuantizer(dtype)
    values = torch.randn(10_000) * torch.logspace(-3, 1, 10_000)
    payload = quantizer.encode(values)
    assert payload.dtype == torch.uint8
    assert payload.numel() == quantizer.payload_nbytes(values.numel())
    assert payload.numel() <= math.ceil(per_value * 10_240)  # 10,000 values padded to 40 blocks
    decoded = quantizer.decode(payload, values.numel())
    assert decoded.shape == values.shape
    if dtype == "bf16":
        assert torch.allclose(decoded, values, rtol=2**-8, atol=0)
        return
    levels = {"int8": 127, "int4": 7}[dtype]
    padded = torch.cat([values, torch.zeros(240)]).view(-1, 256)
    bound = (padded.abs().amax(dim=1) / levels / 2).repeat_interleave(256)[:10_000]
    assert bool(((decoded - values).abs() <= bound * (1 + 1e-5)).all())
    assert quantizer.decode(quantizer.encode(torch.zeros(5)), 5).eq(0).all()


def test_quantized_gather_sums_identically_everywhere_with_error_feedback() -> None:
    def run(rank: int, world: int) -> dict[str, object]:
        gather = QuantizedAllGather(BlockQuantizer("int4"))
        generator = torch.Generator().manual_seed(rank)
        values = [torch.randn(1000, generator=generator) for _ in range(3)]
        residual = torch.zeros(1000)
        exact = torch.zeros(1000)
        received = torch.zeros(1000)
        invariant = True
        for value in values:
            before = residual.clone()
            buffer = value.clone()
            with track_collectives(CommLedger()) as ledger:
                gather.all_reduce([buffer], residuals=[residual])
            own = BlockQuantizer("int4").decode(BlockQuantizer("int4").encode(value + before), 1000)
            invariant &= bool(torch.allclose(own + residual, value + before, atol=1e-6))
            gathered = [torch.zeros(1000) for _ in range(world)]
            dist.all_gather(gathered, value)
            exact += sum(gathered)
            received += buffer
        return {
            "received": received,
            "exact": exact,
            "invariant": invariant,
            "bytes": ledger.total_bytes(),
            "expected_bytes": gather.bytes_sent([torch.zeros(1000)]),
        }

    results = run_distributed(run, 3)
    assert all(torch.equal(r["received"], results[0]["received"]) for r in results)
    for result in results:
        assert result["invariant"]
        assert result["bytes"] == result["expected_bytes"] == 2 * (512 + 4 * 4)
    # with error feedback the sum of what arrived lags the exact sum only by the last residuals
    error = (results[0]["received"] - results[0]["exact"]).abs().max()
    assert error < 0.5 * 3 * max(float(r["exact"].abs().max()) for r in results) / 7


# ---------------------------------------------------------------------------- rounds


def _reference(world: int, steps: int, fragments: int, period: int, delay: int) -> list[Tensor]:
    """Streaming periodic averaging of ``world`` replicas in one process, written out."""
    models = [_deep() for _ in range(world)]
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in models]
    plan = plan_fragments(models[0], trainable_parameters(models[0]), [], fragments, period)
    flight: list[tuple[int, int, int, list[list[Tensor]]]] = []  # fragment, start, apply, snaps
    due: list[int] = []
    count = 0

    def tensors(model: nn.Module, fragment: int) -> list[Tensor]:
        parameters = list(model.parameters())
        return [parameters[i] for i in plan[fragment].parameters]

    def apply(fragment: int, started: int, snapshots: Sequence[Sequence[Tensor]]) -> None:
        means = [sum(parts) / world for parts in zip(*snapshots)]
        with torch.no_grad():
            for model, snapshot in zip(models, snapshots):
                for live, start, mean in zip(tensors(model, fragment), snapshot, means):
                    live.copy_(mean + (live - start) if count > started else mean)

    for step in range(steps + 1):
        for entry in [e for e in flight if e[2] <= count]:
            flight.remove(entry)
            apply(entry[0], entry[1], entry[3])
        for fragment in due:
            snapshots = [[t.detach().clone() for t in tensors(m, fragment)] for m in models]
            if delay:
                flight.append((fragment, count, count + delay, snapshots))
            else:
                apply(fragment, count, snapshots)
        if step == steps:
            break
        for rank, (model, optimizer) in enumerate(zip(models, optimizers)):
            _sgd_step(model, optimizer, rank, step)
        count += 1
        due = due_fragments(plan, count, period)
    return [_flat(model) for model in models]


@pytest.mark.parametrize(("fragments", "delay"), [(3, 0), (3, 2), (4, 3)])
def test_streaming_rounds_equal_the_written_out_schedule(fragments: int, delay: int) -> None:
    def run(rank: int, world: int) -> float:
        model = _deep()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        engine = _engine(model, optimizer, period=4, fragments=fragments, sync_delay=delay)
        _train(engine, model, optimizer, rank, range(13))
        engine.synchronize()
        expected = _reference(world, 13, fragments, 4, delay)[rank]
        return float((_flat(model) - expected).abs().max())

    assert max(run_distributed(run, 2)) < 1e-6


def test_streaming_rounds_through_the_tree_reduce_equal_the_flat_ones() -> None:
    """4 ranks on 2 simulated hosts: BatchNorm statistics (full precision) take the tree, the
    int8 parameter deltas their gather; the tree computes the same sums."""

    def run(rank: int, world: int) -> Tensor:
        finals = []
        for reduce in ("flat", "tree"):
            torch.manual_seed(0)
            model = nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.Linear(6, 2))
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
            engine = _engine(
                model, optimizer, fragments=2, sync_delay=1, outer_dtype="int8", reduce=reduce
            )
            _train(engine, model, optimizer, rank, range(9))
            engine.finish()
            buffers = [b.reshape(-1) for b in model.buffers() if b.is_floating_point()]
            finals.append(torch.cat([_flat(model), *buffers]))
        return (finals[0] - finals[1]).abs().max()

    assert max(float(d) for d in run_distributed(run, 4)) < 1e-6


def test_quantized_rounds_stay_close_to_exact_ones_and_end_identical() -> None:
    def run(rank: int, world: int) -> dict[str, object]:
        finals = {}
        for dtype in (None, "int8", "int4"):
            model = _deep()
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
            engine = _engine(
                model,
                optimizer,
                averager=OuterOptimizerAverager(diloco_outer_optimizer()),
                fragments=3,
                sync_delay=1,
                outer_dtype=dtype,
            )
            _train(engine, model, optimizer, rank, range(12))
            engine.finish()
            finals[str(dtype)] = _flat(model)
            if dtype is not None:  # a quantized round sends less than an exact one
                peak = engine.peak_round_bytes
                finals[f"{dtype}-peak"] = peak
        return finals

    results = run_distributed(run, 2)
    for dtype, tolerance in (("int8", 2e-3), ("int4", 3e-2)):
        assert torch.equal(results[0][dtype], results[1][dtype])  # finish: one model everywhere
        assert (results[0][dtype] - results[0]["None"]).abs().max() < tolerance
    assert results[0]["int4-peak"] < results[0]["int8-peak"]


def test_resume_with_rounds_in_flight_and_residuals_continues_exactly() -> None:
    def run(rank: int, world: int) -> dict[str, bool]:
        options = {
            "fragments": 3,
            "sync_delay": 2,
            "outer_dtype": "int8",
            "error_feedback": True,
            "averager": None,
        }

        def build(seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer, ReplicaAveraging]:
            model = _deep(seed)
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
            averager = OuterOptimizerAverager(diloco_outer_optimizer())
            return model, optimizer, _engine(model, optimizer, **{**options, "averager": averager})

        model, optimizer, engine = build()
        _train(engine, model, optimizer, rank, range(14))
        engine.finish()
        uninterrupted = _flat(model)
        results = {}
        for stop in (5, 9):  # a round in flight at both stops
            model, optimizer, engine = build()
            _train(engine, model, optimizer, rank, range(stop))
            engine.synchronize()
            results[f"in-flight-{stop}"] = len(engine.local_state_dict()["pending_rounds"]) >= 1
            buffer = io.BytesIO()
            torch.save({"shared": engine.state_dict(), "local": engine.local_state_dict()}, buffer)
            buffer.seek(0)
            saved = torch.load(buffer, weights_only=False)
            model, optimizer, engine = build(seed=123)
            engine.load_state_dict(saved["shared"])
            engine.load_local_state_dict(saved["local"])
            _train(engine, model, optimizer, rank, range(stop, 14))
            engine.finish()
            results[f"stop-{stop}"] = torch.equal(_flat(model), uninterrupted)
        return results

    for results in run_distributed(run, 2):
        assert all(results.values()), results


def test_global_evaluation_sends_nothing_and_shows_the_agreed_point() -> None:
    def run(rank: int, world: int) -> dict[str, object]:
        model = _deep()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        engine = _engine(model, optimizer, fragments=2, sync_delay=1, keep_agreement=True)
        _train(engine, model, optimizer, rank, range(9))
        engine.synchronize()
        replica = _flat(model)
        agreed: list[Tensor | None] = [None] * len(list(model.parameters()))
        for fragment, agreement in zip(engine.fragments, engine.agreements):
            assert agreement is not None
            for index, value in zip(fragment.parameters, agreement.anchor):
                agreed[index] = value.reshape(-1)
        with track_collectives(CommLedger()) as ledger:
            engine.prepare_evaluation(policy="global")
            evaluated = _flat(model)
        # a checkpoint saved meanwhile still holds the replicas' mean, not the agreed point
        saved = engine.averaged_state_dict()
        engine.restore_replica()
        gathered = [torch.zeros_like(replica) for _ in range(world)]
        dist.all_gather(gathered, replica)
        mean = sum(gathered) / world
        saved_flat = torch.cat([saved[name].reshape(-1) for name, _ in model.named_parameters()])
        return {
            "bytes": ledger.total_bytes(),
            "evaluated": evaluated,
            "agreed": torch.equal(evaluated, torch.cat(agreed)),  # type: ignore[arg-type]
            "moved": not torch.equal(evaluated, replica),
            "saved-mean": torch.allclose(saved_flat, mean, atol=1e-6),
            "restored": torch.equal(_flat(model), replica),
        }

    results = run_distributed(run, 2)
    assert results[0]["bytes"] == results[1]["bytes"] == 0
    assert torch.equal(results[0]["evaluated"], results[1]["evaluated"])
    assert all(r["restored"] and r["agreed"] and r["moved"] and r["saved-mean"] for r in results)


def test_a_late_round_keeps_the_steps_taken_meanwhile_or_mixes_them() -> None:
    from lightning_parallel.averaging.rounds import land

    start, target = torch.tensor([1.0]), torch.tensor([3.0])
    for alpha, expected in ((None, 3.0 + (5.0 - 1.0)), (0.0, 3.0), (0.5, 4.0), (1.0, 5.0)):
        live = torch.tensor([5.0])  # moved from 1 to 5 while the round was in flight
        land([live], [start], [target], moved=True, alpha=alpha)
        assert live.item() == expected, alpha
    live = torch.tensor([5.0])
    land([live], [start], [target], moved=False, alpha=0.5)  # nothing moved: the target
    assert live.item() == 3.0


def test_quantizing_inf_or_nan_raises() -> None:
    with pytest.raises(FloatingPointError, match="inf or NaN"):
        BlockQuantizer("int8").encode(torch.tensor([1.0, float("nan")]))


def test_bad_streaming_settings_are_refused_with_the_fix() -> None:
    from lightning_parallel.averaging.rounds import check_alpha, check_sync_delay

    with pytest.raises(ValueError, match="must not exceed the period"):
        check_sync_delay(5, False, 4)
    assert check_sync_delay(None, True, 1) == 1  # overlap with period 1, as before
    with pytest.raises(ValueError, match="overlap=True"):
        check_sync_delay(0, True, 4)
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        check_alpha(1.5)
    with pytest.raises(ValueError, match="multiple of 8"):
        BlockQuantizer("int8", block_size=12)
    with pytest.raises(ValueError, match="'bf16', 'int8' or 'int4'"):
        BlockQuantizer("fp8")


@pytest.mark.parametrize("resume", [False, True])
def test_a_spike_right_after_a_round_of_every_fragment_goes_back_to_the_rounds_before(
    resume: bool,
) -> None:
    # an evaluation's round of every fragment whose point spikes at the first step after it
    # (streaming DiLoCo on vgg_mini, seed 1: losses of 4.9 and 5.8): every fragment goes back
    # to its agreed point from before every round since the last loss, which showed it healthy;
    # with ``resume`` a checkpoint taken after the evaluation (as ModelCheckpoint's) keeps it
    def build(seed: int) -> tuple[nn.Module, torch.optim.Optimizer, ReplicaAveraging]:
        model = _deep(seed)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        engine = _engine(
            model, optimizer, fragments=2, sync_delay=0, keep_agreement=True, spike=LossSpike()
        )
        return model, optimizer, engine

    def run(rank: int, world: int) -> dict[str, object]:
        model, optimizer, engine = build(0)
        engine.broadcast_replicas()
        before: list[Tensor] = []
        after: list[Tensor] = []
        for step in range(8):
            if step == 6:  # the points step 5's loss showed healthy (a round may be due now)
                before = [t.clone() for a in engine.agreements if a for t in a.anchor]
            engine.synchronize()
            if step == 6:
                engine.prepare_evaluation(policy="round")
                after = [t.clone() for a in engine.agreements if a for t in a.anchor]
                engine.restore_replica()
                if resume:
                    saved = io.BytesIO()
                    torch.save(
                        {
                            "shared": engine.state_dict(),
                            "local": engine.local_state_dict(),
                            "model": model.state_dict(),
                            "optimizer": optimizer.state_dict(),
                        },
                        saved,
                    )
                    saved.seek(0)
                    state = torch.load(saved, weights_only=False)
                    model, optimizer, engine = build(1)
                    model.load_state_dict(state["model"])
                    optimizer.load_state_dict(state["optimizer"])
                    engine.load_state_dict(state["shared"])
                    engine.load_local_state_dict(state["local"])
            _sgd_step(model, optimizer, rank, step)
            engine.observe_loss(10.0 if step == 6 else 2.0)
            engine.count_optimizer_step()
            if step == 6:
                break
        engine.synchronize()
        order = [i for fragment in engine.fragments for i in fragment.parameters]
        live = [trainable_parameters(model)[i].detach() for i in order]
        return {
            "rollbacks": engine.rollbacks,
            "to_before": all(torch.equal(a, b) for a, b in zip(live, before, strict=True)),
            "moved": not all(torch.equal(a, b) for a, b in zip(before, after, strict=True)),
        }

    for result in run_distributed(run, 2):
        assert result == {"rollbacks": 1, "to_before": True, "moved": True}


def test_easgd_keeps_no_agreement_to_go_back_to() -> None:
    # EASGD's replicas never agree and it has no roll-back: its rounds keep no earlier point
    def run(rank: int, world: int) -> dict[str, object]:
        model = _deep()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        engine = _engine(
            model,
            optimizer,
            averager=ElasticAverager(),
            fragments=2,
            sync_delay=0,
            keep_agreement=True,
            spike=LossSpike(),
        )
        engine.broadcast_replicas()
        for step in range(9):
            engine.synchronize()
            _sgd_step(model, optimizer, rank, step)
            engine.observe_loss(2.0)
            engine.count_optimizer_step()
        return {"rounds": engine.rounds, "kept": len(engine._previous_agreements)}

    for result in run_distributed(run, 2):
        assert result["rounds"] >= 2
        assert result["kept"] == 0
