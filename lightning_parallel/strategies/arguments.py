"""Strategy arguments that may arrive as text (benchmark specs, the command line)."""

from __future__ import annotations

__all__: list[str] = []

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def optional_bool(name: str, value: object) -> bool | None:
    """``value`` as a boolean: ``True``/``False``, 0/1 or their spellings; ``None`` stays."""
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in _TRUE + _FALSE:
        return value.lower() in _TRUE
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    raise ValueError(f"{name} must be true or false, got {value!r}")


def as_bool(name: str, value: object) -> bool:
    """Like :func:`optional_bool`, but ``None`` is refused."""
    result = optional_bool(name, value)
    if result is None:
        raise ValueError(f"{name} must be true or false, got None")
    return result
