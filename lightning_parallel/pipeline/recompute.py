"""Activation recomputation: keep a stage's input, not its activations, and redo the forward.

Recomputation (Chen et al., 2016, "Training Deep Nets with Sublinear Memory Cost"; GPipe's
re-materialization) trades one extra forward per micro-batch for memory:

1. forward: run the stage under ``torch.no_grad()``, keep only its input and the random-number
   state;
2. backward: restore the random-number state (so dropout draws the same masks), run the forward
   again with autograd on, then back-propagate through it.

Modes (``recompute=``): ``"always"`` for every micro-batch; ``"except_last"`` for all but the
last micro-batch of the step (its backward comes soonest, so keeping its activations costs
least); ``"never"``. Code that must not repeat a side effect during the second forward (the
running statistics of deferred BatchNorm, logging in a loss function) asks
:func:`is_recomputing`.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

__all__: list[str] = []

RECOMPUTE_MODES = ("always", "except_last", "never")

_state = threading.local()


def check_recompute_mode(mode: str) -> str:
    """Return ``mode`` if it is a known recomputation mode, else raise naming the choices."""
    if mode not in RECOMPUTE_MODES:
        raise ValueError(f"recompute must be one of {RECOMPUTE_MODES}, got {mode!r}")
    return mode


def should_recompute(mode: str, micro_batch: int, micro_batches: int) -> bool:
    """Whether micro-batch ``micro_batch`` of ``micro_batches`` is recomputed under ``mode``."""
    if mode == "always":
        return True
    if mode == "except_last":
        return micro_batch != micro_batches - 1
    return False


def recompute_fraction(mode: str, micro_batches: int) -> float:
    """Share of micro-batches whose forward runs twice under ``mode``."""
    return sum(should_recompute(mode, j, micro_batches) for j in range(micro_batches)) / max(
        micro_batches, 1
    )


def is_recomputing() -> bool:
    """True inside the second (recomputed) forward of a micro-batch."""
    return bool(getattr(_state, "recomputing", False))


@contextmanager
def recomputing() -> Iterator[None]:
    """Mark the enclosed forward as a recomputation (see :func:`is_recomputing`)."""
    previous = is_recomputing()
    _state.recomputing = True
    try:
        yield
    finally:
        _state.recomputing = previous


@dataclass
class RandomState:
    """The random-number state a forward started from, to replay it when recomputing."""

    cpu: torch.Tensor
    cuda: list[torch.Tensor] | None

    @classmethod
    def capture(cls, device: torch.device) -> RandomState:
        cuda = None
        if device.type == "cuda":
            cuda = [torch.cuda.get_rng_state(device)]
        return cls(torch.get_rng_state(), cuda)

    @contextmanager
    def replay(self, device: torch.device) -> Iterator[None]:
        """Run the block from this state, then give back the generator state found on entry."""
        devices = [device] if self.cuda is not None else []
        with torch.random.fork_rng(devices=devices):
            torch.set_rng_state(self.cpu)
            if self.cuda is not None:
                torch.cuda.set_rng_state(self.cuda[0], device)
            yield
