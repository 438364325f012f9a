"""Turn on Hylo layer-wise gradient compression for any DDP-based strategy, on CPU and CUDA.

Lightning registers ``ddp_comm_hook`` only on CUDA and silently drops it on CPU. This callback
does not go through that path: once the strategy has wrapped the model in
``DistributedDataParallel`` (``on_fit_start``, before the first backward) it registers the
:class:`~lightning_parallel.compression.HyloHook` on the DDP module itself, so it runs with
gloo and NCCL alike, under ``ddp``, ``ddp_spawn``, ``ddp_fork`` and every DDP subclass.

Supported: every strategy whose ``trainer.strategy.model`` is a ``DistributedDataParallel``
module with no other communication hook, and model averaging (``model_averaging``,
``local_sgd``, ``bmuf``, ``easgd``, ``diloco``), where each round's model delta is compressed
instead (:class:`~lightning_parallel.compression.delta.CompressedDeltaMean`). Not supported (a
clear error): single-device runs, FSDP, DeepSpeed, strategies that already registered a hook.

Example::

    trainer = Trainer(strategy="ddp", callbacks=[HyloCompression(conv_rate=0.05)])
"""

from __future__ import annotations

import logging
from typing import Any, ClassVar, Literal

import pytorch_lightning as pl
import torch
import torch.distributed as dist
from pytorch_lightning.callbacks import Callback
from pytorch_lightning.utilities.rank_zero import rank_zero_warn
from torch.nn.parallel import DistributedDataParallel

from lightning_parallel.averaging.policies import trainable_parameters
from lightning_parallel.averaging.replicas import ReplicaAveraging
from lightning_parallel.averaging.survivor_reduction import SurvivorAllReduce
from lightning_parallel.comm.ledger import process_ledger
from lightning_parallel.compat import check
from lightning_parallel.compat.private import state_key as compat_state_key
from lightning_parallel.compression import CostModel, HyloHook, HyloPolicy
from lightning_parallel.compression.calibration import CALIBRATION_STEPS
from lightning_parallel.compression.delta import CompressedDeltaMean
from lightning_parallel.compression.exchange import TWO_BIT_EXCHANGES, check_piece_numel
from lightning_parallel.compression.policy import (
    ERROR_BUDGET,
    LOW_RANK_MIN_NUMEL,
    MIN_COMPRESS_NUMEL,
    RANK,
)

__all__: list[str] = []

log = logging.getLogger(__name__)


class HyloCompression(Callback):
    """Compress DDP gradients layer by layer: conv kernels top-k, FC 2-bit, small layers dense.

    Algorithm per optimizer step (after ``warmup_steps`` uncompressed steps), per layer (see
    :mod:`lightning_parallel.compression` and ``docs/hylo.md``):

    1. convolution weights: the ``k`` kernels of largest gradient norm, ``k`` a rate that
       falls with the layer's size (``conv_rate`` at 65536 parameters), chosen globally from
       allreduced per-kernel norms and allreduced densely; or rank-``rank`` factors ``P, Q``
       (one power-iteration step with warm start, each factor allreduced);
    2. fully-connected weights: the same factors, or 2-bit codes ``{+s, -s, 0}`` for the
       values above ``tau = threshold_factor * mean|g|`` (``s`` their mean magnitude, per block
       of ``block_size`` values, 16 codes per 32-bit word, a two-phase compressed allreduce);
       the cost model keeps, per layer, the candidate of least measured cost within
       ``error_budget``;
    3. parameters of fewer than ``min_compress_numel`` values: one fused dense allreduce;
    4. what is not sent is kept per parameter (error feedback) and added next step;
    5. a cost model, calibrated on the first compressed steps, sends a layer uncompressed from
       then on when encoding and decoding cost more time than the transfer saves.

    Args:
        codec: ``"hylo"``, or a peer codec for comparison (``"topk"``, ``"qsgd"``,
            ``"terngrad"``, ``"signsgd"``), or ``"none"`` (plain DDP through the hook).
        conv_rate: fraction of kernels sent by a convolution of 65536 parameters (higher =>
            less compression).
        fc_bits: 2 (quantize fully-connected weights) or 32 (leave them uncompressed).
        threshold_factor: 2-bit threshold in units of the mean absolute gradient.
        min_compress_numel: parameters with fewer values are sent uncompressed.
        warmup_steps: optimizer steps averaged uncompressed first.
        exchange: ``"auto"`` (default: ``"allgather"`` with 2 ranks, where it sends the same
            bytes as the two-phase exchange and quantizes once instead of twice;
            ``"two_phase"`` with more), ``"two_phase"`` (bytes per rank flat in the world size)
            or ``"allgather"``.
        cost_model: decide per layer whether compression pays, after ``calibration_steps``
            compressed steps.
        bandwidth: link bandwidth in bits per second for the cost model (``None``: measured
            on the compressed exchanges, bytes sent over seconds waited).
        calibration_steps: first compressed steps on which the cost model measures.
        per_layer_telemetry: publish per-layer gauges (bytes, compression ratio,
            encode/decode ms, residual norm) besides the totals.
        telemetry_every_n_steps: how often the gauges (and residual norms) are refreshed.
        seed: seed of the stochastic peer codecs (rank ``r`` uses ``seed + r``).
        overlap: run the exchange on a background thread that overlaps with the rest of the
            backward pass (``None``: on CPU yes, on CUDA no; ``True`` on CUDA raises).
        reconstruction: what 2-bit codes decode to: ``"mean"`` (the mean magnitude of the
            values sent, default) or ``"threshold"`` (``tau``, Hylo's literal ``{+tau, -tau, 0}``).
        block_size: values per 2-bit block, each with its own threshold and scale (default
            512: 1.6% more bytes than one scale per tensor); ``None``: one per tensor.
        piece_numel: values per pipelined piece of a large 2-bit layer: it is encoded, sent
            and decoded piece by piece (allgather and two-phase alike), so that the link
            carries one piece while the next is encoded; ``None``: one message per bucket;
            ``"auto"`` (default): 524288 (128 KiB of codes) for CPU gradients, ``None`` for
            CUDA ones (pieces lost more than they gained there: ``docs/gpu.md``).
        policy: a ready :class:`~lightning_parallel.compression.HyloPolicy`; overrides
            ``codec``, ``conv_rate``, ``fc_bits``, ``threshold_factor``, ``min_compress_numel``,
            ``reconstruction``, ``block_size``, ``rank``, ``error_budget``.
        rank: rank of the low-rank (PowerSGD-style) candidate (``None``: none; kernel top-k
            and 2-bit codes only).
        error_budget: the largest measured relative error ``|p - C(p)| / |p|`` of the
            candidate codec the cost model keeps per layer (the cheapest within it wins).
        conv_low_rank: convolutions get the low-rank candidate too, beside kernel top-k.
        low_rank_min_numel: parameters with at least this many values have the low-rank
            candidate.

    Attributes:
        hook: the :class:`~lightning_parallel.compression.HyloHook` once the fit started.
    """

    #: the hook communicates through Python collectives (counted by ``CommStats``), not DDP's
    #: C++ reducer: ``CommStats`` adds no estimate of DDP's gradient bytes on top
    reports_communication: ClassVar[bool] = True

    def __init__(
        self,
        codec: str = "hylo",
        conv_rate: float = 0.05,
        fc_bits: int = 2,
        threshold_factor: float = 1.0,
        min_compress_numel: int = MIN_COMPRESS_NUMEL,
        warmup_steps: int = 0,
        exchange: str = "auto",
        cost_model: bool = True,
        bandwidth: float | None = None,
        calibration_steps: int = CALIBRATION_STEPS,
        per_layer_telemetry: bool = True,
        telemetry_every_n_steps: int = 10,
        seed: int = 0,
        overlap: bool | None = None,
        reconstruction: str = "mean",
        block_size: int | None = 512,
        piece_numel: int | Literal["auto"] | None = "auto",
        policy: HyloPolicy | None = None,
        rank: int | None = RANK,
        error_budget: float = ERROR_BUDGET,
        conv_low_rank: bool = True,
        low_rank_min_numel: int = LOW_RANK_MIN_NUMEL,
    ) -> None:
        check(self)  # this Lightning has every private name we use (compat.private)
        if exchange not in TWO_BIT_EXCHANGES:
            raise ValueError(f"exchange must be one of {TWO_BIT_EXCHANGES}, got {exchange!r}")
        check_piece_numel(piece_numel)
        if warmup_steps < 0:
            raise ValueError(f"warmup_steps must be >= 0, got {warmup_steps}")
        if cost_model and calibration_steps < 1:
            raise ValueError(
                "the cost model measures on the first calibration_steps compressed steps: "
                f"calibration_steps must be >= 1, got {calibration_steps}; raise it or pass "
                "cost_model=False"
            )
        if telemetry_every_n_steps < 1:
            raise ValueError(
                f"telemetry_every_n_steps must be a positive value, got {telemetry_every_n_steps}"
            )
        self.policy = policy or HyloPolicy(
            codec=codec,
            conv_rate=conv_rate,
            fc_bits=fc_bits,
            threshold_factor=threshold_factor,
            min_compress_numel=min_compress_numel,
            reconstruction=reconstruction,
            block_size=block_size,
            rank=rank,
            error_budget=error_budget,
            conv_low_rank=conv_low_rank,
            low_rank_min_numel=low_rank_min_numel,
        )
        self.warmup_steps = warmup_steps
        self.exchange = exchange
        self.use_cost_model = cost_model
        if bandwidth is not None and not bandwidth > 0:
            raise ValueError(
                f"bandwidth is the link rate in bits per second and must be > 0, got "
                f"{bandwidth!r}; leave it None to have the cost model measure the link"
            )
        self.bandwidth = bandwidth
        self.calibration_steps = calibration_steps
        self.per_layer_telemetry = per_layer_telemetry
        self.telemetry_every_n_steps = telemetry_every_n_steps
        self.seed = seed
        self.overlap = overlap
        self.piece_numel = piece_numel
        self.hook: HyloHook | None = None
        self.delta_mean: CompressedDeltaMean | None = None
        self._pending_state: dict[str, Any] | None = None
        self._pending_anchor: dict[str, Any] | None = None

    @property
    def state_key(self) -> str:
        return compat_state_key(self, codec=self.policy.codec_name)

    @property
    def hook_calls(self) -> int:
        """Times DDP called the hook on this rank (one per bucket per optimizer step)."""
        return self.hook.calls if self.hook is not None else 0

    # -- attach ---------------------------------------------------------------------------

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        ddp = trainer.strategy.model
        averaging = getattr(trainer.strategy, "averaging", None)
        if isinstance(averaging, ReplicaAveraging):
            module: torch.nn.Module = pl_module
            group = None
        elif isinstance(ddp, DistributedDataParallel):
            module, group = ddp.module, ddp.process_group
        else:
            raise RuntimeError(
                "HyloCompression compresses DistributedDataParallel gradients or model-averaging "
                f"rounds, but the strategy {type(trainer.strategy).__name__} does neither: use "
                'strategy="ddp" (or "ddp_spawn", "hylo", any DDP-based strategy, or a model-'
                "averaging strategy) with at least 2 processes, or remove the callback"
            )
        previous = self.hook.state_dict() if self.hook is not None else None
        bandwidth = self.bandwidth / 8.0 if self.bandwidth is not None else None
        self.hook = HyloHook(
            module.named_parameters(),
            self.policy,
            warmup_steps=self.warmup_steps,
            two_bit_exchange=self.exchange,
            cost_model=CostModel(bandwidth) if self.use_cost_model else None,
            calibration_steps=self.calibration_steps,
            process_group=group,
            seed=self.seed,
            overlap=self.overlap,
            piece_numel=self.piece_numel,
        )
        if self._pending_state is not None:
            self._pending_anchor = self._pending_state.get("delta_anchor")
            self._restore(self._pending_state, trainer.strategy.root_device)
            self._pending_state = None
        elif previous is not None:  # a second fit with the same callback continues the state
            self.hook.load_state_dict(previous, trainer.strategy.root_device)
        if isinstance(averaging, ReplicaAveraging):
            if isinstance(averaging.reduction, SurvivorAllReduce):
                raise ValueError(
                    "HyloCompression averages the replicas' deltas with collectives of its own, "
                    "which do not go on without a lost replica; use worker_loss='stop' with it"
                )
            anchor = self.delta_mean.state_dict() if self.delta_mean is not None else None
            self.delta_mean = CompressedDeltaMean(self.hook, trainable_parameters(pl_module))
            if self._pending_anchor is not None:
                self.delta_mean.load_state_dict(self._pending_anchor, trainer.strategy.root_device)
                self._pending_anchor = None
            elif anchor is not None:
                self.delta_mean.load_state_dict(anchor, trainer.strategy.root_device)
            averaging.parameter_mean = self.delta_mean
        else:
            assert isinstance(ddp, DistributedDataParallel)
            self.hook.register(ddp)

    # -- telemetry ------------------------------------------------------------------------

    def on_train_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        if self.hook is None or trainer.global_step % self.telemetry_every_n_steps:
            return
        process_ledger().gauges.update(self.hook.gauges(self.per_layer_telemetry))

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.hook is None:
            return
        process_ledger().gauges.update(self.hook.gauges(self.per_layer_telemetry))
        # callback_metrics travel back from rank 0 to the main process under spawn/fork, so
        # tests and the benchmark can see that the hook ran.
        trainer.callback_metrics["hylo/hook_calls"] = torch.tensor(float(self.hook.calls))
        trainer.callback_metrics["hylo/steps"] = torch.tensor(float(self.hook.step))

    # -- checkpointing --------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Every rank's residuals and codec state (gathered: call on all ranks, as Lightning does).

        Residuals differ per rank while only rank 0 writes the checkpoint, so the ranks' states
        are gathered into ``{"world_size": W, "ranks": [state of rank 0, ..., rank W-1]}``.
        """
        if self.hook is None:
            return dict(self._pending_state or {})
        local = self.hook.state_dict()
        extra = {"delta_anchor": self.delta_mean.state_dict()} if self.delta_mean else {}
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return {"world_size": 1, "ranks": [local], **extra}
        states: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(states, local)
        return {"world_size": len(states), "ranks": states, **extra}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Keep the state until the hook exists (Lightning restores callbacks before DDP)."""
        if not state_dict:
            return
        self._pending_state = state_dict
        if self.hook is not None:
            self._restore(state_dict, None)
            self._pending_state = None

    def _restore(self, state: dict[str, Any], device: torch.device | None) -> None:
        assert self.hook is not None
        ranks = state["ranks"]
        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        if len(ranks) == world:
            self.hook.load_state_dict(ranks[rank], device)
            return
        rank_zero_warn(
            f"HyloCompression: the checkpoint holds residuals of {len(ranks)} ranks, this run has "
            f"{world}: residuals restart from zero (the step count and cost-model decisions are "
            "kept)"
        )
        fresh = {**ranks[0], "memory": {}, "server_memory": {}}
        self.hook.load_state_dict(fresh, device)
