"""One server update: a group of pending gradients in, at most one optimizer step out.

:class:`ShardUpdater` holds a shard's parameters as one flat CPU vector: the optimizer (the
user's class and hyperparameters) works on views of it with the original shapes, whose
``.grad`` are views of one flat gradient. The
:class:`~lightning_parallel.parameter_server.server.ShardServer` decides when the oldest pending
gradients form a group (its message loop, with :meth:`UpdatePolicy.group_size`: n-softsync and
SSP) and counts versions; the updater applies a group under the policy's rules (Zhang et al.
2016; Zheng et al. 2017). For a group at version v:

1. each gradient gets staleness τ = v − read (the version its worker read), recorded in the
   shard's :class:`~lightning_parallel.parameter_server.telemetry.ServerStatistics`;
2. gradients with τ above the drop bound are discarded;
3. the others are delay-compensated (DC-ASGD, g + λ·g⊙g⊙(w_v − w_read)), with the exact
   weights each worker read;
4. they are combined in order of worker rank (a fixed summation order: reproducible sums) as
   ĝ = Σ f(τ_i)·g_i / Σ f(τ_i) (a lone gradient is copied as it is);
5. the optimizer steps once with the learning rate η·mean f(τ_i)·``lr_scale``: the user's
   current hyperparameters are copied in first (``before_update``), and the learning rate is
   restored after the step. For SGD every gradient moves the weights by −η·f(τ_i)·g_i/|group|.

A group whose gradients are all dropped changes nothing: no step, the version stays.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor
from torch.optim import Optimizer

from lightning_parallel.parameter_server.policies import UpdatePolicy
from lightning_parallel.parameter_server.telemetry import ServerStatistics

__all__: list[str] = []


@dataclass
class PendingGradient:
    """A gradient waiting at the server for its group, with what it was computed on."""

    worker: int
    read_version: int
    gradient: Tensor
    drain: bool
    weights_read: Tensor | None = None  # the weights the gradient was computed on (DC-ASGD)
    answered: bool = False  # its worker already got weights back (n-softsync, no waiting)


class ShardUpdater:
    """A shard's flat weights and optimizer, and the update of a group of gradients.

    Args:
        parameters: the shard's initial parameters (copied into one flat CPU vector).
        make_optimizer: builds the shard's optimizer over the list of parameter tensors it is
            given (views of the flat vector, with the original shapes).
        policy: the update rules.
        statistics: the shard's counters, which every update records into.
        before_update: called with the optimizer before every step (see
            :class:`~lightning_parallel.parameter_server.server.ShardServer`).
    """

    def __init__(
        self,
        parameters: Sequence[Tensor],
        make_optimizer: Callable[[list[Tensor]], Optimizer],
        policy: UpdatePolicy,
        statistics: ServerStatistics,
        before_update: Callable[[Optimizer], None] | None = None,
    ) -> None:
        if not parameters:
            raise ValueError("a shard needs at least one parameter")
        dtypes = {parameter.dtype for parameter in parameters}
        if len(dtypes) != 1:
            raise ValueError(
                f"a shard's parameters must share one dtype, got {sorted(map(str, dtypes))}; "
                "cast the model to one dtype"
            )
        self.policy = policy
        self.statistics = statistics
        self._before_update = before_update
        with torch.no_grad():
            self.weights = torch.cat([p.detach().reshape(-1).cpu() for p in parameters]).clone()
        self.gradient = torch.zeros_like(self.weights)
        self.parameters: list[Tensor] = []
        offset = 0
        for parameter in parameters:
            numel = parameter.numel()
            view = self.weights[offset : offset + numel].view(parameter.shape)
            view.grad = self.gradient[offset : offset + numel].view(parameter.shape)
            self.parameters.append(view)
            offset += numel
        self.optimizer = make_optimizer(self.parameters)

    def apply(
        self, group: Sequence[PendingGradient], version: int
    ) -> tuple[list[tuple[int, bool]], bool]:
        """Steps 1-5 for ``group`` at server version ``version``.

        Returns:
            each gradient's ``(staleness, dropped)``, in the group's order, and whether the
            optimizer stepped (some gradient was kept: the version is to advance).
        """
        fates: list[tuple[int, bool]] = []
        kept: list[tuple[int, float, Tensor]] = []
        for pending in group:
            staleness = version - pending.read_version
            self.statistics.record(pending.worker, staleness)
            if not self.policy.keeps(staleness):
                fates.append((staleness, True))
                self.statistics.dropped += 1
                continue
            fates.append((staleness, False))
            gradient = pending.gradient
            if self.policy.delay_compensation and pending.weights_read is not None:
                gradient = self.policy.compensate(gradient, self.weights, pending.weights_read)
            kept.append((pending.worker, self.policy.factor(staleness), gradient))
        self.statistics.record_group(len(group))
        if not kept:
            return fates, False
        kept.sort(key=lambda item: item[0])  # a fixed summation order: reproducible sums
        total = sum(factor for _, factor, _ in kept)
        with torch.no_grad():
            if len(kept) == 1:
                self.gradient.copy_(kept[0][2])
            else:
                self.gradient.zero_()
                for _, factor, gradient in kept:
                    self.gradient.add_(gradient, alpha=factor)
                self.gradient.div_(total)
        self.step(total / len(kept) * self.policy.lr_scale)
        self.statistics.applied += len(kept)
        self.statistics.updates += 1
        return fates, True

    def step(self, learning_rate_scale: float) -> None:
        """One optimizer step on the flat gradient, the learning rate scaled for it alone."""
        if self._before_update is not None:
            self._before_update(self.optimizer)
        saved = [group["lr"] for group in self.optimizer.param_groups]
        if learning_rate_scale != 1.0:
            for group in self.optimizer.param_groups:
                group["lr"] = group["lr"] * learning_rate_scale
        try:
            self.optimizer.step()
        finally:
            for group, learning_rate in zip(self.optimizer.param_groups, saved):
                group["lr"] = learning_rate
