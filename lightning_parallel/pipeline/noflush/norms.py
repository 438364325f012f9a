"""The norm of each update's gradient over all stages of a no-flush pipeline, without waiting.

Gradient clipping by norm needs the norm of the whole model's gradient, but in a pipeline that
never flushes (:mod:`~.runtime`) the stages apply the same update at different times: the exact
global norm of update j is only known once stage 0 has back-propagated the units of update j,
after every other stage applied it, and a blocking allreduce across stages that are at different
updates would deadlock. :class:`GlobalNormEstimate` estimates it instead, per update, on every
stage:

1. stage k adds its own squared norm to the suffix received from stage k+1 (sent with the
   update, exact) and sends the sum to stage k-1;
2. stage 0's suffix is the exact total; it travels forward with every activation;
3. stage k estimates the upstream part by that of the newest update v whose total it knows:
   ``prefix ≈ total(v) - suffix_k(v)``. Exact on stage 0 and with one stage.

The norms are host values: they travel on the transport's bookkeeping group (gloo).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from torch import nn

from lightning_parallel.pipeline.transport import StageTransport

__all__: list[str] = []

_NORM_BACKWARD_TAG = 21  # squared gradient norm of stages k..N-1, to stage k-1
_NORM_FORWARD_TAG = 22  # newest exact total squared norm, from stage 0 forward


class GlobalNormEstimate:
    """One stage's estimate of the gradient norm over all stages (see the module docstring).

    The runtime calls :meth:`exchange` once per update, after the gradient is final (averaged
    across replicas) and before clipping, :meth:`send_total` after every activation it sends and
    :meth:`receive_total` after every activation it receives.

    Args:
        stage: this stage's index k (0-based).
        stages: the number of stages N.
        transport: point-to-point link to the neighbouring stages (None when ``stages == 1``).
    """

    def __init__(self, stage: int, stages: int, transport: StageTransport | None) -> None:
        self.stage = stage
        self.stages = stages
        self.transport = transport
        self.global_norm = math.nan  # estimate for the update being applied
        self.history: list[tuple[float, float]] = []  # (own squared, estimated squared)
        self._suffix: dict[int, float] = {}  # update -> squared norm over stages k..N-1
        self._newest_total: tuple[int, float] = (-1, 0.0)  # exact over all stages, from stage 0

    @property
    def first(self) -> bool:
        return self.stage == 0

    @property
    def last(self) -> bool:
        return self.stage == self.stages - 1

    def exchange(self, update: int, parameters: Sequence[nn.Parameter]) -> None:
        """Estimate the norm of update ``update``'s gradient (this stage's share: the gradients
        of ``parameters``) over all stages; sets :attr:`global_norm`."""
        assert self.transport is not None or self.stages == 1
        own = float(
            sum(float(p.grad.double().pow(2).sum()) for p in parameters if p.grad is not None)
        )
        downstream = 0.0
        if not self.last:
            assert self.transport is not None
            (downstream,) = self.transport.recv_values(
                1, self.transport.next_rank, _NORM_BACKWARD_TAG
            )
        suffix = own + downstream
        if not self.first:
            assert self.transport is not None
            self.transport.send_values([suffix], self.transport.previous_rank, _NORM_BACKWARD_TAG)
        self._suffix[update] = suffix
        if self.first:
            self._newest_total = (update, suffix)
        newest, total = self._newest_total
        prefix = max(total - self._suffix[newest], 0.0) if newest in self._suffix else 0.0
        estimate = suffix + prefix
        self.global_norm = math.sqrt(estimate)
        self.history.append((own, estimate))
        for old in [key for key in self._suffix if key < newest]:
            del self._suffix[old]

    def send_total(self) -> None:
        """Send the newest exact total this stage knows to the next stage."""
        assert self.transport is not None
        newest, total = self._newest_total
        self.transport.send_values(
            [float(newest), total], self.transport.next_rank, _NORM_FORWARD_TAG
        )

    def receive_total(self) -> None:
        """Receive the previous stage's newest exact total; keep it if it is newer."""
        assert self.transport is not None
        newest, total = self.transport.recv_values(
            2, self.transport.previous_rank, _NORM_FORWARD_TAG
        )
        if int(newest) > self._newest_total[0]:
            self._newest_total = (int(newest), float(total))
