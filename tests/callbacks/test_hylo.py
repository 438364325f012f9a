"""HyloCompression and the ``hylo`` strategy in real 2-process Lightning fits (fork, gloo)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from pytorch_lightning import LightningModule, Trainer
from pytorch_lightning.callbacks import ModelCheckpoint
from pytorch_lightning.strategies import DDPStrategy, StrategyRegistry
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_parallel.bench.specs import build_strategy
from lightning_parallel.callbacks import CommStats
from lightning_parallel.callbacks.hylo import HyloCompression
from lightning_parallel.strategies.hylo import HyloStrategy
from lightning_parallel.strategies.model_averaging import ModelAveragingStrategy


class _ConvFC(LightningModule):
    """A conv layer (kernel top-k), a large linear layer (2-bit) and a small one (dense)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.Sequential(
            nn.Conv2d(3, 16, 3),  # 432 weights
            nn.ReLU(),
            nn.Flatten(),
            nn.Linear(16 * 6 * 6, 32),  # 18432 weights
            nn.ReLU(),
            nn.Linear(32, 4),
        )

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.cross_entropy(self.layers(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


def _loader() -> DataLoader:
    generator = torch.Generator().manual_seed(0)
    data = TensorDataset(
        torch.randn(64, 3, 8, 8, generator=generator),
        torch.randint(0, 4, (64,), generator=generator),
    )
    return DataLoader(data, batch_size=8)  # 4 steps per epoch per rank with 2 ranks


def _hylo(**kwargs: Any) -> HyloCompression:
    options: dict[str, Any] = {"min_compress_numel": 400, "conv_rate": 0.2, "cost_model": False}
    options.update(kwargs)
    return HyloCompression(**options)


def _fit(
    callbacks: list[Any],
    strategy: Any = None,
    max_epochs: int = 2,
    ckpt_path: str | None = None,
    model: LightningModule | None = None,
) -> tuple[Trainer, dict[str, torch.Tensor]]:
    model = model or _ConvFC()
    trainer = Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy or DDPStrategy(start_method="fork"),
        max_epochs=max_epochs,
        callbacks=callbacks,
        logger=False,
        enable_checkpointing=any(isinstance(c, ModelCheckpoint) for c in callbacks),
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, _loader(), ckpt_path=ckpt_path)
    return trainer, {k: v.clone() for k, v in model.state_dict().items()}


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize(
    "callback",
    [_hylo(warmup_steps=1000), _hylo(codec="none", warmup_steps=0)],
    ids=["warm-up only", "compression disabled"],
)
def test_without_compression_a_fit_equals_ddp_exactly(callback: HyloCompression) -> None:
    _, reference = _fit([])
    trainer, weights = _fit([callback])
    assert trainer.callback_metrics["hylo/hook_calls"].item() >= 8  # the hook really ran
    assert _same(weights, reference)


def test_compressed_fit_runs_the_hook_every_step_and_reports_through_comm_stats() -> None:
    _, reference = _fit([])
    trainer, weights = _fit(
        [_hylo(warmup_steps=2, telemetry_every_n_steps=1), CommStats(gauges_every_n_steps=1)]
    )
    metrics = trainer.callback_metrics
    assert metrics["hylo/steps"].item() == 8
    assert metrics["hylo/hook_calls"].item() >= 8
    assert not _same(weights, reference)  # compression changed the updates
    assert all(torch.isfinite(w).all() for w in weights.values())
    assert metrics["comm/compression_ratio"].item() > 5
    assert metrics["comm/hylo/layers.3.weight/compression_ratio"].item() > 10  # 2-bit: ~16x
    assert metrics["comm/hylo/layers.0.weight/compression_ratio"].item() > 2  # kernel top-k
    assert metrics["comm/hylo/layers.5.bias/compression_ratio"].item() == 1.0  # dense
    assert metrics["comm/hylo/layers.3.weight/residual_norm"].item() > 0
    assert metrics["comm/hylo/layers.3.weight/encode_ms"].item() > 0
    # Python collectives are counted; DDP's analytic bytes are not added on top.
    dense_bytes = 4.0 * sum(p.numel() for p in _ConvFC().parameters())
    assert 0 < metrics["comm/bytes"].item() < 0.3 * dense_bytes


def test_gradient_accumulation_communicates_once_per_optimizer_step() -> None:
    model = _ConvFC()
    trainer = Trainer(
        accelerator="cpu",
        devices=2,
        strategy=DDPStrategy(start_method="fork"),
        max_epochs=1,
        accumulate_grad_batches=2,
        callbacks=[_hylo()],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, _loader())  # 4 batches per rank -> 2 optimizer steps
    assert trainer.callback_metrics["hylo/steps"].item() == 2
    assert all(torch.isfinite(w).all() for w in model.state_dict().values())


def test_checkpoint_resume_restores_residuals_exactly(tmp_path: Path) -> None:
    _, continuous = _fit([_hylo(warmup_steps=1)], max_epochs=2)
    checkpoint = ModelCheckpoint(dirpath=tmp_path, save_last=True)
    _fit([_hylo(warmup_steps=1), checkpoint], max_epochs=1)
    last = str(tmp_path / "last.ckpt")
    saved = torch.load(last, weights_only=False)["callbacks"]
    (state,) = [v for k, v in saved.items() if k.startswith("HyloCompression")]
    assert state["world_size"] == 2 and state["ranks"][0]["step"] == 4
    residuals = [rank["memory"]["layers.3.weight"] for rank in state["ranks"]]
    assert residuals[0].abs().sum() > 0 and not torch.equal(residuals[0], residuals[1])

    _, resumed = _fit([_hylo(warmup_steps=1)], max_epochs=2, ckpt_path=last)
    assert _same(resumed, continuous)
    # Without the residuals the run differs: the check above is not vacuous.
    _, forgetful = _fit([_hylo(warmup_steps=1)], max_epochs=2, ckpt_path=_drop_hylo(last))
    assert not _same(forgetful, continuous)


def _drop_hylo(path: str) -> str:
    checkpoint = torch.load(path, weights_only=False)
    for key in [k for k in checkpoint["callbacks"] if k.startswith("HyloCompression")]:
        del checkpoint["callbacks"][key]
    target = path.replace("last.ckpt", "no_hylo.ckpt")
    torch.save(checkpoint, target)
    return target


def test_hylo_strategy_is_registered_and_attaches_the_callback() -> None:
    for name in ("hylo", "topk_ddp", "qsgd_ddp", "terngrad_ddp", "signsgd_ddp"):
        assert name in StrategyRegistry
    assert HyloStrategy.reports_communication is True
    # text is converted where it is read (a bench SPEC here), never by the constructor
    spec = "hylo:start_method=fork,warmup_steps=1,conv_rate=0.2,min_compress_numel=400"
    strategy = build_strategy(spec + ",cost_model=false")
    assert isinstance(strategy, HyloStrategy)
    trainer, _ = _fit([], strategy=strategy, max_epochs=1)
    assert trainer.callback_metrics["hylo/hook_calls"].item() >= 4
    assert trainer.callback_metrics["hylo/steps"].item() == 4
    assert build_strategy("hylo:block_size=64").hylo.policy.two_bit_codec.block_size == 64
    assert build_strategy("hylo:block_size=none").hylo.policy.two_bit_codec.block_size is None
    with pytest.raises(ValueError, match="block_size must be an integer, got the text '64'"):
        HyloStrategy(block_size="64")  # type: ignore[arg-type]


@pytest.mark.parametrize("codec", ["topk", "qsgd", "terngrad", "signsgd"])
def test_peer_codecs_train_through_the_strategy(codec: str) -> None:
    """The codec ran: its bytes are a fraction of dense ones and the weights differ from ddp's."""
    _, reference = _fit([], max_epochs=1)
    strategy = HyloStrategy(
        codec=codec,
        start_method="fork",
        warmup_steps=1,
        min_compress_numel=400,
        cost_model=False,
    )
    strategy.hylo.telemetry_every_n_steps = 1  # the gauges after each of the 4 steps
    trainer, weights = _fit([CommStats(gauges_every_n_steps=1)], strategy=strategy, max_epochs=1)
    metrics = trainer.callback_metrics
    assert metrics["hylo/steps"].item() == 4
    assert all(torch.isfinite(w).all() for w in weights.values())
    assert not _same(weights, reference)
    assert metrics["comm/hylo/layers.3.weight/compression_ratio"].item() > 2, codec


def test_a_strategy_without_ddp_raises_a_clear_error() -> None:
    trainer = Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=1,
        callbacks=[HyloCompression()],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    with pytest.raises(RuntimeError, match="does neither"):
        trainer.fit(_ConvFC(), _loader())


def test_bad_arguments_raise_at_construction() -> None:
    with pytest.raises(ValueError, match="calibration_steps must be >= 1"):
        HyloCompression(calibration_steps=0)
    with pytest.raises(ValueError, match="exchange"):
        HyloCompression(exchange="ring")
    with pytest.raises(ValueError, match="fc_bits"):
        HyloCompression(fc_bits=4)
    with pytest.raises(ValueError, match="block_size"):
        HyloCompression(block_size=100)
    assert HyloCompression().policy.two_bit_codec.block_size == 512
    assert HyloCompression(block_size=None).policy.two_bit_codec.block_size is None
    with pytest.raises(ValueError, match="ddp_comm_hook"):
        HyloStrategy(ddp_comm_hook=lambda state, bucket: None)


def _averaging(**kwargs: Any) -> ModelAveragingStrategy:
    return ModelAveragingStrategy(period=2, start_method="fork", **kwargs)


def test_under_model_averaging_without_compression_rounds_equal_plain_averaging() -> None:
    """codec="none" sends every delta dense: anchor + mean(delta) is the plain mean."""
    _, reference = _fit([], strategy=_averaging())
    trainer, weights = _fit([_hylo(codec="none")], strategy=_averaging())
    assert trainer.callback_metrics["hylo/hook_calls"].item() >= 3  # rounds, 8 steps / period 2
    for name, value in reference.items():
        torch.testing.assert_close(weights[name], value, rtol=0, atol=1e-6)


@pytest.mark.parametrize("algorithm", ["periodic", "bmuf"])
def test_under_model_averaging_the_round_delta_is_compressed(algorithm: str) -> None:
    _, reference = _fit([], strategy=_averaging(algorithm=algorithm))
    trainer, weights = _fit(
        [_hylo(telemetry_every_n_steps=1), CommStats(gauges_every_n_steps=1)],
        strategy=_averaging(algorithm=algorithm),
    )
    metrics = trainer.callback_metrics
    assert metrics["hylo/hook_calls"].item() >= 3  # one exchange per round
    assert metrics["comm/hylo/layers.3.weight/compression_ratio"].item() > 10  # 2-bit codes
    assert metrics["comm/hylo/layers.3.weight/residual_norm"].item() > 0  # error feedback
    assert metrics["comm/compression_ratio"].item() > 5  # dense round bytes / bytes sent
    assert all(torch.isfinite(w).all() for w in weights.values())
    assert not _same(weights, reference)


def test_under_model_averaging_resume_restores_anchor_and_residuals(tmp_path: Path) -> None:
    _, continuous = _fit([_hylo()], strategy=_averaging(), max_epochs=2)
    checkpoint = ModelCheckpoint(dirpath=tmp_path, save_last=True)
    _fit([_hylo(), checkpoint], strategy=_averaging(), max_epochs=1)
    last = str(tmp_path / "last.ckpt")
    saved = torch.load(last, weights_only=False)["callbacks"]
    (state,) = [v for k, v in saved.items() if k.startswith("HyloCompression")]
    assert state["delta_anchor"]["anchor"] is not None
    _, resumed = _fit([_hylo()], strategy=_averaging(), max_epochs=2, ckpt_path=last)
    for name, value in continuous.items():
        torch.testing.assert_close(resumed[name], value, rtol=0, atol=1e-6)
