"""The stage runtime on gloo processes: recomputation, traced models, telemetry, failures."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from helpers.distributed import run_distributed
from torch import nn

from lightning_parallel.pipeline.grad_sync import PartitionGradientSync
from lightning_parallel.pipeline.microbatch import split_microbatches
from lightning_parallel.pipeline.runtime import StageRuntime
from lightning_parallel.pipeline.schedule import get_schedule
from lightning_parallel.pipeline.stages import layer_sequence, split_stages
from lightning_parallel.pipeline.timeline import plot_timeline
from lightning_parallel.pipeline.topology import PipelineTopology, build_process_groups
from lightning_parallel.pipeline.transport import StageTransport


def dropout_model() -> nn.Sequential:
    torch.manual_seed(4)
    return nn.Sequential(
        nn.Linear(8, 64),
        nn.Dropout(0.3),
        nn.ReLU(),
        nn.Linear(64, 64),
        nn.Dropout(0.3),
        nn.ReLU(),
        nn.Linear(64, 2),
    )


class Residual(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(5)
        self.inp, self.mid, self.out = nn.Linear(8, 16), nn.Linear(16, 16), nn.Linear(16, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.inp(x))
        h = h + torch.tanh(self.mid(h))
        return self.out(h.view(x.size(0), -1)) + x[:, :2]  # the input is needed at the very end


def data() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(6)
    return torch.randn(16, 8, generator=generator), torch.randint(0, 2, (16,), generator=generator)


def run_pipeline(
    rank: int,
    world_size: int,
    model: nn.Module,
    boundaries: list[int],
    schedule: str,
    recompute: str,
    seed: int,
) -> tuple[dict[str, torch.Tensor], float, Any]:
    """One training step of ``model`` on a ``world_size``-stage pipeline; this stage's grads."""
    topology = PipelineTopology(world_size, world_size)
    stage = topology.stage_of(rank)
    groups = build_process_groups(topology, rank)
    x, y = data()
    layers = layer_sequence(model, (x[:4],))
    module = split_stages(layers, boundaries)[stage]
    transport = StageTransport(stage, topology.pipeline_ranks(0), groups.pipeline)
    runtime = StageRuntime(module, stage, world_size, transport, recompute=recompute, rank=rank)
    micro_batches = 4
    inputs = [(part,) for part in split_microbatches(x, micro_batches)]
    targets = split_microbatches(y, micro_batches)
    torch.manual_seed(seed)  # the same dropout stream in every recomputation mode
    stats = runtime.run_step(
        get_schedule(schedule).table(world_size, micro_batches)[stage],
        micro_batches,
        inputs,
        lambda j, out: F.cross_entropy(out, targets[j]) / micro_batches,
    )
    own = {id(p) for p in module.parameters()}
    grads = {
        n: p.grad.clone()
        for n, p in model.named_parameters()
        if id(p) in own and p.grad is not None
    }
    return grads, float(sum(stats.losses.values())), stats


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_recomputation_changes_memory_not_gradients(schedule: str) -> None:
    results = {}
    for mode in ("never", "except_last", "always"):
        results[mode] = run_distributed(run_pipeline, 2, dropout_model(), [4], schedule, mode, 11)
    for mode in ("except_last", "always"):
        for rank in range(2):
            for name, grad in results["never"][rank][0].items():
                torch.testing.assert_close(results[mode][rank][0][name], grad, rtol=0, atol=0)
        assert results[mode][0][1] == results["never"][0][1]  # rank 0 runs the last stage: losses
    peaks = {mode: results[mode][1][2].peak_activation_bytes for mode in results}  # stage 0
    # always: n inputs + one recomputed micro-batch; except_last: the last micro-batch's
    # activations as well (more than never when only n = 2 micro-batches are in flight)
    assert peaks["always"] < peaks["never"] and peaks["always"] < peaks["except_last"]
    recomputed = [e for e in results["always"][1][2].events if e.kind == "R"]
    assert len(recomputed) == 4


def test_traced_model_with_tuple_boundaries_matches_single_process(tmp_path: Path) -> None:
    model = Residual()
    x, y = data()
    reference = model(x)
    loss = sum(F.cross_entropy(out, t) / 4 for out, t in zip(reference.split(4), y.split(4)))
    loss.backward()  # type: ignore[union-attr]
    expected = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    # cut after the first layer: h and the input x both cross (a tuple), x again at the end
    results = run_distributed(run_pipeline, 3, model, [1, 3], "1f1b", "never", 0)
    seen = {}
    for grads, _, _ in results:
        seen.update(grads)
    assert seen.keys() == expected.keys()
    for name, grad in expected.items():
        torch.testing.assert_close(seen[name], grad, rtol=1e-5, atol=1e-7)
    assert results[0][1] == pytest.approx(float(loss), rel=1e-6)
    events = [event for _, _, stats in results for event in stats.events]
    assert {e.kind for e in events} >= {"F", "B", "wait"}
    assert plot_timeline(events, tmp_path / "timeline.png").stat().st_size > 0


def test_gradient_sync_reports_its_timing() -> None:
    def worker(rank: int, world_size: int) -> tuple[float, float, int, list[float]]:
        parameter = nn.Parameter(torch.zeros(1000))
        parameter.grad = torch.full((1000,), float(rank))
        sync = PartitionGradientSync([parameter], None, world_size)
        sync.launch()
        timing = sync.finish()
        return timing.duration, timing.exposed, timing.bytes, parameter.grad[:2].tolist()

    for duration, exposed, sent, grad in run_distributed(worker, 2):
        assert 0 <= exposed <= duration + 1e-3 and sent == 4000
        assert grad == [0.5, 0.5]  # the average of 0 and 1


def test_a_failing_stage_raises_instead_of_hanging() -> None:
    def worker(rank: int, world_size: int) -> None:
        class Broken(nn.Module):
            def forward(self, x: torch.Tensor) -> torch.Tensor:
                raise RuntimeError("stage exploded")

        model = nn.Sequential(nn.Linear(2, 2), Broken())
        topology = PipelineTopology(2, 2)
        stage = topology.stage_of(rank)
        module = split_stages(list(model), [1])[stage]
        transport = StageTransport(stage, topology.pipeline_ranks(0))
        runtime = StageRuntime(module, stage, 2, transport)
        runtime.run_step(
            get_schedule("1f1b").table(2, 2)[stage],
            2,
            [(torch.ones(1, 2),), (torch.ones(1, 2),)],
            lambda j, out: out.sum(),
        )

    with pytest.raises(RuntimeError, match="stage exploded"):
        run_distributed(worker, 2, timeout=60)
