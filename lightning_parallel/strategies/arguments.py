"""Checks of strategy arguments: typed values only.

The constructors take Python values (``period=8``, ``overlap=True``). Text is converted where
it is read, once: a benchmark SPEC by :func:`lightning_parallel.bench.specs.parse_value`, the
command line by LightningCLI from the constructors' annotations. A string given where a number
or a flag is expected is refused here with the fix, never guessed at.
"""

from __future__ import annotations

__all__: list[str] = []


def _refuse_text(name: str, value: object, kind: str) -> None:
    if isinstance(value, str):
        raise ValueError(
            f"{name} must be {kind}, got the text {value!r}; pass a Python value "
            f"({name}={_example(kind)}); text from a benchmark SPEC or the command line is "
            "converted there"
        )


def _example(kind: str) -> str:
    return {"true or false": "True", "an integer": "8", "a number": "0.5"}[kind]


def optional_bool(name: str, value: object) -> bool | None:
    """``value`` as a boolean: ``True``/``False`` (or 0/1); ``None`` stays."""
    if value is None or isinstance(value, bool):
        return value
    _refuse_text(name, value, "true or false")
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    raise ValueError(f"{name} must be true or false, got {value!r}")


def as_bool(name: str, value: object) -> bool:
    """Like :func:`optional_bool`, but ``None`` is refused."""
    result = optional_bool(name, value)
    if result is None:
        raise ValueError(f"{name} must be true or false, got None")
    return result


def optional_int(name: str, value: object) -> int | None:
    """``value`` as an integer (a whole float such as ``8.0`` too); ``None`` stays."""
    if value is None:
        return None
    _refuse_text(name, value, "an integer")
    if isinstance(value, bool) or not isinstance(value, (int, float)) or int(value) != value:
        raise ValueError(f"{name} must be an integer, got {value!r}")
    return int(value)


def optional_float(name: str, value: object) -> float | None:
    """``value`` as a float; ``None`` stays."""
    if value is None:
        return None
    _refuse_text(name, value, "a number")
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number, got {value!r}")
    return float(value)


def as_float(name: str, value: object) -> float:
    """Like :func:`optional_float`, but ``None`` is refused."""
    result = optional_float(name, value)
    if result is None:
        raise ValueError(f"{name} must be a number, got None")
    return result


def as_int(name: str, value: object) -> int:
    """Like :func:`optional_int`, but ``None`` is refused."""
    result = optional_int(name, value)
    if result is None:
        raise ValueError(f"{name} must be an integer, got None")
    return result
