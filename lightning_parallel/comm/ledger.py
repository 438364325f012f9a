"""A per-process ledger of what communication costs: bytes sent, seconds spent, calls.

Every strategy and callback of this package writes into the ledger of its process
(:func:`process_ledger`); the :class:`~lightning_parallel.callbacks.CommStats` callback reads
and resets it once per optimizer step and logs the figures through the trainer's loggers.
Bytes are those *this rank sends* on the wire for the payload (protocol headers excluded), so
that they can be compared with the kernel's interface counters.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

__all__: list[str] = []


@dataclass
class CommRecord:
    """Accumulated cost of one kind of communication."""

    bytes_sent: float = 0.0
    seconds: float = 0.0
    calls: int = 0

    def add(self, other: CommRecord) -> None:
        self.bytes_sent += other.bytes_sent
        self.seconds += other.seconds
        self.calls += other.calls


@dataclass
class CommLedger:
    """Bytes, seconds and calls per kind (``"gradients"``, ``"parameters"``, ...), plus gauges.

    ``records`` accumulate until :meth:`drain` is called; ``totals`` accumulate for the whole
    process lifetime. ``gauges`` hold the latest value of strategy metrics such as compression
    ratio, staleness or bubble fraction, and are logged as they are.
    """

    records: dict[str, CommRecord] = field(default_factory=dict)
    totals: dict[str, CommRecord] = field(default_factory=dict)
    gauges: dict[str, float] = field(default_factory=dict)

    def add(self, kind: str, bytes_sent: float, seconds: float = 0.0, calls: int = 1) -> None:
        """Record ``bytes_sent`` bytes and ``seconds`` seconds of communication of ``kind``."""
        record = CommRecord(float(bytes_sent), float(seconds), calls)
        self.records.setdefault(kind, CommRecord()).add(record)
        self.totals.setdefault(kind, CommRecord()).add(record)

    @contextmanager
    def timed(self, kind: str, bytes_sent: float = 0.0) -> Iterator[None]:
        """Time the enclosed block and record it as communication of ``kind``."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self.add(kind, bytes_sent, time.perf_counter() - start)

    def set_gauge(self, name: str, value: float) -> None:
        """Set a strategy metric (logged as ``comm/<name>``)."""
        self.gauges[name] = float(value)

    def drain(self) -> dict[str, CommRecord]:
        """Return the records accumulated since the last drain and start afresh."""
        records, self.records = self.records, {}
        return records

    def total_bytes(self) -> float:
        """Bytes sent by this process since it started (all kinds)."""
        return sum(record.bytes_sent for record in self.totals.values())

    def reset(self) -> None:
        """Forget everything (records, totals and gauges)."""
        self.records.clear()
        self.totals.clear()
        self.gauges.clear()


_LEDGER = CommLedger()


def process_ledger() -> CommLedger:
    """The ledger of this process (one per rank)."""
    return _LEDGER
