"""Hylo under model averaging: each round averages the compressed model delta, not the model.

Model averaging sends whole models every ``period`` steps. With compression, what is sent is
the change since the last agreed point, which error feedback can carry across rounds:

1. when local training begins, every rank holds the same parameters: they become the anchor
   ``a`` (identical on every rank);
2. at a round, rank ``i`` forms its delta ``d_i = x_i - a`` (all parameters, flat, in order)
   and averages it through the :class:`~lightning_parallel.compression.HyloHook`'s exchange,
   exactly as it averages a DDP bucket of gradients: kernel top-k for convolutions, two-phase
   2-bit codes for fully-connected weights, dense for small layers, with per-parameter residuals
   (``d_i + e_i`` is what gets compressed; what is not sent stays in ``e_i``);
3. the mean is ``a + mean(d)``, identical on every rank; it is the averager's ``mean`` input
   (periodic averaging restarts from it, BMUF and EASGD use it as their global model) and the
   next round's anchor.

With every layer uncompressed the result is the exact mean, as plain model averaging.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from lightning_parallel.compression.hook import HyloHook

__all__: list[str] = []


class CompressedDeltaMean:
    """Average replicas' parameters through a Hylo exchange of their delta from a shared anchor.

    Args:
        hook: the Hylo state (policy, residuals, cost model) built over the module's
            ``named_parameters()``; its warm-up and calibration count rounds here.
        parameters: the trainable parameters in the order the averaging passes them.
    """

    def __init__(self, hook: HyloHook, parameters: Sequence[Tensor]) -> None:
        self.hook = hook
        self.parameters = list(parameters)
        self.anchor: list[Tensor] | None = None

    def reset(self, start: Sequence[Tensor]) -> None:
        """Take the agreed parameters ``start`` as the anchor (every rank the same)."""
        self.anchor = [tensor.detach().clone() for tensor in start]

    def __call__(self, local: Sequence[Tensor]) -> list[Tensor]:
        """The mean over ranks of ``local`` (collective), through the compressed delta."""
        if self.anchor is None:
            raise RuntimeError(
                "CompressedDeltaMean has no anchor: call reset() with the agreed parameters "
                "before the first round"
            )
        if [t.shape for t in local] != [a.shape for a in self.anchor]:
            raise ValueError("the parameters changed shape since the anchor was taken")
        with torch.no_grad():
            delta = torch.cat(
                [(x.detach() - a).reshape(-1) for x, a in zip(local, self.anchor, strict=True)]
            )
            self.hook.average_flat(delta, self.parameters)
            means, offset = [], 0
            for anchor in self.anchor:
                numel = anchor.numel()
                means.append(anchor + delta[offset : offset + numel].view_as(anchor))
                offset += numel
        self.anchor = [mean.clone() for mean in means]
        return means

    def state_dict(self) -> dict[str, Any]:
        """The anchor (identical on every rank); the residuals are the hook's."""
        return {"anchor": [a.clone() for a in self.anchor] if self.anchor is not None else None}

    def load_state_dict(self, state: dict[str, Any], device: torch.device | None = None) -> None:
        """Restore :meth:`state_dict`."""
        anchor = state.get("anchor")
        self.anchor = [a.to(device) if device else a.clone() for a in anchor] if anchor else None
