"""Local trials of a layer's candidate codecs, for the cost model's choice between them.

On the hook's calibration steps, a layer with several candidates (a fully-connected layer's
low-rank factors and 2-bit codes, a convolution's kernel top-k and low-rank factors) has each
tried on this rank's compensated gradient ``p = g + e``, beside the real exchange and without
changing it: encode and decode seconds, the bytes the candidate's exchange would send, and the
relative error ``|p - C(p)| / |p|`` of one step. The
:class:`~lightning_parallel.compression.CostModel` keeps the cheapest within the error budget.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from lightning_parallel.comm.accounting import ring_allreduce_bytes
from lightning_parallel.compression.cost_model import CostModel
from lightning_parallel.compression.error_feedback import ErrorFeedback
from lightning_parallel.compression.exchange_step import LayerGradient, device_sync
from lightning_parallel.compression.low_rank import LowRank
from lightning_parallel.compression.policy import LOW_RANK, HyloPolicy, LayerPlan

__all__: list[str] = []


def try_candidates(
    layer: LayerGradient,
    candidates: list[LayerPlan],
    memory: ErrorFeedback,
    cost_model: CostModel,
    world: int,
) -> None:
    """Time each of ``candidates`` on ``layer``'s ``p`` and feed the cost model."""
    name = layer.plan.name
    p = memory.compensate(name, layer.gradient)  # a copy: the residual is left as it is
    norm = float(p.norm())
    dense = ring_allreduce_bytes(p.numel() * p.element_size(), world)
    sync = device_sync(p)  # time the device's work, not the launches
    for candidate in candidates:
        residual = p.clone()
        decoded = torch.zeros_like(p)
        codec = candidate.codec
        shaped = residual.view(candidate.shape)
        sync()
        started = time.perf_counter()
        # the low-rank trial starts from the layer's warm start, as its exchange does
        encoded = _encode_(codec, shaped, name)
        codec.decode_add_(encoded, decoded)
        sync()
        seconds = time.perf_counter() - started
        error = float(residual.norm()) / norm if norm > 0 else 0.0
        sent = ring_allreduce_bytes(codec.wire_nbytes(candidate.shape), world)
        cost_model.observe_codec(name, seconds, dense, sent, candidate.route, error)


def first_trial_errors(
    gradients: Mapping[str, Tensor], policy: HyloPolicy
) -> dict[str, dict[str, float]]:
    """Each candidate's relative error ``|g - C(g)| / |g|`` on each gradient whose layer has
    several candidates under ``policy``, by parameter name and :func:`error_key`: what the
    cost model compares with its error budget, as the first calibration step finds it (no
    residual yet; each codec a fresh copy, so a low-rank trial starts from its fixed random
    factor). The plan takes it to predict which candidate a layer keeps."""
    errors: dict[str, dict[str, float]] = {}
    for name, gradient in gradients.items():
        candidates = policy.candidates(name, gradient.shape)
        norm = float(gradient.norm())
        if len(candidates) < 2 or norm == 0.0:
            continue
        errors[name] = {}
        for candidate in candidates:
            codec = copy.deepcopy(candidate.codec)
            residual = gradient.detach().clone()
            shaped = residual.view(candidate.shape)
            _encode_(codec, shaped, name)
            errors[name][error_key(candidate)] = float(residual.norm()) / norm
    return errors


def _encode_(codec: Any, shaped: Tensor, name: str) -> Any:
    """``codec``'s encoding of ``shaped`` in place (the residual left there); a low-rank codec
    starts from the layer ``name``'s warm start, as its exchange does."""
    return codec.encode_(shaped, key=name) if isinstance(codec, LowRank) else codec.encode_(shaped)


def error_key(candidate: LayerPlan) -> str:
    """A candidate's key among a layer's trial errors: its route, with the rank for low-rank
    factors (``"low_rank@8"``), whose error depends on it."""
    if candidate.route == LOW_RANK and isinstance(candidate.codec, LowRank):
        return f"{LOW_RANK}@{candidate.codec.rank}"
    return candidate.route
