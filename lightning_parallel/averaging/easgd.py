"""Synchronous elastic averaging (EASGD): replicas and a center variable pull on each other."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

import torch
from torch import Tensor

from lightning_parallel.averaging.averager import Averager, clone_all, move_all

__all__: list[str] = []


class ElasticAverager(Averager):
    """Pull every replica toward a center variable and the center toward the replicas (EASGD).

    Algorithm (center ``x̃``, ``M`` workers, every ``H`` local steps), by default
    (``center_first=True``):

    1. the center moves toward the workers: ``x̃ ← x̃ + β·(x̄ − x̃)``;
    2. each worker moves toward the new center: ``x_i ← x_i − α·(x_i − x̃)``.

    With ``center_first=False`` both steps use the values from before the round, the paper's
    simultaneous update, ``x̃ ← x̃ + α·Σ_i (x_i − x̃)`` with its ``β = M·α``. The elastic force
    lets the workers explore away from the center; the paper advises ``β = M·α ≈ 0.9``, which
    ``alpha=None`` gives (``α = β/M``). ``α = 1/M`` (``β = 1``) with the simultaneous update
    makes the center the periodic average of each round, ``x̃ ← x̄``; ``α = β = 1`` with
    ``center_first`` is periodic averaging exactly.
    Zhang, Choromanska, LeCun, "Deep learning with Elastic Averaging SGD", NeurIPS 2015.

    Why the center moves first by default: the simultaneous update pulls the workers back toward
    a center that has not yet taken the round's progress. If the workers' mean advances by ``d``
    per round, it keeps ``β/(α + β)`` of ``d`` at steady state, 2/3 at ``β = 0.9, α = 0.45``
    (``M = 2``), so training runs a third slower than periodic averaging; moving the center
    first keeps ``1 − α(1 − β)/(1 − (1 − α)(1 − β))``, 95% at the same values. On the bundled
    ``vgg_mini`` the simultaneous update ended 3 epochs below periodic averaging on all 5 seeds
    measured (7.6 points on average), the center-first update 18.9 points above it on average
    (docs/averaging_defaults.md, "The presets' outer steps").

    The center is also the one point every worker agrees on after a round (each computes it
    from the same mean), so it is where the loss rules of
    :class:`~lightning_parallel.averaging.ReplicaAveraging` roll every worker and the center back
    to on a regression (the mean loss back where training started); a spike is trained through.
    On ``vgg_mini`` (20 seeds) the regression's roll-back changed the four runs where one fired:
    seed 16 from 0.722 to 0.914 (``ddp``: 0.903), seed 11 from 0.956 to 0.931; rolling back on
    spikes too cost seeds 4 and 11 up to 17 points (docs/averaging_defaults.md, "EASGD goes back
    to its center on a regression").

    Args:
        alpha: the workers' moving rate ``α`` in ``(0, 1]``; ``None`` for ``β/M``.
        beta: the center's moving rate ``β`` in ``(0, 1]``.
        center_first: update the center before pulling the workers toward it (default);
            ``False`` for the paper's simultaneous update.
    """

    restarts_in_consensus: ClassVar[bool] = False  # each worker keeps part of its own replica
    keeps_agreed_point: ClassVar[bool] = True  # the center, the same on every worker

    def __init__(
        self, alpha: float | None = None, beta: float = 0.9, center_first: bool = True
    ) -> None:
        super().__init__()
        if alpha is not None and not 0.0 < alpha <= 1.0:
            raise ValueError(f"alpha must be in (0, 1], got {alpha}; use None for beta / M")
        if not 0.0 < beta <= 1.0:
            raise ValueError(f"beta must be in (0, 1], got {beta}; the paper uses 0.9")
        self.alpha_setting = alpha
        self.beta = float(beta)
        self.center_first = bool(center_first)
        self.center: list[Tensor] = []

    @property
    def alpha(self) -> float:
        """The workers' moving rate in use (``β/M`` unless set)."""
        if self.alpha_setting is not None:
            return self.alpha_setting
        if self.world_size is None:
            raise RuntimeError("ElasticAverager.reset() must run before its first round")
        return self.beta / self.world_size

    def reset(self, start: Sequence[Tensor], world_size: int) -> None:
        super().reset(start, world_size)
        self.center = clone_all(start)

    def agreed_point(self) -> list[Tensor] | None:
        """The center ``x̃``: identical on every worker after a round (each computes it from the
        same mean), so a regression's roll-back restarts every replica, and the center, from a
        kept one."""
        return self.center if self.started else None

    def mean_of_restarts(self, mean: Sequence[Tensor]) -> list[Tensor]:
        """The replicas' mean right after the next round, ``lerp(x̄, c, α)``, where ``c`` is the
        center the workers are pulled toward (the moved one when ``center_first``): the mean of
        ``x_i + α·(c − x_i)`` is ``x̄ + α·(c − x̄)``. A validation right after a round takes it
        instead of exchanging the replicas once more."""
        alpha = self.alpha
        restarts = []
        for center, average in zip(self.center, mean, strict=True):
            pull = torch.lerp(center, average, self.beta) if self.center_first else center
            restarts.append(torch.lerp(average, pull, alpha))
        return restarts

    def update(self, local: Sequence[Tensor], mean: Sequence[Tensor]) -> list[Tensor]:
        alpha = self.alpha
        restart = []
        for center, replica, average in zip(self.center, local, mean, strict=True):
            # lerp(a, b, w) = a + w·(b − a), and exactly b when w = 1.
            if self.center_first:
                center.lerp_(average, self.beta)
                restart.append(torch.lerp(replica, center, alpha))
            else:
                restart.append(torch.lerp(replica, center, alpha))
                center.lerp_(average, self.beta)
        return restart

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "center": clone_all(self.center)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.center = clone_all(state["center"])

    def to(self, device: torch.device) -> None:
        self.center = move_all(self.center, device)
