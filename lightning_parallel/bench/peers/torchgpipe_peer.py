"""The ``torchgpipe`` peer: torchgpipe's ``GPipe`` in one process per replica, data parallel across.

torchgpipe (Kakao Brain, Kim et al. 2020) pipelines an ``nn.Sequential`` over several devices of
*one* process (a thread per device, fork/join "phony" dependencies, checkpointing
``"except_last"`` by default). It has no multi-process pipeline, so on the benchmark's cluster
it runs the way its documentation shows, "where it fits": every process holds the whole
pipeline, ``stages`` partitions on ``stages`` devices (``cpu`` here, each its own worker
thread), balanced by ``torchgpipe.balance.balance_by_time`` on a sample micro-batch, as its
guide tells users to; the processes are data-parallel replicas whose gradients are averaged
by one allreduce after the whole step (DDP cannot wrap it: each parameter's gradient
accumulates once per micro-batch, which DDP's reducer rejects).

So each process trains its own samples (the benchmark's samples/s counts each once), while
``gropipe``, ``torch_gpipe``, ``torch_1f1b`` and ``deepspeed_pipe`` put one stage on each
process (their samples/s counts each sample once per stage).

The model is not changed: its ``layers`` keep their names (checkpoints load anywhere), only
their ``forward`` goes through the ``GPipe`` wrapper while fitting.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from pytorch_lightning.strategies import DDPStrategy
from torch import Tensor, nn

from lightning_parallel.bench.peers.layers import peer_layers
from lightning_parallel.bench.specs import register_baseline
from lightning_parallel.comm.ledger import process_ledger

__all__: list[str] = []


class TorchGPipeStrategy(DDPStrategy):
    """torchgpipe ``GPipe`` over ``module.layers`` in every process; gradients allreduced after.

    Args:
        stages: partitions (devices) of each process's pipeline.
        micro_batches: torchgpipe's ``chunks``.
        checkpoint: torchgpipe's ``checkpoint`` (``"except_last"``, ``"always"``, ``"never"``).
        **kwargs: passed to ``DDPStrategy`` (``start_method``, ...).
    """

    reports_communication = True  # its allreduce is a Python collective, counted as such

    def __init__(
        self,
        stages: int = 2,
        micro_batches: int = 8,
        checkpoint: str = "except_last",
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        if int(stages) < 1 or int(micro_batches) < 1:
            raise ValueError("stages and micro_batches must be integers >= 1")
        self.stages = int(stages)
        self.micro_batches = int(micro_batches)
        self.checkpoint = checkpoint
        self.balance: list[int] | None = None
        self._pipe: Any = None
        self._whole_forward: Any = None
        self.pipelined_batches = 0

    def setup(self, trainer: Any) -> None:
        assert self.accelerator is not None and self.model is not None
        self.accelerator.setup(trainer)
        self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        if self.world_size > 1:
            with torch.no_grad():
                for tensor in [*self.model.parameters(), *self.model.buffers()]:
                    dist.broadcast(tensor, src=0)
        if trainer.state.fn == "fit":
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()

    def _attach(self, sample: Tensor) -> None:
        from torchgpipe import GPipe
        from torchgpipe.balance import balance_by_time

        module = self.lightning_module
        body = getattr(module, "layers", None)
        if not isinstance(body, nn.Module):
            raise ValueError("the torchgpipe peer needs the model's network in `self.layers`")
        layers = peer_layers(body, "torchgpipe")
        self._whole_forward = body.forward
        micro = sample[: max(1, len(sample) // self.micro_batches)]
        devices = [self.root_device] * self.stages
        self.balance = [
            int(b) for b in balance_by_time(self.stages, layers, micro, device=self.root_device)
        ]
        self._pipe = GPipe(
            layers,
            balance=self.balance,
            devices=devices,
            chunks=self.micro_batches,
            checkpoint=self.checkpoint,
        )
        body.forward = self._forward  # type: ignore[method-assign]

    def _forward(self, x: Tensor) -> Tensor:
        if torch.is_grad_enabled() and self._pipe is not None:
            self.pipelined_batches += 1
            return self._pipe(x)
        assert self._whole_forward is not None
        return self._whole_forward(x)

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        if self._pipe is None:
            batch = args[0]
            self._attach(batch[0] if isinstance(batch, (list, tuple)) else batch)
        start = time.perf_counter()
        output = super().training_step(*args, **kwargs)
        process_ledger().set_gauge("pipeline_forward_seconds", time.perf_counter() - start)
        return output

    def optimizer_step(
        self, optimizer: Any, closure: Callable[[], Any], model: Any = None, **kwargs: Any
    ) -> Any:
        def closure_with_mean_gradients() -> Any:
            result = closure()
            self._average_gradients()
            return result

        return super().optimizer_step(optimizer, closure_with_mean_gradients, model, **kwargs)

    def _average_gradients(self) -> None:
        if self.world_size == 1:
            return
        module = self.lightning_module
        assert module is not None
        grads = [p.grad for p in module.parameters() if p.grad is not None]
        if not grads:
            return
        bucket = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(bucket)
        bucket /= self.world_size
        offset = 0
        for grad in grads:
            grad.copy_(bucket[offset : offset + grad.numel()].view_as(grad))
            offset += grad.numel()

    def on_train_end(self) -> None:
        super().on_train_end()
        module = self.lightning_module
        if module is not None and self.balance is not None:
            # travels back to the launching process under fork/spawn: tests see the pipe ran
            metrics = module.trainer.callback_metrics
            metrics["torchgpipe/pipelined_batches"] = torch.tensor(float(self.pipelined_batches))
            metrics["torchgpipe/partitions"] = torch.tensor(float(len(self.balance)))

    def teardown(self) -> None:
        module = self.lightning_module
        layers = getattr(module, "layers", None) if module is not None else None
        if isinstance(layers, nn.Module) and "forward" in vars(layers):
            del layers.forward
        self._pipe = None
        super().teardown()


def torchgpipe_peer(**options: Any) -> TorchGPipeStrategy:
    """torchgpipe ``GPipe`` per process, ``balance_by_time``, allreduce across processes."""
    return TorchGPipeStrategy(**options)


register_baseline(
    "torchgpipe",
    torchgpipe_peer,
    "torchgpipe GPipe in each process (balance_by_time), data parallel across processes",
)
