"""The plan's profile taken on CUDA (``plan --accelerator cuda``; ``pytest -m gpu``).

It runs in a spawned process, so that the pytest process never initialises CUDA (the CPU tests
launch ranks by fork, which CUDA forbids once initialised).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from helpers.distributed import run_distributed

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA is not available"),
]


def _profile(rank: int, world: int) -> dict[str, Any]:
    from helpers.bench_modules import TinyClassifier, TinyData

    from lightning_parallel.bench.plan_profile import profile_module

    model = TinyClassifier(hidden=64)
    profile = profile_module(model, TinyData(batch_size=16), steps=4, accelerator="cuda")
    return {
        "notes": profile.notes,
        "device": next(model.parameters()).device.type,
        "compute_s": profile.forward_s + profile.backward_s,
        "trainer_step_s": profile.trainer_step_s,
        "flops": profile.flops,
        "codecs": len(profile.codec_seconds),
        "layers": [len(layers.layers) for layers in profile.layer_profiles],
    }


def test_gpu_plan_profiles_on_the_gpu() -> None:
    profile = run_distributed(_profile, 1, start_method="spawn", init_group=False, timeout=300.0)[0]
    assert profile["notes"]["accelerator"] == "cuda"
    assert profile["device"] == "cuda"  # the step, layers and codecs were timed where it trains
    assert profile["flops"] > 0 and profile["compute_s"] > 0
    assert profile["trainer_step_s"] > profile["compute_s"]
    assert profile["codecs"] > 0 and profile["layers"] and all(profile["layers"])
