"""Decide per layer whether compression pays: codec time against transfer time saved.

Compression that costs more processor time than it saves in transfer is a loss. After the
warm-up the hook knows, per compressed layer ``l``, from calibration steps:

* ``t_codec(l)``: seconds of encode + decode (the real exchange code path, timed);
* ``b_dense(l)``, ``b_codec(l)``: bytes this rank sends for the layer uncompressed and
  compressed (ring-allreduce cost model);
* the link's seconds per byte ``1 / B``, measured on the warm-up's uncompressed allreduces (or
  given).

Rule: compress ``l`` iff ``t_codec(l) < (b_dense(l) - b_codec(l)) / B``; otherwise send it
uncompressed in the fused dense allreduce. Every rank contributes its measurements and takes
the maximum over ranks (the slowest rank and the slowest link gate the step), so every rank
reaches the same decision and the collectives stay matched. Decisions are logged.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import Tensor

__all__: list[str] = []

log = logging.getLogger(__name__)


@dataclass
class CostDecision:
    """The cost model's verdict on one layer."""

    name: str
    compress: bool
    codec_seconds: float
    saved_seconds: float
    dense_bytes: float
    compressed_bytes: float


class CostModel:
    """Keep a layer uncompressed when encoding and decoding cost more than the transfer saves.

    Args:
        bandwidth: link bandwidth in bytes per second; ``None`` measures it on the warm-up's
            uncompressed allreduces.
        margin: compress only when the saving exceeds ``margin`` times the codec time (higher
            => more layers left uncompressed).
    """

    def __init__(self, bandwidth: float | None = None, margin: float = 1.0) -> None:
        if bandwidth is not None and bandwidth <= 0:
            raise ValueError(
                f"bandwidth must be a positive number of bytes per second, got {bandwidth}"
            )
        if margin <= 0:
            raise ValueError(f"margin must be a positive value, got {margin}")
        self.bandwidth = bandwidth
        self.margin = margin
        self._transfer_bytes = 0.0
        self._transfer_seconds = 0.0
        self._codec_seconds: dict[str, float] = {}
        self._bytes: dict[str, tuple[float, float]] = {}
        self.decisions: dict[str, CostDecision] = {}

    def observe_transfer(self, bytes_sent: float, seconds: float) -> None:
        """Record one uncompressed allreduce: bytes this rank sent and seconds it took."""
        self._transfer_bytes += bytes_sent
        self._transfer_seconds += seconds

    def observe_codec(
        self, name: str, seconds: float, dense_bytes: float, compressed_bytes: float
    ) -> None:
        """Record one calibration of layer ``name`` (the fastest of several is kept)."""
        previous = self._codec_seconds.get(name)
        self._codec_seconds[name] = seconds if previous is None else min(previous, seconds)
        self._bytes[name] = (dense_bytes, compressed_bytes)

    def seconds_per_byte(self) -> float:
        """This rank's estimate of the link's seconds per byte (0 if nothing was measured)."""
        if self.bandwidth is not None:
            return 1.0 / self.bandwidth
        if self._transfer_bytes <= 0:
            return 0.0
        return self._transfer_seconds / self._transfer_bytes

    def measurements(self, names: list[str]) -> Tensor:
        """Vector ``[t_codec(names[0]), ..., t_codec(names[-1]), seconds per byte]`` (float64).

        The hook allreduces it with ``MAX`` over ranks before :meth:`decide`.
        """
        values = [self._codec_seconds.get(name, 0.0) for name in names]
        values.append(self.seconds_per_byte())
        return torch.tensor(values, dtype=torch.float64)

    def decide(self, names: list[str], agreed: Tensor) -> dict[str, CostDecision]:
        """Decisions for ``names`` from the measurements agreed by every rank."""
        seconds_per_byte = float(agreed[-1])
        for index, name in enumerate(names):
            dense_bytes, compressed_bytes = self._bytes.get(name, (0.0, 0.0))
            codec_seconds = float(agreed[index])
            saved = (dense_bytes - compressed_bytes) * seconds_per_byte
            self.decisions[name] = CostDecision(
                name=name,
                compress=saved > self.margin * codec_seconds,
                codec_seconds=codec_seconds,
                saved_seconds=saved,
                dense_bytes=dense_bytes,
                compressed_bytes=compressed_bytes,
            )
        kept = [d.name for d in self.decisions.values() if not d.compress]
        bandwidth = 1.0 / seconds_per_byte if seconds_per_byte > 0 else float("inf")
        log.info(
            "Hylo cost model at %.3g MB/s: %d of %d layers compressed; uncompressed: %s",
            bandwidth / 1e6,
            len(names) - len(kept),
            len(names),
            kept or "none",
        )
        for decision in self.decisions.values():
            log.info(
                "  %s: %s (codec %.3g ms, transfer saved %.3g ms, %.0f -> %.0f bytes)",
                decision.name,
                "compress" if decision.compress else "keep uncompressed",
                decision.codec_seconds * 1e3,
                decision.saved_seconds * 1e3,
                decision.dense_bytes,
                decision.compressed_bytes,
            )
        return self.decisions

    def state_dict(self) -> dict[str, Any]:
        """Measurements and decisions (for checkpoints)."""
        return {
            "bandwidth": self.bandwidth,
            "transfer": (self._transfer_bytes, self._transfer_seconds),
            "codec_seconds": dict(self._codec_seconds),
            "bytes": dict(self._bytes),
            "decisions": {name: asdict(decision) for name, decision in self.decisions.items()},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned."""
        self.bandwidth = state["bandwidth"]
        self._transfer_bytes, self._transfer_seconds = state["transfer"]
        self._codec_seconds = dict(state["codec_seconds"])
        self._bytes = {name: tuple(value) for name, value in state["bytes"].items()}  # type: ignore[misc]
        self.decisions = {
            name: CostDecision(**decision) for name, decision in state["decisions"].items()
        }
