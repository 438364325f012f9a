"""Every codec of the package by a test name, built fresh (the stochastic ones hold generators)."""

from __future__ import annotations

from typing import Any


def make_codec(name: str) -> Any:
    """A new codec for ``name``: ``two_bit`` (and its ``_threshold`` and ``_blocks`` forms),
    ``kernel_topk``, ``topk``, ``signsgd``, ``qsgd`` or ``terngrad``."""
    from lightning_parallel.compression import (
        QSGD,
        KernelTopK,
        SignSGD,
        TernGrad,
        TopK,
        TwoBitQuantizer,
    )

    return {
        "two_bit": lambda: TwoBitQuantizer(),
        "two_bit_threshold": lambda: TwoBitQuantizer(reconstruction="threshold"),
        "two_bit_blocks": lambda: TwoBitQuantizer(block_size=512),
        "kernel_topk": lambda: KernelTopK(conv_rate=0.1),
        "topk": lambda: TopK(0.01),
        "signsgd": lambda: SignSGD(),
        "qsgd": lambda: QSGD(),
        "terngrad": lambda: TernGrad(),
    }[name]()
