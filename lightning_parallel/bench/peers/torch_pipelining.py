"""Pipeline peers for the benchmark: ``torch_gpipe`` and ``torch_1f1b``.

``torch.distributed.pipelining`` run the way its documentation tells users to: the model cut
into stages with the same number of layers (``partition="even"``), one ``PipelineStage`` per
rank, ``ScheduleGPipe`` or ``Schedule1F1B`` over the micro-batches; with several groups, the
stage gradients are averaged across groups after the whole step (nothing overlaps backward).
Everything Lightning-facing (the unchanged ``training_step`` as the loss function, logging,
checkpoints, evaluation) is :class:`~lightning_parallel.strategies.gropipe.GroPipeStrategy`'s,
so the table compares engines and partitions, not integrations. Importing this module also
registers ``gropipe`` with Lightning (the benchmark imports every peer module).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_parallel.bench.specs import register_baseline
from lightning_parallel.comm.ledger import process_ledger
from lightning_parallel.pipeline.assembly import Pipeline
from lightning_parallel.pipeline.grad_sync import SyncTiming
from lightning_parallel.pipeline.microbatch import batch_size, merge_microbatches
from lightning_parallel.pipeline.runtime import StepStatistics
from lightning_parallel.pipeline.summary import SummaryResult
from lightning_parallel.strategies.gropipe import GroPipeStrategy

__all__: list[str] = []


class TorchPipeliningStrategy(GroPipeStrategy):
    """GroPipe's Lightning integration driving ``torch.distributed.pipelining`` instead.

    Args:
        stages: pipeline stages per group.
        micro_batches: micro-batches per batch.
        schedule: ``"gpipe"`` (``ScheduleGPipe``) or ``"1f1b"`` (``Schedule1F1B``).
        **kwargs: passed to :class:`GroPipeStrategy` (``start_method``, ...).
    """

    def __init__(
        self, stages: int = 2, micro_batches: int = 8, schedule: str = "gpipe", **kwargs: Any
    ) -> None:
        kwargs.setdefault("partition", "even")
        kwargs.setdefault("deferred_batch_norm", False)
        super().__init__(stages=stages, micro_batches=micro_batches, schedule=schedule, **kwargs)
        self._torch_schedule: Any = None
        self._torch_count = 0
        self._peer_name = f"torch_{schedule}"

    def setup_environment(self) -> None:
        super().setup_environment()
        if self.world_size > 1:
            check_peer_transport(self._peer_name, self.root_device, dist.get_backend())

    def _build_schedule(
        self, pipeline: Pipeline, count: int, loss: Callable[[Tensor, Tensor], Tensor]
    ) -> Any:
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

        assert self._topology is not None and self._groups is not None
        group = self._groups.pipeline
        module = pipeline.stages[self.stage_index]
        stage = PipelineStage(
            OneCut(module) if self.stage_index > 0 else module,
            self.stage_index,
            self.stages,
            self.root_device,
            group=group,
        )
        # our placement puts the last stage first; tell torch which group rank holds each stage
        ranks = self._topology.pipeline_ranks(self.group_index)
        assert group is not None
        stage.stage_index_to_group_rank = {
            k: dist.get_group_rank(group, r) for k, r in enumerate(ranks)
        }  # type: ignore[arg-type]
        kind = ScheduleGPipe if self.schedule.name == "gpipe" else Schedule1F1B
        return kind(stage, n_microbatches=count, loss_fn=loss, scale_grads=False)

    def held_modules(self, pipeline: Pipeline) -> list[torch.nn.Module]:
        """The modules this rank runs under torch's schedule (one stage here)."""
        return [pipeline.stages[self.stage_index]]

    def holds_ends(self) -> tuple[bool, bool]:
        """Whether this rank runs the model's first stage (is given the inputs) and its last
        (computes the loss)."""
        return self.stage_index == 0, self.stage_index == self.stages - 1

    def run_schedule(
        self,
        pipeline: Pipeline,
        batch: Any,
        count: int,
        inputs: list[tuple[Any, ...]] | None,
        loss_fn: Callable[[int, Any], Tensor],
    ) -> StepStatistics:
        stats = StepStatistics()
        length = batch_size(batch)
        chunk_of = {int(c[0]): i for i, c in enumerate(torch.arange(length).tensor_split(count))}

        def loss(output: Tensor, target: Tensor) -> Tensor:
            if not _backward_initialized(self._torch_schedule):
                # torch's first-step metadata inference: shapes only, no user code, no gradient
                return output.float().sum() * 0.0
            # torch splits ``target`` (sample positions) like the batch: its first one tells which
            index = chunk_of[int(target[0])]
            value = loss_fn(index, output)
            stats.losses[index] = value.detach()
            return value

        buffers: list[tuple[Tensor, Tensor]] = []
        if self._torch_schedule is None or self._torch_count != count:
            self._torch_schedule = self._build_schedule(pipeline, count, loss)
            self._torch_count = count
            # torch infers the shapes a later stage receives by running it on uninitialised
            # tensors in the first step; a BatchNorm's running statistics would keep the NaNs
            # of that run for good: they are put back as they were after the step
            buffers = [
                (b, b.detach().clone()) for m in self.held_modules(pipeline) for b in m.buffers()
            ]
        else:
            self._torch_schedule._loss_fn = loss
        first, last = self.holds_ends()
        target = torch.arange(length, device=self.root_device) if last else None
        start = time.perf_counter()
        if first:
            assert inputs is not None
            arguments = merge_microbatches(list(inputs))
            if len(arguments) != 1:
                raise ValueError(
                    f"{self._peer_name} feeds one input tensor to the first stage (torch's "
                    f"PipelineStage as its documentation uses it); this model's forward takes "
                    f"{len(arguments)} inputs: compare on a one-input model, or use gropipe or "
                    "spectrain, which pipeline several inputs"
                )
            self._torch_schedule.step(*arguments, target=target, losses=[])
        else:
            self._torch_schedule.step(target=target, losses=[])
        with torch.no_grad():
            for buffer, saved in buffers:
                buffer.copy_(saved)
        stats.step_seconds = time.perf_counter() - start
        return stats

    def trained_parameters(self, pipeline: Pipeline) -> list[torch.nn.Parameter]:
        """The parameters whose gradients this rank's schedule computes."""
        return pipeline.owned_parameters

    def finish_gradients(self, pipeline: Pipeline) -> SyncTiming:
        """Average the stage's gradients across groups, after the pipeline (blocking)."""
        if self.groups == 1 or self._groups is None:
            return SyncTiming()
        grads = [p.grad for p in self.trained_parameters(pipeline) if p.grad is not None]
        if not grads:
            return SyncTiming()
        start = time.perf_counter()
        bucket = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(bucket, group=self._groups.data_parallel)
        bucket /= self.groups
        offset = 0
        for grad in grads:
            grad.copy_(bucket[offset : offset + grad.numel()].view_as(grad))
            offset += grad.numel()
        seconds = time.perf_counter() - start
        return SyncTiming(seconds, seconds, bucket.numel() * bucket.element_size(), start)

    def record(self, summary: SummaryResult, stats: StepStatistics, count: int) -> None:
        self.last_summary = summary
        ledger = process_ledger()
        ledger.set_gauge("pipeline_step_seconds", max(summary.step_seconds))
        if self.groups > 1:
            ledger.set_gauge("allreduce_seconds", sum(summary.sync_seconds))
            ledger.set_gauge("allreduce_exposed_seconds", sum(summary.exposed_seconds))


def check_peer_transport(name: str, device: torch.device, backend: str) -> None:
    """Refuse a CUDA device over gloo: ``torch.distributed.pipelining`` hands the CUDA stage
    tensors straight to the process group's ``send``/``recv``, which gloo's TCP transport cannot
    read (on an H100 with torch 2.11, every torch peer aborted in its first step with ``writev:
    Bad address``). GroPipe and SpecTrain stage CUDA tensors through host memory for gloo."""
    if device.type == "cuda" and backend == "gloo":
        raise ValueError(
            f"{name} runs torch.distributed.pipelining, which sends CUDA tensors through the "
            "process group as they are, and gloo cannot send CUDA tensors: give each rank a GPU "
            "of its own with process_group_backend='nccl' (the bench does so when there are as "
            "many GPUs as ranks), or run it on the CPU"
        )


def _backward_initialized(schedule: Any) -> bool:
    """Whether torch's schedule has inferred its backward metadata (its first step has run);
    the flag is ``_stage_backward_initialized`` on one-stage schedules, ``_stages_...`` on
    schedules of several stages per rank."""
    for name in ("_stage_backward_initialized", "_stages_backward_initialized"):
        if hasattr(schedule, name):
            return bool(getattr(schedule, name))
    return True


class OneCut(torch.nn.Module):
    """A stage after the first, called the way torch's ``PipelineStage`` calls it.

    torch passes the tensors of a cut that carries several (a skip connection, a transformer's
    hidden state with its mask) as separate positional arguments; our stages take the cut as
    one argument.
    """

    def __init__(self, stage: torch.nn.Module) -> None:
        super().__init__()
        self.stage = stage

    def forward(self, *cut: Any) -> Any:
        return self.stage(cut if len(cut) > 1 else cut[0])


def torch_gpipe(**options: Any) -> TorchPipeliningStrategy:
    """``torch.distributed.pipelining.ScheduleGPipe`` on an even split by layer count."""
    return TorchPipeliningStrategy(schedule="gpipe", **options)


def torch_1f1b(**options: Any) -> TorchPipeliningStrategy:
    """``torch.distributed.pipelining.Schedule1F1B`` on an even split by layer count."""
    return TorchPipeliningStrategy(schedule="1f1b", **options)


register_baseline(
    "torch_gpipe", torch_gpipe, "torch.distributed.pipelining ScheduleGPipe, even split by layers"
)
register_baseline(
    "torch_1f1b", torch_1f1b, "torch.distributed.pipelining Schedule1F1B, even split by layers"
)
