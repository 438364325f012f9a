"""A loss spike rolls model averaging back on CUDA (``pytest -m gpu``; skipped without CUDA).

The short fits of ``test_gpu_fits.py`` take too few steps for a loss rule to fire, so the
roll-back's own path (the kept point, or each fragment's agreement, put back into the replicas
and the optimizers' state cleared) would otherwise run only on the CPU. Here the training loss
is 50 times larger at one step on every rank, under the ``diloco`` preset (capped outer
Nesterov step) and streaming DiLoCo (fragments, a delayed round, int8 deltas), two ranks by
``spawn`` as in ``test_gpu_fits.py``: each rank rolls back once and trains on to the end. Under
``diloco``, whose kept point is a whole round's restart point, the parameters the step after
the roll-back starts from are exactly those an earlier step started from (the point kept), not
the spike's; streaming DiLoCo keeps one agreement a fragment, from different rounds, so there
only the count is checked.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import pytorch_lightning as pl
import torch
from helpers.models import ConvBatchNormNet
from pytorch_lightning.callbacks import Callback
from test_gpu_fits import fit, placement

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.slow,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA is not available"),
]

SPIKE_AT = 6  # of 12 optimizer steps: 3 epochs of 4 (128 samples, 2 ranks, batches of 16)


class SpikyNet(ConvBatchNormNet):
    """The test network, whose loss (and gradient) is 50 times larger at step ``SPIKE_AT``."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.starts: list[tuple[int, int, list[float]]] = []  # (step, roll-backs, checksum)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        # the parameters this step starts from (the strategy's batch start has already rolled
        # back), summed on the host in float64
        flat = torch.cat([p.detach().reshape(-1).cpu().double() for p in self.parameters()])
        rollbacks = self.trainer.strategy.averaging.rollbacks  # type: ignore[attr-defined]
        self.starts.append(
            (self.global_step, rollbacks, [float(flat.sum()), float(flat.square().sum())])
        )
        loss = super().training_step(batch, batch_idx)
        return loss * 50 if self.global_step == SPIKE_AT else loss


class RollbackRecord(Callback):
    """Writes each rank's roll-backs and its parameters' devices and finiteness at the end."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        parameters = list(pl_module.parameters())
        record = {
            "rollbacks": trainer.strategy.averaging.rollbacks,  # type: ignore[attr-defined]
            "devices": sorted({p.device.type for p in parameters}),
            "finite": all(bool(torch.isfinite(p).all()) for p in parameters),
            "steps": trainer.global_step,
            "starts": pl_module.starts,  # type: ignore[attr-defined]
        }
        (self.folder / f"rank{trainer.global_rank}.json").write_text(json.dumps(record))


def spiky_fit(family: str, folder: Path, accelerator: str, where: dict[str, Any]) -> pl.Trainer:
    """Fit :class:`SpikyNet` under ``family`` for 3 epochs; each rank writes its record."""
    model = SpikyNet(channels=8, hidden=64, device_type=accelerator)
    record = RollbackRecord(folder)
    return fit(family, folder, accelerator, where, 3, model=model, extra_callbacks=(record,))


def check_records(family: str, folder: Path, device: str) -> None:
    """Each rank rolled back once, at the step after the spike, and (``diloco``) started that
    step from parameters an earlier step started from."""
    for rank in (0, 1):
        record = json.loads((folder / f"rank{rank}.json").read_text())
        assert record["rollbacks"] == 1, record["rollbacks"]
        assert record["devices"] == [device] and record["finite"]
        assert record["steps"] == 12
        back = next(start for start in record["starts"] if start[1] == 1)
        assert back[0] == SPIKE_AT + 1  # the step after the spike
        if family == "preset:diloco":
            earlier = [start[2] for start in record["starts"] if start[0] < SPIKE_AT]
            assert back[2] in earlier, (
                "the step after the roll-back did not start from a kept point"
            )


@pytest.mark.parametrize("family", ["preset:diloco", "diloco_streaming_int8"])
def test_gpu_a_loss_spike_rolls_back(family: str, tmp_path: Path) -> None:
    trainer = spiky_fit(family, tmp_path, "cuda", placement())
    assert trainer.state.finished
    check_records(family, tmp_path, "cuda")
