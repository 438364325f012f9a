"""DDP whose communication hook really runs on every device, CPU and gloo included.

Lightning's ``DDPStrategy`` registers ``ddp_comm_hook`` only when the device is CUDA and drops it
silently otherwise (``DDPStrategy._register_ddp_hooks``), so ``DDPStrategy(ddp_comm_hook=...)``
on CPU trains with plain allreduce. :class:`HookedDDPStrategy` lifts that gate:

1. after Lightning wraps the model in ``DistributedDataParallel``, the hook is registered with
   ``DistributedDataParallel.register_comm_hook`` whatever the device;
2. the hook is wrapped so that every call increments :attr:`HookedDDPStrategy.hook_calls`,
   which tests and the benchmark read to prove it ran;
3. the hook's collectives go through ``torch.distributed``'s module functions, so the
   :class:`~lightning_parallel.callbacks.CommStats` callback counts their bytes
   (``reports_communication = True``).

Registered names (torch's built-in hooks, ``torch.distributed.algorithms.ddp_comm_hooks``):

- ``ddp_fp16``: ``fp16_compress_hook``, gradients cast to float16 for the allreduce (half the
  bytes; float16 rounding of the summed gradient);
- ``ddp_powersgd``: ``powerSGD_hook`` (Vogels et al., "PowerSGD: Practical Low-Rank Gradient
  Compression for Distributed Optimization", NeurIPS 2019): each gradient matrix M (n×m) is
  approximated as P·Qᵀ of rank r by one power iteration, P = M·Q, allreduce P, orthogonalize,
  Q = Mᵀ·P, allreduce Q, with error feedback; it sends (n+m)·r instead of n·m numbers.
  Options ``rank`` (default 2; lower means more compression) and ``start_powerSGD_iter``
  (default 2: plain allreduce for the first steps).

gloo matches collectives by the order in which they are issued. PowerSGD issues a bucket's
second and third allreduce from completion callbacks that run on gloo's threads, so with
several buckets in flight two ranks can issue them in different orders (gloo aborts with
"Received data size doesn't match expected size"). On gloo, :class:`PowerSGDDDPStrategy`
therefore completes each bucket's collectives inside its hook call, before DDP hands over the
next bucket (``serialize_buckets``): the order is then the bucket order on every rank.

Example::

    trainer = Trainer(accelerator="cpu", devices=2, strategy="ddp_powersgd")
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.nn.parallel import DistributedDataParallel
from typing_extensions import override

from lightning_parallel.comm.ledger import process_ledger
from lightning_parallel.comm.modules import register_comm_hook
from lightning_parallel.compat import register_strategy
from lightning_parallel.strategies.base import ParallelStrategyBase

__all__ = ["HookedDDPStrategy", "PowerSGDDDPStrategy"]

CommHook = Callable[[Any, dist.GradBucket], torch.futures.Future[torch.Tensor]]


class HookedDDPStrategy(ParallelStrategyBase):
    """DDP with ``ddp_comm_hook`` registered on CPU as well as on CUDA, and its calls counted.

    Args:
        ddp_comm_hook: a DDP communication hook ``hook(state, bucket) -> Future[Tensor]``,
            e.g. ``torch.distributed.algorithms.ddp_comm_hooks.default_hooks.fp16_compress_hook``.
        ddp_comm_state: the state passed to the hook (``None`` for the default process group).
        ddp_comm_wrapper: optional wrapper of the hook (Lightning's argument, kept).
        compression_ratio: dense bytes over sent bytes of the hook, logged as the
            ``compression_ratio`` gauge when known (2.0 for float16).
        **kwargs: every other argument of Lightning's ``DDPStrategy`` (``start_method``,
            ``process_group_backend``, ``find_unused_parameters``, ...).

    Attributes:
        hook_calls: times the hook ran in this process (once per gradient bucket per step).
    """

    reports_communication = True

    def __init__(
        self,
        ddp_comm_hook: CommHook | None = None,
        ddp_comm_state: object | None = None,
        ddp_comm_wrapper: Callable[..., Any] | None = None,
        compression_ratio: float | None = None,
        **kwargs: Any,
    ) -> None:
        if ddp_comm_hook is None and type(self) is HookedDDPStrategy:
            raise ValueError(
                "HookedDDPStrategy needs a ddp_comm_hook; use strategy='ddp' for DDP without one"
            )
        if ddp_comm_hook is not None and not callable(ddp_comm_hook):
            raise TypeError(f"ddp_comm_hook must be callable, got {type(ddp_comm_hook).__name__}")
        # kept here, not handed to DDPStrategy: Lightning would register them on CUDA itself
        super().__init__(**kwargs)
        self.comm_hook = ddp_comm_hook
        self.comm_state = ddp_comm_state
        self.comm_wrapper = ddp_comm_wrapper
        self.compression_ratio = compression_ratio
        self.hook_calls = 0

    def make_comm_state(self) -> object | None:
        """The state passed to the hook, built once the process group exists."""
        return self.comm_state

    def make_comm_hook(self) -> CommHook:
        """The hook to register (subclasses may choose it from their options)."""
        assert self.comm_hook is not None
        return self.comm_hook

    def _counted(self, hook: CommHook) -> CommHook:
        # functools.wraps keeps the hook's name and signature: DDP checks both
        @functools.wraps(hook)
        def counted(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
            self.hook_calls += 1
            return hook(state, bucket)

        return counted

    @override
    def _register_ddp_hooks(self) -> None:
        assert isinstance(self.model, DistributedDataParallel)
        register_comm_hook(
            self.model,
            state=self.make_comm_state(),
            hook=self._counted(self.make_comm_hook()),
            wrapper=self.comm_wrapper,
        )
        if self.compression_ratio is not None:
            process_ledger().set_gauge("compression_ratio", self.compression_ratio)


class PowerSGDDDPStrategy(HookedDDPStrategy):
    """DDP with torch's PowerSGD gradient compression hook, on CPU too.

    Args:
        rank: rank r of the low-rank approximation (lower means more compression).
        start_powerSGD_iter: steps of plain allreduce before compression starts (>= 2: DDP
            rebuilds its buckets after the first step).
        min_compression_rate: compress a matrix only if (n·m) / ((n+m)·r) exceeds this.
        use_error_feedback: add the previous step's compression error to the gradient.
        warm_start: start each power iteration from the previous step's Q.
        random_seed: seed of the initial Q matrices (same on every rank).
        serialize_buckets: finish each bucket's collectives before the next bucket's start
            (``None``: only on the gloo backend, where out-of-order issue aborts; see above).
        **kwargs: arguments of Lightning's ``DDPStrategy``.
    """

    def __init__(
        self,
        rank: int = 2,
        start_powerSGD_iter: int = 2,
        min_compression_rate: float = 2.0,
        use_error_feedback: bool = True,
        warm_start: bool = True,
        random_seed: int = 0,
        serialize_buckets: bool | None = None,
        **kwargs: Any,
    ) -> None:
        if rank < 1:
            raise ValueError(f"rank must be a positive integer, got {rank}")
        if start_powerSGD_iter < 2 and (use_error_feedback or warm_start):
            raise ValueError(
                f"start_powerSGD_iter must be >= 2 with error feedback or warm start, got "
                f"{start_powerSGD_iter}: DDP rebuilds its buckets after the first step"
            )
        if min_compression_rate < 1:
            raise ValueError(f"min_compression_rate must be >= 1, got {min_compression_rate}")
        kwargs.pop("ddp_comm_hook", None)
        super().__init__(ddp_comm_hook=powerSGD_hook.powerSGD_hook, **kwargs)
        self.matrix_approximation_rank = rank
        self.start_powerSGD_iter = start_powerSGD_iter
        self.min_compression_rate = min_compression_rate
        self.use_error_feedback = use_error_feedback
        self.warm_start = warm_start
        self.random_seed = random_seed
        self.serialize_buckets = serialize_buckets

    @override
    def make_comm_hook(self) -> CommHook:
        hook = powerSGD_hook.powerSGD_hook
        serialize = self.serialize_buckets
        if serialize is None:
            serialize = dist.get_backend() == "gloo"
        if not serialize:
            return hook

        @functools.wraps(hook)
        def in_bucket_order(
            state: Any, bucket: dist.GradBucket
        ) -> torch.futures.Future[torch.Tensor]:
            future = hook(state, bucket)
            future.wait()
            return future

        return in_bucket_order

    @override
    def make_comm_state(self) -> object | None:
        return powerSGD_hook.PowerSGDState(
            process_group=None,
            matrix_approximation_rank=self.matrix_approximation_rank,
            start_powerSGD_iter=self.start_powerSGD_iter,
            min_compression_rate=self.min_compression_rate,
            use_error_feedback=self.use_error_feedback,
            warm_start=self.warm_start,
            random_seed=self.random_seed,
        )


register_strategy(
    "ddp_fp16",
    HookedDDPStrategy,
    "DDP with torch's fp16_compress_hook (half the gradient bytes), registered on CPU too",
    ddp_comm_hook=default_hooks.fp16_compress_hook,
    compression_ratio=2.0,
)
register_strategy(
    "ddp_powersgd",
    PowerSGDDDPStrategy,
    "DDP with torch's PowerSGD low-rank gradient compression hook (option rank)",
)
