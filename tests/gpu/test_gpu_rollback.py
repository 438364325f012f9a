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
only the count is checked. EASGD trains through a spike and goes back to its center on a
regression: there every rank's reported loss is back at the start from step 6, and the step
after the regression starts from the same parameters on both ranks, whose replicas differ at
every step between the first round and it.
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
# the regression (below): the loss leaves 2.3 at step 2, is back there from step 6, and the
# rule fires at step 15 (smoothing 0.7, then 3 steps within 3% of the start): 5 epochs
REGRESSION_EPOCHS, ROLLED_BACK_AT = 5, 16


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
        return self.reported(super().training_step(batch, batch_idx))

    def reported(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss the strategy sees (and its gradient's scale)."""
        return loss * 50 if self.global_step == SPIKE_AT else loss


class RegressingNet(SpikyNet):
    """The test network, whose reported loss (its gradient is the true one's) leaves 2.3 at
    step 2 on every rank and is back at 2.3 from ``SPIKE_AT`` on: a regression."""

    def reported(self, loss: torch.Tensor) -> torch.Tensor:
        dead = self.global_step < 2 or self.global_step >= SPIKE_AT
        return loss - loss.detach() + (2.3 if dead else 1.0)


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
    """Fit :class:`SpikyNet` under ``family`` for 3 epochs (``preset:easgd``:
    :class:`RegressingNet` for 5); each rank writes its record."""
    net, epochs = (RegressingNet, REGRESSION_EPOCHS) if family == "preset:easgd" else (SpikyNet, 3)
    model = net(channels=8, hidden=64, device_type=accelerator)
    record = RollbackRecord(folder)
    return fit(family, folder, accelerator, where, epochs, model=model, extra_callbacks=(record,))


def check_records(family: str, folder: Path, device: str) -> None:
    """Each rank rolled back once, at the step after the spike (EASGD: the regression), and
    (``diloco``) started that step from parameters an earlier step started from (EASGD: the
    same on both ranks, the first step since the first round where the replicas agree)."""
    easgd = family == "preset:easgd"
    records = [json.loads((folder / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    for record in records:
        assert record["rollbacks"] == 1, record["rollbacks"]
        assert record["devices"] == [device] and record["finite"]
        assert record["steps"] == (4 * REGRESSION_EPOCHS if easgd else 12)
        back = next(start for start in record["starts"] if start[1] == 1)
        assert back[0] == (ROLLED_BACK_AT if easgd else SPIKE_AT + 1)
        if family == "preset:diloco":
            earlier = [start[2] for start in record["starts"] if start[0] < SPIKE_AT]
            assert back[2] in earlier, (
                "the step after the roll-back did not start from a kept point"
            )
    if easgd:  # steps 3.. (period 2: the first round after step 1) up to the roll-back
        agree = [
            step
            for step, (first, second) in enumerate(
                zip(records[0]["starts"], records[1]["starts"], strict=True)
            )
            if step >= 3 and first[2] == second[2]
        ]
        assert agree[:1] == [ROLLED_BACK_AT], agree


@pytest.mark.parametrize("family", ["preset:diloco", "diloco_streaming_int8", "preset:easgd"])
def test_gpu_a_loss_spike_rolls_back(family: str, tmp_path: Path) -> None:
    trainer = spiky_fit(family, tmp_path, "cuda", placement())
    assert trainer.state.finished
    check_records(family, tmp_path, "cuda")
