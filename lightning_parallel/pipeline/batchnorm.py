"""Deferred BatchNorm: running statistics over the whole mini-batch, not each micro-batch.

In a pipeline a BatchNorm layer sees one micro-batch at a time. A plain ``nn.BatchNorm*`` would
update its running mean and variance ``m`` times per step from ``N/m`` samples each, so the
statistics used at evaluation drift from those of mini-batch training. Deferred BatchNorm
(torchgpipe's ``DeferredBatchNorm``, Kim et al., 2020) fixes the running statistics:

1. forward in training: normalize the micro-batch with its own mean and variance (as any
   micro-batched pipeline must: the other micro-batches do not exist yet) and keep its count
   ``n_j``, mean ``μ_j`` and unbiased variance ``v_j``, which the normalization computes anyway
   (the kernel writes them into scratch running buffers at momentum 1; not during a recomputed
   forward): a few values per channel, no pass over the activations of its own;
2. at the end of the step (:func:`commit_deferred_batch_norm`) merge them in float64 around
   their common mean (Chan et al.'s pairwise rule, summed: ``n = Σn_j``, ``μ = Σn_jμ_j/n``,
   ``M₂ = Σ(n_j−1)v_j + n_j(μ_j−μ)²``, free of the cancellation of ``Σx² − nμ²`` in the
   micro-batch statistics' precision) into ``n``, ``Σx = nμ`` and ``Σx² = M₂ + nμ²``; optionally
   allreduce those across data-parallel replicas, so that the mini-batch is the global one, then
   ``μ = Σx/n``, ``σ² = (Σx² − nμ²)/(n−1)`` (float64) and one update
   ``running ← (1−α)·running + α·stat`` with ``α = momentum`` (or ``1/num_batches_tracked``
   when ``momentum=None``), exactly what ``nn.BatchNorm`` does for one batch of ``n`` samples.

In evaluation mode it is a plain BatchNorm over the running statistics. Conversion keeps the
parameter and buffer tensors (and so the ``state_dict`` keys) of the original layers, and
:func:`restore_batch_norm` puts the original modules back.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from lightning_parallel.comm.devices import to_group
from lightning_parallel.pipeline.ownership import adopt_tensors
from lightning_parallel.pipeline.recompute import is_recomputing

__all__: list[str] = []


class DeferredBatchNorm(_BatchNorm):
    """BatchNorm whose running statistics are updated once per step from all micro-batches.

    Build it with :meth:`from_batch_norm` (or :func:`convert_deferred_batch_norm`); it shares
    the weight, bias and running buffers of the layer it replaces.
    """

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float | None = 0.1) -> None:
        super().__init__(num_features, eps, momentum, affine=True, track_running_stats=True)
        # per micro-batch of the step: (count, mean, unbiased variance), each per channel
        self._micro_batches: list[tuple[int, torch.Tensor, torch.Tensor]] = []

    @classmethod
    def from_batch_norm(cls, source: _BatchNorm) -> DeferredBatchNorm:
        """A deferred layer sharing ``source``'s parameters and buffers."""
        layer = cls(source.num_features, source.eps, source.momentum)
        layer.affine = source.affine
        layer.weight = source.weight
        layer.bias = source.bias
        layer.running_mean = source.running_mean
        layer.running_var = source.running_var
        layer.num_batches_tracked = source.num_batches_tracked
        layer.train(source.training)
        return layer

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"DeferredBatchNorm expects at least 2-D input, got {input.dim()}-D")

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(input)
        if not self.training or self.running_mean is None:
            return super().forward(input)
        if is_recomputing():  # counted at its first forward; momentum 0: no running update
            return F.batch_norm(input, None, None, self.weight, self.bias, True, 0.0, self.eps)
        # normalize with this micro-batch's statistics; at momentum 1 the kernel leaves them in
        # the scratch buffers (the mean, and the unbiased variance)
        mean, variance = torch.zeros_like(self.running_mean), torch.ones_like(self.running_mean)
        output = F.batch_norm(input, mean, variance, self.weight, self.bias, True, 1.0, self.eps)
        self._micro_batches.append((input.numel() // input.size(1), mean, variance))
        return output

    def discard(self) -> None:
        """Forget the statistics of forwards run so far (ones outside a training step: the
        partitioner's profiling or estimation)."""
        self._micro_batches.clear()

    @torch.no_grad()
    def accumulators(self) -> torch.Tensor:
        """``[count, Σx (C values), Σx² (C values)]`` of this step, as one float64 vector."""
        features = self.num_features
        device = self.running_mean.device if self.running_mean is not None else None
        if not self._micro_batches:
            return torch.zeros(1 + 2 * features, dtype=torch.float64, device=device)
        counts = torch.tensor(
            [[float(count)] for count, _, _ in self._micro_batches],
            dtype=torch.float64,
            device=device,
        )  # (m, 1)
        means = torch.stack([mean for _, mean, _ in self._micro_batches]).double()  # (m, C)
        variances = torch.stack([var for _, _, var in self._micro_batches]).double()  # (m, C)
        total = counts.sum()
        mean = (counts * means).sum(0) / total
        spread = ((counts - 1) * variances + counts * (means - mean).square()).sum(0)
        return torch.cat([total.reshape(1), total * mean, spread + total * mean.square()])

    @torch.no_grad()
    def commit(self, accumulators: torch.Tensor | None = None) -> None:
        """Update the running statistics from this step's (possibly reduced) accumulators."""
        values = self.accumulators() if accumulators is None else accumulators
        self._micro_batches.clear()
        count = float(values[0])
        if count < 2 or self.running_mean is None or self.running_var is None:
            return
        features = self.num_features
        mean = values[1 : 1 + features] / count
        variance = (values[1 + features :] - count * mean * mean) / (count - 1)
        assert self.num_batches_tracked is not None
        self.num_batches_tracked.add_(1)
        factor = (
            1.0 / float(self.num_batches_tracked) if self.momentum is None else float(self.momentum)
        )
        self.running_mean.mul_(1 - factor).add_(mean.to(self.running_mean.dtype), alpha=factor)
        self.running_var.mul_(1 - factor).add_(variance.to(self.running_var.dtype), alpha=factor)


def convert_deferred_batch_norm(module: nn.Module) -> dict[str, _BatchNorm]:
    """Replace every BatchNorm inside ``module`` by a :class:`DeferredBatchNorm`, in place.

    Returns:
        The replaced layers by qualified name, for :func:`restore_batch_norm`.
    """
    replaced: dict[str, _BatchNorm] = {}
    for name, child in list(module.named_modules()):
        if not isinstance(child, _BatchNorm) or isinstance(child, DeferredBatchNorm):
            continue
        if not child.track_running_stats:
            continue  # no running statistics to defer: normalization is per micro-batch anyway
        if name == "":
            raise ValueError("convert_deferred_batch_norm needs a module that contains BatchNorm")
        parent_name, _, attribute = name.rpartition(".")
        parent = module.get_submodule(parent_name)
        setattr(parent, attribute, DeferredBatchNorm.from_batch_norm(child))
        replaced[name] = child
    return replaced


def restore_batch_norm(module: nn.Module, replaced: dict[str, _BatchNorm]) -> None:
    """Put back the layers :func:`convert_deferred_batch_norm` replaced, with the tensors the
    replacements hold now (shared during training; a pipeline may have replaced them)."""
    for name, original in replaced.items():
        parent_name, _, attribute = name.rpartition(".")
        parent = module.get_submodule(parent_name)
        current = getattr(parent, attribute)
        adopt_tensors(original, current)
        original.train(current.training)
        setattr(parent, attribute, original)


def deferred_layers(module: nn.Module) -> list[DeferredBatchNorm]:
    """The deferred BatchNorm layers inside ``module``, in module order."""
    return [child for child in module.modules() if isinstance(child, DeferredBatchNorm)]


class BatchNormCommit:
    """The end of a step for every deferred BatchNorm of a module, started asynchronously.

    Args:
        module: a stage (or any module) holding :class:`DeferredBatchNorm` layers.
        group: the data-parallel group whose replicas together form the mini-batch.
        reduce: allreduce the accumulators over ``group`` (one flat float64 tensor for all
            layers) before updating, so that every replica commits the same global statistics.
    """

    def __init__(
        self, module: nn.Module, group: dist.ProcessGroup | None = None, reduce: bool = False
    ) -> None:
        self.layers = deferred_layers(module)
        self.pieces = [layer.accumulators() for layer in self.layers]
        self.flat: torch.Tensor | None = None
        self.work: dist.Work | None = None
        if reduce and self.layers:
            # on the layers' device, the group's (comm.devices): no copy over NCCL
            self.flat = to_group(torch.cat(self.pieces), group)
            self.work = dist.all_reduce(self.flat, group=group, async_op=True)

    def finish(self) -> None:
        """Wait for the reduction (if any) and update every layer's running statistics."""
        if self.work is not None:
            self.work.wait()
        offset = 0
        for layer, piece in zip(self.layers, self.pieces):
            values = piece if self.flat is None else self.flat[offset : offset + piece.numel()]
            layer.commit(values)
            offset += piece.numel()
        self.layers, self.work = [], None


def commit_deferred_batch_norm(
    module: nn.Module, group: dist.ProcessGroup | None = None, reduce: bool = False
) -> None:
    """End the step of every deferred BatchNorm of ``module`` (see :class:`BatchNormCommit`)."""
    BatchNormCommit(module, group, reduce).finish()
