"""Decide per layer whether compression pays: codec time against transfer time saved.

Compression that costs more processor time than it saves in transfer is a loss. After the
warm-up the hook knows, per compressed layer ``l``, from calibration steps:

* ``t_codec(l)``: seconds of encode + decode (the real exchange code path, timed);
* ``b_dense(l)``, ``b_codec(l)``: bytes this rank sends for the layer uncompressed and
  compressed (ring-allreduce cost model);
* the link's seconds per byte ``1 / B``, measured on the warm-up's uncompressed allreduces (or
  given).

Rule: compress ``l`` iff ``t_codec(l) < (b_dense(l) - b_codec(l)) / B``; otherwise send it
uncompressed in the fused dense allreduce.

A layer with several candidate codecs (a fully-connected layer: low-rank factors or 2-bit
codes, :meth:`~lightning_parallel.compression.HyloPolicy.candidates`) is measured once per
candidate on the calibration steps (a local trial of each: seconds, bytes, and the relative
error ``err(c) = |p - C(p)| / |p|``). The candidate kept is the one of least
``t_codec(c) + b_codec(c) / B`` among those with ``err(c) <= error_budget`` (the least error
when none is within it), and the rule above then decides between it and the dense allreduce.

Every rank contributes its measurements and takes the maximum over ranks (the slowest rank and
the slowest link gate the step), so every rank reaches the same decision and the collectives
stay matched. Decisions are logged.
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
    route: str = ""  # the candidate kept ("": the layer's only one)
    error: float = 0.0  # its measured relative error (0: not measured)


class CostModel:
    """Keep a layer uncompressed when encoding and decoding cost more than the transfer saves,
    and pick, per layer, the cheapest candidate codec within an error budget.

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
        # per (layer, route) candidate: fastest seconds, largest error, (dense, compressed) bytes
        self._codec_seconds: dict[tuple[str, str], float] = {}
        self._errors: dict[tuple[str, str], float] = {}
        self._bytes: dict[tuple[str, str], tuple[float, float]] = {}
        self.decisions: dict[str, CostDecision] = {}

    def observe_transfer(self, bytes_sent: float, seconds: float) -> None:
        """Record one uncompressed allreduce: bytes this rank sent and seconds it took."""
        self._transfer_bytes += bytes_sent
        self._transfer_seconds += seconds

    def observe_codec(
        self,
        name: str,
        seconds: float,
        dense_bytes: float,
        compressed_bytes: float,
        route: str = "",
        error: float = 0.0,
    ) -> None:
        """Record one calibration of layer ``name`` by candidate ``route`` (the fastest of
        several is kept, and the largest error)."""
        key = (name, route)
        previous = self._codec_seconds.get(key)
        self._codec_seconds[key] = seconds if previous is None else min(previous, seconds)
        self._errors[key] = max(error, self._errors.get(key, 0.0))
        self._bytes[key] = (dense_bytes, compressed_bytes)

    def seconds_per_byte(self) -> float:
        """This rank's estimate of the link's seconds per byte (0 if nothing was measured)."""
        if self.bandwidth is not None:
            return 1.0 / self.bandwidth
        if self._transfer_bytes <= 0:
            return 0.0
        return self._transfer_seconds / self._transfer_bytes

    def _keys(self, names: list[str]) -> list[tuple[str, str]]:
        wanted = set(names)
        return sorted(key for key in self._codec_seconds if key[0] in wanted)

    def measurements(self, names: list[str]) -> Tensor:
        """Vector of every candidate's ``t_codec`` of the layers ``names`` (sorted by layer and
        route), then their errors, then the seconds per byte (float64).

        The hook allreduces it with ``MAX`` over ranks before :meth:`decide`.
        """
        keys = self._keys(names)
        values = [self._codec_seconds[key] for key in keys]
        values += [self._errors[key] for key in keys]
        values.append(self.seconds_per_byte())
        return torch.tensor(values, dtype=torch.float64)

    def decide(
        self, names: list[str], agreed: Tensor, error_budget: float = float("inf")
    ) -> dict[str, CostDecision]:
        """Decisions for ``names`` from the measurements agreed by every rank."""
        keys = self._keys(names)
        seconds_per_byte = float(agreed[-1])
        seconds = {key: float(agreed[index]) for index, key in enumerate(keys)}
        errors = {key: float(agreed[len(keys) + index]) for index, key in enumerate(keys)}

        def cost(key: tuple[str, str]) -> float:
            return seconds[key] + self._bytes[key][1] * seconds_per_byte

        for name in names:
            candidates = [key for key in keys if key[0] == name]
            if not candidates:
                continue
            within = [key for key in candidates if errors[key] <= error_budget]
            if not within:
                within = [min(candidates, key=lambda key: errors[key])]
            best = min(within, key=cost)
            dense_bytes, compressed_bytes = self._bytes[best]
            saved = (dense_bytes - compressed_bytes) * seconds_per_byte
            self.decisions[name] = CostDecision(
                name=name,
                compress=saved > self.margin * seconds[best],
                codec_seconds=seconds[best],
                saved_seconds=saved,
                dense_bytes=dense_bytes,
                compressed_bytes=compressed_bytes,
                route=best[1],
                error=errors[best],
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
                "  %s: %s (codec %.3g ms, transfer saved %.3g ms, %.0f -> %.0f bytes, error %.3g)",
                decision.name,
                f"compress ({decision.route or 'its codec'})"
                if decision.compress
                else "keep uncompressed",
                decision.codec_seconds * 1e3,
                decision.saved_seconds * 1e3,
                decision.dense_bytes,
                decision.compressed_bytes,
                decision.error,
            )
        return self.decisions

    def state_dict(self) -> dict[str, Any]:
        """Measurements and decisions (for checkpoints)."""
        return {
            "bandwidth": self.bandwidth,
            "transfer": (self._transfer_bytes, self._transfer_seconds),
            "codec_seconds": dict(self._codec_seconds),
            "errors": dict(self._errors),
            "bytes": dict(self._bytes),
            "decisions": {name: asdict(decision) for name, decision in self.decisions.items()},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned (a checkpoint from before candidates, keyed
        by layer name alone, loads as each layer's only candidate)."""

        def keyed(values: dict[Any, Any]) -> dict[tuple[str, str], Any]:
            return {
                (key, "") if isinstance(key, str) else tuple(key): v for key, v in values.items()
            }  # type: ignore[misc]

        self.bandwidth = state["bandwidth"]
        self._transfer_bytes, self._transfer_seconds = state["transfer"]
        self._codec_seconds = keyed(state["codec_seconds"])
        self._errors = keyed(state.get("errors", {}))
        self._bytes = {key: tuple(value) for key, value in keyed(state["bytes"]).items()}
        self.decisions = {
            name: CostDecision(**decision) for name, decision in state["decisions"].items()
        }
