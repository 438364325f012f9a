"""Parse link bandwidths (``1gbit``, ``100mbit``) and latencies (``1ms``, ``500us``) as ``tc`` does.

Bandwidth units follow ``tc``: ``bit``, ``kbit``, ``mbit``, ``gbit``, ``tbit`` are bits per
second (powers of 1000); ``bps``, ``kbps``, ``mbps``, ``gbps`` are *bytes* per second. Latency
units are ``s``, ``ms``, ``us``; a bare ``0`` means no added latency. Memory sizes take ``B``,
decimal ``kB``/``MB``/``GB``/``TB`` (powers of 1000) or binary ``KiB``/``MiB``/``GiB``/``TiB``
(powers of 1024), case-insensitive.
"""

from __future__ import annotations

import re

__all__: list[str] = []

_BANDWIDTH = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-z]*)\s*$")
_BITS_PER_UNIT = {
    "bit": 1.0,
    "kbit": 1e3,
    "mbit": 1e6,
    "gbit": 1e9,
    "tbit": 1e12,
    "bps": 8.0,
    "kbps": 8e3,
    "mbps": 8e6,
    "gbps": 8e9,
}
_SECONDS_PER_UNIT = {"s": 1.0, "ms": 1e-3, "us": 1e-6}
_BYTES_PER_UNIT = {
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_UNIT_NAMES = {"kb": "kB", "mb": "MB", "gb": "GB", "tb": "TB", "kib": "KiB", "mib": "MiB",
               "gib": "GiB", "tib": "TiB"}  # fmt: skip
# below this a host cannot even start a Python interpreter
MIN_MEMORY_BYTES = 2**20


def parse_bandwidth(text: str) -> int:
    """Bits per second of a ``tc``-style rate such as ``"1gbit"`` or ``"100mbit"``.

    Raises:
        ValueError: the text is not a positive number followed by a known unit.
    """
    match = _BANDWIDTH.match(text.lower())
    unit = match.group(2) if match else ""
    if not match or unit not in _BITS_PER_UNIT:
        raise ValueError(
            f"bandwidth {text!r} is not understood; write a number and one of "
            f"{sorted(_BITS_PER_UNIT)}, e.g. '1gbit' or '100mbit'"
        )
    bits = float(match.group(1)) * _BITS_PER_UNIT[unit]
    if bits < 8000:
        raise ValueError(f"bandwidth {text!r} is below 8kbit; give a positive, usable rate")
    return int(bits)


def parse_latency(text: str) -> float:
    """Seconds of a ``tc``-style delay such as ``"1ms"``, ``"500us"`` or ``"0"``.

    Raises:
        ValueError: the text is not a non-negative number followed by ``s``, ``ms`` or ``us``.
    """
    match = _BANDWIDTH.match(text.lower())
    unit = match.group(2) if match else ""
    if match and unit == "" and float(match.group(1)) == 0.0:
        return 0.0
    if not match or unit not in _SECONDS_PER_UNIT:
        raise ValueError(
            f"latency {text!r} is not understood; write a number and one of "
            f"{sorted(_SECONDS_PER_UNIT)}, e.g. '1ms' (or '0' for none)"
        )
    return float(match.group(1)) * _SECONDS_PER_UNIT[unit]


def format_bandwidth(bits_per_second: float) -> str:
    """A short human form of a rate: ``1e9`` -> ``"1gbit"``, ``2.5e8`` -> ``"250mbit"``."""
    for unit, scale in (("gbit", 1e9), ("mbit", 1e6), ("kbit", 1e3)):
        if bits_per_second >= scale:
            return f"{bits_per_second / scale:g}{unit}"
    return f"{bits_per_second:g}bit"


def parse_straggler(text: str) -> tuple[int, float]:
    """``(global rank, slowdown factor)`` of a ``"RANK:FACTOR"`` straggler option, e.g. ``"1:3"``.

    Raises:
        ValueError: not two numbers separated by ``:``, a negative rank or a factor below 1.
    """
    rank_text, sep, factor_text = text.partition(":")
    try:
        rank, factor = int(rank_text), float(factor_text)
    except ValueError:
        rank, factor, sep = -1, 0.0, ""
    if not sep or rank < 0 or factor < 1.0:
        raise ValueError(
            f"straggler {text!r} is not understood; write RANK:FACTOR with a global rank >= 0 "
            "and a slowdown factor >= 1, e.g. '1:3' (rank 1 computes 3x slower)"
        )
    return rank, factor


def parse_memory_size(text: str) -> int:
    """Bytes of a memory size such as ``"2000MB"``, ``"2GB"`` or ``"1.5GiB"``.

    ``MB``/``GB`` are powers of 1000, ``MiB``/``GiB`` powers of 1024; a unit is required.

    Raises:
        ValueError: not a number followed by a known unit, or below 1 MiB.
    """
    match = _BANDWIDTH.match(text.lower())
    unit = match.group(2) if match else ""
    if not match or unit not in _BYTES_PER_UNIT:
        raise ValueError(
            f"memory size {text!r} is not understood; write a number and one of B, kB, MB, GB, "
            "TB (powers of 1000) or KiB, MiB, GiB, TiB (powers of 1024), e.g. '2000MB' or "
            "'1.5GiB'"
        )
    size = round(float(match.group(1)) * _BYTES_PER_UNIT[unit])
    if size < MIN_MEMORY_BYTES:
        raise ValueError(
            f"memory size {text!r} is below 1 MiB: no process can start under it; give a "
            "usable size such as '500MB'"
        )
    return size


def format_memory_size(size: int) -> str:
    """A short form of a byte count in the largest unit that shows it exactly to one decimal:
    ``2 * 10**9`` -> ``"2 GB"``, ``int(1.5 * 2**30)`` -> ``"1.5 GiB"``; else in MB,
    ``123456789`` -> ``"123.5 MB"``."""
    for unit in ("tib", "tb", "gib", "gb", "mib", "mb", "kib", "kb"):
        scale = _BYTES_PER_UNIT[unit]
        if size >= scale and (size * 10) % scale == 0:
            return f"{size / scale:g} {_UNIT_NAMES[unit]}"
    if size >= 10**6:
        return f"{size / 10**6:.1f} MB"
    return f"{size} B"
