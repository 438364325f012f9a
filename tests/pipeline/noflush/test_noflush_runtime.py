"""The no-flush runtime: its order is the 1F1B table across steps, staleness is N-k-1, every
micro-batch is applied exactly once, and the weights equal a single-process replay."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from helpers.distributed import run_distributed
from torch import nn
from torch.func import functional_call

from lightning_parallel.pipeline.noflush import NoFlushPipeline, make_weight_predictor, runtime
from lightning_parallel.pipeline.schedule import OneFOneBSchedule, render
from lightning_parallel.pipeline.stages import split_stages
from lightning_parallel.pipeline.transport import StageTransport

BOUNDARIES = {1: [], 2: [2], 3: [2, 4]}


def _layers() -> list[nn.Module]:
    torch.manual_seed(0)
    return [nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 3)]


def _data(units: int, size: int = 3, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    return [
        (
            torch.randn(size, 4, generator=generator),
            torch.randint(0, 3, (size,), generator=generator),
        )
        for _ in range(units)
    ]


def _optimizer(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def _run_stage(
    rank: int,
    stages: int,
    mode: str,
    plan: list[int | str],
    units_data: list[tuple[torch.Tensor, torch.Tensor]],
    record: bool = False,
    track_norms: bool = False,
) -> dict[str, Any]:
    """Run this rank's stage through ``plan`` (micro-batches per step, or "drain")."""
    torch.manual_seed(0)
    modules = split_stages(_layers(), BOUNDARIES[stages])
    module = modules[rank]
    optimizer = _optimizer(module.parameters())
    predictor = make_weight_predictor(
        mode, list(module.parameters()), optimizer, stage=rank, stages=stages
    )
    transport = StageTransport(rank, list(range(stages))) if stages > 1 else None
    pipeline = NoFlushPipeline(
        module,
        stage=rank,
        stages=stages,
        optimizer=optimizer,
        predictor=predictor,
        transport=transport,
        record_timeline=record,
        track_norms=track_norms,
    )
    cursor = 0
    losses: list[float] = []
    seen_targets: list[int] = []
    for entry in plan:
        if entry == "drain":
            pipeline.drain()
            assert pipeline.pending == 0
            continue
        count = int(entry)
        batch = units_data[cursor : cursor + count]
        cursor += count

        def loss_fn(forward: Any, index: int, batch: Any = batch) -> torch.Tensor:
            x, y = batch[index]
            seen_targets.extend(y.tolist())
            return F.cross_entropy(forward(x), y)

        out = pipeline.step(
            count,
            inputs=[(x,) for x, _ in batch] if rank == 0 else None,
            loss_fn=loss_fn if rank == stages - 1 else None,
        )
        losses += [float(v) for v in out]
    telemetry = pipeline.pop_telemetry()
    return {
        "state": {k: v.clone() for k, v in module.state_dict().items()},
        "staleness": list(pipeline.staleness),
        "forward_units": pipeline.forward_units,
        "backward_units": pipeline.backward_units,
        "updates": pipeline.updates,
        "losses": losses,
        "targets": seen_targets,
        "order": [f"{e.kind}{e.micro_batch}" for e in pipeline.timeline if e.kind in ("F", "B")],
        "telemetry": telemetry,
        "norms": list(pipeline.norm_history),
    }


def _replay(
    stages: int,
    mode: str,
    plan: list[int | str],
    units_data: list[Any],
    boundaries: list[int] | None = None,
    clip_norm: float | None = None,
    learning_rate_scale: float | str = 1.0,
) -> list[dict[str, torch.Tensor]]:
    """Single-process replay of the same per-stage order, gradients from one full autograd pass
    on the weights each stage's predictor gives the forward (stash, v2, 2bw: the backward uses
    the same). ``clip_norm``: clip every unit's gradient by its norm over all stages;
    ``learning_rate_scale``: the predictors' factor on each stage's learning rate.
    """
    torch.manual_seed(0)
    modules = split_stages(_layers(), BOUNDARIES[stages] if boundaries is None else boundaries)
    model = nn.Sequential(*modules)
    optimizers = [_optimizer(m.parameters()) for m in modules]
    predictors = [
        make_weight_predictor(
            mode,
            list(m.parameters()),
            o,
            stage=k,
            stages=stages,
            learning_rate_scale=learning_rate_scale,
        )
        for k, (m, o) in enumerate(zip(modules, optimizers))
    ]
    names = [[f"{k}.{n}" for n, _ in m.named_parameters()] for k, m in enumerate(modules)]
    forward_weights: dict[tuple[int, int], list[torch.Tensor]] = {}
    grads: dict[int, list[list[torch.Tensor]]] = {}
    accumulated = [0] * stages

    def gradients(unit: int) -> list[list[torch.Tensor]]:
        if unit not in grads:
            weights = {
                name: w.detach().clone().requires_grad_(True)
                for k in range(stages)
                for name, w in zip(names[k], forward_weights[(k, unit)])
            }
            x, y = units_data[unit]
            loss = F.cross_entropy(functional_call(model, weights, (x,)), y)
            flat = list(torch.autograd.grad(loss, list(weights.values())))
            if clip_norm is not None:
                norm = torch.sqrt(sum(g.double().pow(2).sum() for g in flat))
                coefficient = clip_norm / (float(norm) + 1e-6)
                if coefficient < 1.0:
                    flat = [g * coefficient for g in flat]
            per_stage, i = [], 0
            for k in range(stages):
                per_stage.append(flat[i : i + len(names[k])])
                i += len(names[k])
            grads[unit] = per_stage
        return grads[unit]

    def backward(k: int, unit: int) -> None:
        predictors[k].backward_weights(unit)
        predictors[k].release(unit)
        for p, g in zip(modules[k].parameters(), gradients(unit)[k]):
            p.grad = g.clone() if p.grad is None else p.grad + g
        accumulated[k] += 1
        if accumulated[k] == predictors[k].update_period:
            update(k)

    def update(k: int) -> None:
        for p in modules[k].parameters():
            p.grad /= accumulated[k]
        accumulated[k] = 0
        predictors[k].before_update()
        optimizers[k].step()
        predictors[k].after_update()
        for p in modules[k].parameters():
            p.grad = None

    unit, fill_start = 0, 0
    pending: list[set[int]] = [set() for _ in range(stages)]
    for entry in plan:
        if entry == "drain":
            for k in range(stages):
                for u in sorted(pending[k]):
                    backward(k, u)
                pending[k].clear()
                if accumulated[k]:
                    update(k)
            fill_start = unit
            continue
        for _ in range(int(entry)):
            for k in range(stages):
                used = predictors[k].forward_weights(unit)
                live = [p.detach().clone() for p in modules[k].parameters()]
                forward_weights[(k, unit)] = live if used is None else [w.clone() for w in used]
                pending[k].add(unit)
                older = unit - (stages - k - 1)
                if older >= fill_start:
                    pending[k].discard(older)
                    backward(k, older)
            unit += 1
    return [{k: v.clone() for k, v in m.state_dict().items()} for m in modules]


def test_docstring_table_is_the_rendered_1f1b_table() -> None:
    drawing = render(OneFOneBSchedule().table(3, 6))
    docstring = runtime.__doc__ or ""
    for line in drawing.splitlines():
        assert "    " + line in docstring


def test_one_stage_equals_plain_training_exactly() -> None:
    units_data = _data(8)
    result = _run_stage(0, 1, "v2", [3, 3, 2, "drain"], units_data)
    torch.manual_seed(0)
    model = nn.Sequential(*_layers())
    optimizer = _optimizer(model.parameters())
    for x, y in units_data:
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
    plain = {f"layers.{k}": v for k, v in model.state_dict().items()}
    assert result["state"].keys() == plain.keys()
    for key, value in plain.items():
        torch.testing.assert_close(result["state"][key], value, rtol=0, atol=0)
    assert result["staleness"] == [0] * 8


def test_order_is_the_1f1b_table_across_steps_and_staleness_is_n_minus_k_minus_1() -> None:
    stages, plan = 3, [2, 2, 2, "drain"]
    units_data = _data(6)

    def body(rank: int, world: int) -> dict[str, Any]:
        return _run_stage(rank, world, "none", plan, units_data, record=True)

    results = run_distributed(body, stages, timeout=60)
    table = OneFOneBSchedule().table(stages, 6)
    for k, result in enumerate(results):
        assert result["order"] == [str(a) for a in table[k]]
        lag = stages - k - 1
        # the fill ramps up (unit u has u updates before it), then exactly N-k-1
        assert result["staleness"] == [min(u, lag) for u in range(6)]
        assert result["telemetry"].staleness_max == lag


def test_every_micro_batch_applied_exactly_once_with_drains_and_uneven_steps() -> None:
    stages, plan = 3, [3, 1, "drain", 2, 4, 1, "drain"]
    units_data = _data(11)

    def body(rank: int, world: int) -> dict[str, Any]:
        return _run_stage(rank, world, "stash", plan, units_data)

    results = run_distributed(body, stages, timeout=60)
    for result in results:
        assert result["forward_units"] == list(range(11))
        assert sorted(result["backward_units"]) == list(range(11))
        assert result["updates"] == 11
    # the last stage computed one loss per micro-batch, on every target exactly once
    expected_targets = [t for _, y in units_data for t in y.tolist()]
    assert results[-1]["targets"] == expected_targets
    assert len(results[-1]["losses"]) == 11
    # staleness restarts after each drain (a new fill)
    assert results[0]["staleness"] == [0, 1, 2, 2, 0, 1, 2, 2, 2, 2, 2]


@pytest.mark.parametrize("mode", ["stash", "v2", "2bw"])
def test_weights_equal_single_process_replay(mode: str) -> None:
    stages, plan = 3, [2, 3, "drain", 3, 2, "drain"]
    units_data = _data(10)

    def body(rank: int, world: int) -> dict[str, Any]:
        return _run_stage(rank, world, mode, plan, units_data)

    results = run_distributed(body, stages, timeout=60)
    replayed = _replay(stages, mode, plan, units_data)
    for k in range(stages):
        for key, value in replayed[k].items():
            torch.testing.assert_close(results[k]["state"][key], value, rtol=1e-5, atol=1e-6)


def test_prediction_lowers_the_weight_error_and_v1_none_run() -> None:
    stages, plan = 2, [4] * 6 + ["drain"]
    units_data = _data(24, size=8)
    errors: dict[str, Any] = {}
    for mode in ("v2", "v1", "none"):

        def body(rank: int, world: int, mode: str = mode) -> dict[str, Any]:
            return _run_stage(rank, world, mode, plan, units_data)

        results = run_distributed(body, stages, timeout=60)
        errors[mode] = results[0]["telemetry"]
        assert results[0]["updates"] == results[1]["updates"] == 24
    assert errors["none"].prediction_error == pytest.approx(errors["none"].stale_error)
    assert errors["v2"].prediction_error < errors["v2"].stale_error
    assert errors["v2"].weight_bytes_peak > 0 and errors["none"].weight_bytes_peak == 0


def test_norm_estimate_is_exact_on_stage_0_and_borrows_the_upstream_share() -> None:
    stages, plan = 3, [2, 2, 2, "drain"]
    units_data = _data(6)

    def body(rank: int, world: int) -> dict[str, Any]:
        return _run_stage(rank, world, "v2", plan, units_data, track_norms=True)

    results = run_distributed(body, stages, timeout=60)
    own = [[o for o, _ in r["norms"]] for r in results]
    for j in range(6):
        exact = own[0][j] + own[1][j] + own[2][j]
        assert results[0]["norms"][j][1] == pytest.approx(exact, rel=1e-12)
        for k in (1, 2):
            downstream = sum(own[i][j] for i in range(k, stages))
            upstream = results[k]["norms"][j][1] - downstream
            # the upstream share of an earlier update v (or nothing before any is known)
            candidates = [sum(own[i][v] for i in range(k)) for v in range(j)]
            assert upstream == 0.0 or any(upstream == pytest.approx(c) for c in candidates)
            if j >= 3:  # by then stage 0's totals have reached every stage
                assert upstream > 0.0


def test_data_parallel_across_two_pipelines_averages_the_replicas() -> None:
    """4 ranks = 2 pipelines x 2 stages; each stage averages its gradient with its peer."""
    units_a, units_b = _data(4, seed=3), _data(4, seed=4)

    def body(rank: int, world: int) -> dict[str, Any]:
        group_index, stage = divmod(rank, 2)
        replicas = [dist.new_group([0, 2]), dist.new_group([1, 3])]
        torch.manual_seed(0)
        module = split_stages(_layers(), [2])[stage]
        optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
        pipeline = NoFlushPipeline(
            module,
            stage=stage,
            stages=2,
            optimizer=optimizer,
            transport=StageTransport(stage, [2 * group_index, 2 * group_index + 1]),
            data_parallel_group=replicas[stage],
        )
        data = units_a if group_index == 0 else units_b
        for index in range(4):
            x, y = data[index]
            pipeline.step(
                1,
                inputs=[(x,)] if stage == 0 else None,
                loss_fn=(lambda fw, i, x=x, y=y: F.cross_entropy(fw(x), y)) if stage == 1 else None,
            )
        pipeline.drain()
        return {k: v.clone() for k, v in module.state_dict().items()}

    results = run_distributed(body, 4, timeout=90)
    for stage in range(2):
        for key in results[stage]:
            torch.testing.assert_close(results[stage][key], results[stage + 2][key])
    # the same as one pipeline whose micro-batches are the union of the replicas' (mean loss)
    merged = [
        (torch.cat([xa, xb]), torch.cat([ya, yb])) for (xa, ya), (xb, yb) in zip(units_a, units_b)
    ]

    def single(rank: int, world: int) -> dict[str, Any]:
        torch.manual_seed(0)
        module = split_stages(_layers(), [2])[rank]
        optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
        pipeline = NoFlushPipeline(
            module,
            stage=rank,
            stages=2,
            optimizer=optimizer,
            transport=StageTransport(rank, [0, 1]),
        )
        for x, y in merged:
            pipeline.step(
                1,
                inputs=[(x,)] if rank == 0 else None,
                loss_fn=(lambda fw, i, x=x, y=y: F.cross_entropy(fw(x), y)) if rank == 1 else None,
            )
        pipeline.drain()
        return {k: v.clone() for k, v in module.state_dict().items()}

    reference = run_distributed(single, 2, timeout=60)
    for stage in range(2):
        for key, value in reference[stage].items():
            torch.testing.assert_close(results[stage][key], value, rtol=1e-5, atol=1e-6)


def test_memory_per_option_on_four_stages_is_the_documented_table() -> None:
    """docs/spectrain.md quotes this table: peak weight copies held per stage."""
    table = {"none": [0, 0, 0, 0], "stash": [3, 2, 1, 0], "2bw": [1, 1, 1, 0]}
    table |= {"v1": [1, 1, 1, 1], "v2": [4, 3, 2, 0]}

    def body(rank: int, world: int) -> dict[str, float]:
        peaks = {}
        for mode in table:
            torch.manual_seed(0)
            layers = [nn.Sequential(nn.Linear(16, 16), nn.ReLU()) for _ in range(8)]
            module = split_stages(layers, [2, 4, 6])[rank]
            optimizer = torch.optim.SGD(module.parameters(), lr=0.01, momentum=0.9)
            predictor = make_weight_predictor(
                mode, list(module.parameters()), optimizer, stage=rank, stages=world
            )
            pipeline = NoFlushPipeline(
                module,
                stage=rank,
                stages=world,
                optimizer=optimizer,
                predictor=predictor,
                transport=StageTransport(rank, list(range(world))),
            )
            for _ in range(4):
                x, y = torch.randn(2, 4, 16), torch.randint(0, 16, (2, 4))
                pipeline.step(
                    2,
                    inputs=[(x[0],), (x[1],)] if rank == 0 else None,
                    loss_fn=(lambda fw, i, x=x, y=y: F.cross_entropy(fw(x[i]), y[i]))
                    if rank == world - 1
                    else None,
                )
            pipeline.drain()
            peaks[mode] = predictor.peak_bytes() / predictor.stage_bytes
        return peaks

    results = run_distributed(body, 4, timeout=60)
    for mode, expected in table.items():
        assert [r[mode] for r in results] == expected, mode


def test_bad_arguments_raise_naming_the_fix() -> None:
    module = nn.Linear(2, 2)
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="needs a StageTransport"):
        NoFlushPipeline(module, stage=0, stages=2, optimizer=optimizer)
    pipeline = NoFlushPipeline(module, stage=0, stages=1, optimizer=optimizer)
    with pytest.raises(ValueError, match="loss_fn"):
        pipeline.step(1, inputs=[(torch.ones(1, 2),)])
    with pytest.raises(RuntimeError, match="exactly once"):
        pipeline.step(1, loss_fn=lambda forward, i: torch.zeros(()))
