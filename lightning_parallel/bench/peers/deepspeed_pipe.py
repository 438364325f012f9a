"""Pipeline peer for the benchmark: ``deepspeed_pipe``, DeepSpeed's pipeline engine.

It is DeepSpeed's ``PipelineEngine`` as its documentation sets it up: a
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
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from lightning_parallel.bench.peers.layers import peer_layers
from lightning_parallel.bench.peers.whole_model import WholeModelPeer
from lightning_parallel.bench.specs import register_baseline
from lightning_parallel.comm.ledger import process_ledger
from lightning_parallel.compat.private import unwrapped_optimizer
from lightning_parallel.pipeline.microbatch import batch_size

__all__: list[str] = []


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
        length = batch_size(batch)
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


def deepspeed_pipe(**options: Any) -> DeepSpeedPipeStrategy:
    """DeepSpeed's PipelineEngine with its default ``parameters`` partition."""
    return DeepSpeedPipeStrategy(**options)


register_baseline(
    "deepspeed_pipe", deepspeed_pipe, "DeepSpeed PipelineEngine, partition_method='parameters'"
)
