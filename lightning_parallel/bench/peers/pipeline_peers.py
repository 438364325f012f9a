"""Pipeline peers for the benchmark: ``torch_gpipe``, ``torch_1f1b`` and ``deepspeed_pipe``.

``torch.distributed.pipelining`` run the way its documentation tells users to: the model cut
into stages with the same number of layers (``partition="even"``), one ``PipelineStage`` per
rank, ``ScheduleGPipe`` or ``Schedule1F1B`` over the micro-batches; with several groups, the
stage gradients are averaged across groups after the whole step (nothing overlaps backward).
Everything Lightning-facing (the unchanged ``training_step`` as the loss function, logging,
checkpoints, evaluation) is :class:`~lightning_parallel.strategies.gropipe.GroPipeStrategy`'s,
so the table compares engines and partitions, not integrations. Importing this module also
registers ``gropipe`` with Lightning (the benchmark imports every peer module).

``deepspeed_pipe`` is DeepSpeed's ``PipelineEngine`` as its documentation sets it up: a
``PipelineModule`` over the same layers with the default ``partition_method="parameters"``,
``engine.train_batch`` over ``m`` micro-batches (its own 1F1B-style schedule, then one
gradient allreduce across data-parallel replicas after all micro-batches, then its optimizer
step with the Lightning optimizer). Its placement is DeepSpeed's (stage-major ranks), its loss is
cross-entropy on ``(x, y)`` batches (the demo models'), and it needs ``DS_ACCELERATOR=cpu``
(set here when unset) and gloo on CPU. Evaluation runs the whole model on every rank after the
stages' weights are gathered.

Its config sets ``gradient_clipping: 0.0``, so that it trains what every other run of the table
trains: DeepSpeed's default is 1.0 (since its PR #8068), a clipping no other run does, which
once vgg_mini's gradients grow past norm 1 changes its trajectory (docs/gropipe.md, "Measured").
Lightning's ``gradient_clip_val`` and ``accumulate_grad_batches`` are refused: DeepSpeed's
``clip_grad_norm_`` scales every stage by the norm of the first stage's gradients only (pipeline
parameters are not model-parallel ones, so only model-parallel rank 0 counts them), not the
whole model's norm that Lightning and GroPipe clip by, and its engine steps the optimizer inside
every ``train_batch``.
"""

from __future__ import annotations

import time
from abc import abstractmethod
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_parallel.bench.peers.layers import peer_layers
from lightning_parallel.bench.specs import register_baseline
from lightning_parallel.comm.ledger import process_ledger
from lightning_parallel.compat.private import unwrapped_optimizer
from lightning_parallel.pipeline.assembly import Pipeline
from lightning_parallel.pipeline.grad_sync import SyncTiming
from lightning_parallel.pipeline.microbatch import merge_microbatches
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
        length = batch_length(batch)
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


def batch_length(batch: Any) -> int:
    if isinstance(batch, Tensor):
        return len(batch)
    if isinstance(batch, (list, tuple)):
        return batch_length(batch[0])
    if isinstance(batch, dict):
        return batch_length(next(iter(batch.values())))
    raise TypeError(f"cannot tell the size of a batch of type {type(batch).__name__}")


class WholeModelPeer(GroPipeStrategy):
    """A peer that keeps the whole model on every rank while each rank trains its own stages:
    :meth:`consolidate` copies every stage's weights from the rank that trains it, before
    evaluation and at the end of ``fit``."""

    owns_stages = False

    @abstractmethod
    def consolidate(self) -> None:
        """Copy every stage's weights from the rank that trains it to every rank."""

    def on_validation_start(self) -> None:
        self.consolidate()

    def on_train_end(self) -> None:
        """Give every rank every stage's weights: the fork/spawn launchers hand rank 0's model
        back, and the next run in the same processes (``validate`` after ``fit``) starts by
        copying rank 0's model to every rank."""
        super().on_train_end()
        self.consolidate()


class DeepSpeedPipeStrategy(WholeModelPeer):
    """DeepSpeed's PipelineEngine inside Lightning's loop (see the module docstring).

    Args:
        stages: pipeline stages per data-parallel replica.
        micro_batches: micro-batches per batch (DeepSpeed's gradient accumulation steps).
        partition_method: DeepSpeed's ``partition_method`` (default ``"parameters"``).
        **kwargs: passed to :class:`GroPipeStrategy` (``start_method``, ...).
    """

    def __init__(
        self,
        stages: int = 2,
        micro_batches: int = 8,
        partition_method: str = "parameters",
        **kwargs: Any,
    ) -> None:
        kwargs.setdefault("deferred_batch_norm", False)
        super().__init__(stages=stages, micro_batches=micro_batches, partition="even", **kwargs)
        self.partition_method = partition_method
        self._engine: Any = None
        self._layers: list[torch.nn.Module] = []
        self._parts: list[int] = []

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        # DeepSpeed's grid is stage-major: rank = stage * groups + replica
        return {"num_replicas": self.groups, "rank": self.global_rank % self.groups}

    def _build_engine(self, batch_size: int) -> Any:
        import os

        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        try:
            import deepspeed
            from deepspeed.pipe import PipelineModule
        except ImportError as error:
            raise ImportError(
                "deepspeed_pipe needs DeepSpeed: pip install 'lightning-parallel[bench]'"
            ) from error
        import torch.nn.functional as F

        module = self.lightning_module
        assert module is not None
        deepspeed.init_distributed(dist_backend=dist.get_backend())
        network = getattr(module, "layers", None)
        body = network if isinstance(network, torch.nn.Module) else self._body
        self._layers = list(peer_layers(body, "deepspeed_pipe"))
        pipe = PipelineModule(
            layers=self._layers,
            num_stages=self.stages,
            loss_fn=F.cross_entropy,
            partition_method=self.partition_method,
        )
        self._parts = [int(p) for p in pipe.parts]
        config = engine_config(batch_size, self.micro_batches, self.groups)
        optimizer = self.optimizers[0]
        optimizer = unwrapped_optimizer(optimizer)
        engine, _, _, _ = deepspeed.initialize(model=pipe, optimizer=optimizer, config=config)
        return engine

    def setup(self, trainer: Any) -> None:
        """Refuse the Lightning settings DeepSpeed's engine cannot follow (module docstring)."""
        if trainer.gradient_clip_val:
            raise ValueError(
                "deepspeed_pipe does not clip like Lightning: DeepSpeed's PipelineEngine scales "
                "every stage by the norm of the first stage's gradients only, not the whole "
                "model's; compare without gradient_clip_val, or use gropipe or the torch peers, "
                "which clip by the whole model's norm"
            )
        if trainer.accumulate_grad_batches != 1:
            raise ValueError(
                "deepspeed_pipe steps DeepSpeed's optimizer after every batch (its micro-batches "
                "are its gradient accumulation); compare without accumulate_grad_batches, or use "
                "gropipe or the torch peers, which accumulate across batches"
            )
        super().setup(trainer)

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        """DeepSpeed builds its own stages (in the first ``training_step``)."""

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        batch = args[0]
        length = batch_length(batch)
        if length % self.micro_batches:
            raise ValueError(
                f"deepspeed_pipe needs batches divisible by micro_batches={self.micro_batches}, "
                f"got {length} samples"
            )
        if not isinstance(batch, (list, tuple)) or len(batch) != 2:
            parts = len(batch) if isinstance(batch, (list, tuple)) else 1
            raise ValueError(
                "deepspeed_pipe feeds (input, target) batches to a PipelineModule with a "
                f"cross-entropy loss; this model's batches have {parts} parts: compare on a "
                "one-input classifier, or use gropipe or spectrain, which pipeline several inputs"
            )
        if self._engine is None:
            self._engine = self._build_engine(length)
        x, y = batch[0], batch[1]
        chunks = list(zip(x.chunk(self.micro_batches), y.chunk(self.micro_batches)))
        start = time.perf_counter()
        loss = self._engine.train_batch(data_iter=iter(chunks))
        process_ledger().set_gauge("pipeline_step_seconds", time.perf_counter() - start)
        module = self.lightning_module
        assert module is not None
        value = torch.as_tensor(loss, dtype=torch.float32).detach().reshape(())
        module.log("train_loss", value, prog_bar=True)
        return value

    def optimizer_step(
        self, optimizer: Any, closure: Callable[[], Any], model: Any = None, **kwargs: Any
    ) -> Any:
        """DeepSpeed stepped the optimizer inside ``train_batch``: only run the closure."""
        return closure()

    def consolidate(self) -> None:
        if self._engine is None or self.world_size == 1:
            return
        from lightning_parallel.pipeline.consolidate import broadcast_stage_state
        from lightning_parallel.pipeline.ownership import stage_tensors

        stages = [
            [
                t
                for layer in self._layers[self._parts[k] : self._parts[k + 1]]
                for t in stage_tensors(layer)
            ]
            for k in range(self.stages)
        ]
        owners = [self._engine.grid.stage_to_global(stage_id=k, data=0) for k in range(self.stages)]
        broadcast_stage_state(stages, owners, int(self._engine.stage_id))

    def _evaluation_step(self, hook: str, context: Callable[[], Any], args: tuple[Any, ...]) -> Any:
        module = self.lightning_module
        assert module is not None
        with context():
            return getattr(module, hook)(*args)


def engine_config(batch_size: int, micro_batches: int, groups: int) -> dict[str, Any]:
    """DeepSpeed's config for batches of ``batch_size`` per replica in ``micro_batches`` parts.

    Clipping is off (``gradient_clipping: 0.0``; DeepSpeed's default is 1.0): the other runs of
    the table do not clip, and DeepSpeed's pipeline norm is not the whole model's (module
    docstring).
    """
    micro = batch_size // micro_batches
    return {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": micro_batches,
        "train_batch_size": micro * micro_batches * groups,
        "gradient_clipping": 0.0,
        "steps_per_print": 10**9,
    }


def torch_gpipe(**options: Any) -> TorchPipeliningStrategy:
    """``torch.distributed.pipelining.ScheduleGPipe`` on an even split by layer count."""
    return TorchPipeliningStrategy(schedule="gpipe", **options)


def torch_1f1b(**options: Any) -> TorchPipeliningStrategy:
    """``torch.distributed.pipelining.Schedule1F1B`` on an even split by layer count."""
    return TorchPipeliningStrategy(schedule="1f1b", **options)


def deepspeed_pipe(**options: Any) -> DeepSpeedPipeStrategy:
    """DeepSpeed's PipelineEngine with its default ``parameters`` partition."""
    return DeepSpeedPipeStrategy(**options)


register_baseline(
    "deepspeed_pipe", deepspeed_pipe, "DeepSpeed PipelineEngine, partition_method='parameters'"
)
register_baseline(
    "torch_gpipe", torch_gpipe, "torch.distributed.pipelining ScheduleGPipe, even split by layers"
)
register_baseline(
    "torch_1f1b", torch_1f1b, "torch.distributed.pipelining Schedule1F1B, even split by layers"
)
