"""``deepspeed_pipe`` trains what one device trains, also once gradients grow past norm 1.

DeepSpeed clips gradients to norm 1.0 unless its config says otherwise (its default since PR
#8068); the peer turns that off, and refuses the Lightning settings its engine cannot follow.
Without validation, the fork launcher still hands back the whole model, not stage 0 alone.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "strategies"))

from test_gropipe import Net, assert_same_weights, loader, trainer

from lightning_parallel.bench.peers.deepspeed_pipe import engine_config
from lightning_parallel.bench.specs import build_strategy

HAS_DEEPSPEED = importlib.util.find_spec("deepspeed") is not None
# a missing optional peer is a skip with its reason, never a pass
needs_deepspeed = pytest.mark.skipif(
    not HAS_DEEPSPEED, reason="DeepSpeed is not installed: pip install 'lightning-parallel[bench]'"
)


def test_without_deepspeed_the_peer_says_how_to_install_it(monkeypatch: pytest.MonkeyPatch) -> None:
    # as if it were not installed (where it is): importing it raises ImportError
    monkeypatch.setitem(sys.modules, "deepspeed", None)
    monkeypatch.setitem(sys.modules, "deepspeed.pipe", None)
    strategy = build_strategy("deepspeed_pipe:stages=2,micro_batches=4,start_method=fork")
    with pytest.raises(ImportError, match=r"pip install 'lightning-parallel\[bench\]'"):
        strategy._build_engine(32)  # type: ignore[attr-defined]


class LargeGradientNet(Net):
    """A classifier 20 times too confident: the first stage's gradient norm starts near 8."""

    def __init__(self) -> None:
        super().__init__()
        with torch.no_grad():
            self.layers[-1].weight.mul_(20.0)


def test_the_engine_config_turns_deepspeeds_default_clipping_off() -> None:
    config = engine_config(batch_size=32, micro_batches=8, groups=2)
    assert config["gradient_clipping"] == 0.0
    assert (config["train_micro_batch_size_per_gpu"], config["train_batch_size"]) == (4, 64)


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"gradient_clip_val": 0.5, "accumulate_grad_batches": 1}, "does not clip like Lightning"),
        ({"gradient_clip_val": None, "accumulate_grad_batches": 2}, "after every batch"),
    ],
)
def test_settings_deepspeeds_engine_cannot_follow_are_refused(
    settings: dict[str, object], message: str
) -> None:
    strategy = build_strategy("deepspeed_pipe:stages=2,micro_batches=4,start_method=fork")
    with pytest.raises(ValueError, match=message):
        strategy.setup(SimpleNamespace(**settings))  # type: ignore[arg-type]


@pytest.mark.slow
@needs_deepspeed
def test_deepspeed_pipe_matches_single_device_with_gradients_past_norm_one() -> None:
    strategy = build_strategy("deepspeed_pipe:stages=2,micro_batches=4,start_method=fork")
    reference = LargeGradientNet()
    trainer("auto", 1).fit(reference, loader(shuffled=True), loader())
    model = LargeGradientNet()
    trainer(strategy, 2).fit(model, loader(), loader())
    assert_same_weights(reference, model)


@needs_deepspeed
def test_the_fork_launcher_hands_back_every_stage_without_validation() -> None:
    strategy = build_strategy("deepspeed_pipe:stages=2,micro_batches=4,start_method=fork")
    reference = Net()
    trainer("auto", 1).fit(reference, loader(shuffled=True))
    model = Net()
    trainer(strategy, 2).fit(model, loader())
    assert_same_weights(reference, model)  # rank 0 holds stage 0: stage 1 came by broadcast
