"""The user's step method run around the pipeline, with its model's ``forward`` patched.

A pipeline strategy runs the user's unchanged step methods (``training_step``, ...), whose
``self(x)`` must not run the whole model: the strategy sets an instance attribute over
``forward`` (and ``log``) for the call with :func:`patched`, and puts back what was there.
:func:`capture_call` patches ``forward`` to raise :class:`InputCaptured` with its arguments:
the step stops at its first forward, and the arguments are stage 0's input (the step's loss
code never runs; keyword arguments are flattened by
:class:`~lightning_parallel.pipeline.export_split.FlatCall`). On the last stage the strategy
patches ``forward`` to return the pipeline's output instead, and the step's loss code runs on
it.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from torch import nn

__all__: list[str] = []


class InputCaptured(Exception):
    """Raised by the capturing ``forward`` to stop the user's step once the inputs are known."""

    def __init__(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        super().__init__("model input captured")
        self.args, self.kwargs = args, kwargs


@contextmanager
def patched(target: Any, name: str, replacement: Any) -> Iterator[None]:
    """Set an instance attribute for the block, then restore what was there."""
    had = name in vars(target)
    previous = vars(target).get(name)
    setattr(target, name, replacement)
    try:
        yield
    finally:
        if had:
            setattr(target, name, previous)
        else:
            delattr(target, name)


def capture_call(
    module: nn.Module, body: nn.Module, hook: str, micro_batch: Any, hook_args: Sequence[Any]
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The arguments ``module.hook(micro_batch, *hook_args)`` passes to ``body``'s ``forward``,
    positional and keyword (``module.log`` does nothing meanwhile).

    Raises:
        ValueError: the step never called the forward.
    """

    def capture(*args: Any, **kwargs: Any) -> Any:
        raise InputCaptured(args, kwargs)

    with patched(body, "forward", capture), patched(module, "log", lambda *a, **k: None):
        try:
            getattr(module, hook)(micro_batch, *hook_args)
        except InputCaptured as captured:
            return captured.args, captured.kwargs
    raise ValueError(
        f"{type(module).__name__}.{hook} never called the model's forward; a pipeline needs "
        "`self(x)` (or `self.layers(x)`, or the call of the split module) once per batch in "
        "every step method it runs"
    )
