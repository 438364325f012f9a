"""``hylo``: Lightning's DDPStrategy with Hylo layer-wise gradient compression switched on.

The strategy is plain :class:`~pytorch_lightning.strategies.DDPStrategy` plus a
:class:`~lightning_parallel.callbacks.hylo.HyloCompression` callback that it adds to the
trainer (unless one is already there), so that ``Trainer(strategy="hylo")`` and
``Trainer(strategy="ddp", callbacks=[HyloCompression()])`` are the same run. The peer codecs are
registered the same way for benchmarks: ``topk_ddp``, ``qsgd_ddp``, ``terngrad_ddp``,
``signsgd_ddp``.

Example::

    trainer = Trainer(accelerator="cpu", devices=2, strategy=HyloStrategy(conv_rate=0.05))
    # or, from the command line / bench: -s hylo:fc_bits=2,conv_rate=0.05
"""

from __future__ import annotations

from typing import Any, Literal

import pytorch_lightning as pl
from pytorch_lightning.callbacks import Callback
from typing_extensions import override

from lightning_parallel.callbacks.hylo import HyloCompression
from lightning_parallel.compat import register_strategy
from lightning_parallel.compat.private import attached_trainer
from lightning_parallel.compression.policy import (
    ERROR_BUDGET,
    LOW_RANK_MIN_NUMEL,
    MIN_COMPRESS_NUMEL,
    RANK,
)
from lightning_parallel.strategies.arguments import (
    as_bool,
    as_float,
    as_int,
    optional_bool,
    optional_float,
    optional_int,
)
from lightning_parallel.strategies.base import ParallelStrategyBase

__all__: list[str] = []


class HyloStrategy(ParallelStrategyBase):
    """DDP whose gradients are compressed layer by layer by Hylo (see ``HyloCompression``).

    Supported: CPU (gloo) and CUDA (NCCL), any launcher (``start_method`` as DDPStrategy),
    gradient accumulation, checkpoint resume (residuals are saved by the callback). Every
    option of :class:`~lightning_parallel.callbacks.hylo.HyloCompression` is a keyword
    argument; numbers may be given as strings (``"0.05"``), as a command line passes them.

    Args:
        codec: ``"hylo"`` or a peer codec (``"topk"``, ``"qsgd"``, ``"terngrad"``,
            ``"signsgd"``), or ``"none"``.
        conv_rate: fraction of kernels sent by a convolution of 65536 parameters.
        fc_bits: 2 or 32 (fully-connected weights quantized or not).
        threshold_factor: 2-bit threshold in units of the mean absolute gradient.
        min_compress_numel: parameters with fewer values are sent uncompressed.
        warmup_steps: optimizer steps averaged uncompressed first.
        exchange: ``"auto"`` (default), ``"two_phase"`` or ``"allgather"``.
        cost_model: per-layer fallback to uncompressed when compression does not pay.
        bandwidth: link bandwidth in bits per second for the cost model (``None``: measured).
        overlap: exchange on a background thread, overlapping the backward pass (``None``:
            on CPU yes, on CUDA no; ``True`` on CUDA raises).
        reconstruction: ``"mean"`` or ``"threshold"``: what 2-bit codes decode to.
        block_size: values per 2-bit block with its own threshold and scale (default 512;
            ``"none"``: one per tensor).
        piece_numel: values per pipelined piece of a large 2-bit layer (``"auto"``, the
            default: 524288 on CPU, none on CUDA; ``"none"``: one message per bucket).
        rank: rank of the low-rank candidate (``"none"``: none; kernel top-k and 2-bit codes
            only).
        error_budget: the largest measured relative error of the codec kept per layer.
        conv_low_rank: convolutions get the low-rank candidate too.
        low_rank_min_numel: parameters with at least this many values have the low-rank
            candidate.
        start_method: ``"popen"``, ``"spawn"``, ``"fork"`` or ``"forkserver"`` (DDPStrategy's).
        **kwargs: passed to :class:`~pytorch_lightning.strategies.DDPStrategy`.
    """

    #: Gradients travel through Python collectives (counted), not DDP's C++ reducer.
    reports_communication = True

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
        overlap: bool | None = None,
        reconstruction: str = "mean",
        block_size: int | None = 512,
        piece_numel: int | Literal["auto"] | None = "auto",
        rank: int | None = RANK,
        error_budget: float = ERROR_BUDGET,
        conv_low_rank: bool = True,
        low_rank_min_numel: int = LOW_RANK_MIN_NUMEL,
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
        **kwargs: Any,
    ) -> None:
        if "ddp_comm_hook" in kwargs:
            raise ValueError(
                "HyloStrategy registers its own communication hook: drop ddp_comm_hook, or use "
                "DDPStrategy with that hook instead"
            )
        super().__init__(start_method=start_method, **kwargs)
        self.hylo = HyloCompression(
            codec=codec,
            conv_rate=as_float("conv_rate", conv_rate),
            fc_bits=as_int("fc_bits", fc_bits),
            threshold_factor=as_float("threshold_factor", threshold_factor),
            min_compress_numel=as_int("min_compress_numel", min_compress_numel),
            warmup_steps=as_int("warmup_steps", warmup_steps),
            exchange=exchange,
            cost_model=as_bool("cost_model", cost_model),
            bandwidth=optional_float("bandwidth", bandwidth),
            overlap=optional_bool("overlap", overlap),
            reconstruction=reconstruction,
            block_size=optional_int("block_size", block_size),
            piece_numel=piece_numel,
            rank=optional_int("rank", rank),
            error_budget=as_float("error_budget", error_budget),
            conv_low_rank=as_bool("conv_low_rank", conv_low_rank),
            low_rank_min_numel=as_int("low_rank_min_numel", low_rank_min_numel),
        )

    @property
    def hook_calls(self) -> int:
        """Times DDP called the Hylo hook on this rank (tests and the benchmark read it)."""
        trainer = attached_trainer(self.lightning_module)
        given = [c for c in trainer.callbacks if isinstance(c, HyloCompression)] if trainer else []
        return sum(c.hook_calls for c in given) if given else self.hylo.hook_calls

    @override
    def strategy_callbacks(self, trainer: pl.Trainer) -> list[Callback]:
        # the strategy's own Hylo, unless the trainer was given one
        callbacks: list[Callback] = trainer.callbacks  # type: ignore[attr-defined]
        given = any(isinstance(callback, HyloCompression) for callback in callbacks)
        return [] if given else [self.hylo]


register_strategy(
    "hylo",
    HyloStrategy,
    "DDP with Hylo layer-wise compression (conv kernel top-k, FC low-rank or 2-bit, error "
    "feedback)",
)
_PEERS = {
    "topk": "top-k sparsification (1%) with error feedback, allgathered",
    "qsgd": "QSGD 4-bit stochastic quantization with error feedback, allgathered",
    "terngrad": "TernGrad ternary stochastic quantization with error feedback, allgathered",
    "signsgd": "scaled signSGD (1 bit) with error feedback, allgathered",
}
for _codec, _description in _PEERS.items():
    register_strategy(f"{_codec}_ddp", HyloStrategy, f"DDP with {_description}", codec=_codec)
