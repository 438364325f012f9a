"""The benchmark worker's probe: what it counts per batch."""

from types import SimpleNamespace

import torch

from lightning_parallel.bench.worker import _make_probe


def _batch(size: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.zeros(size, 4), torch.zeros(size, dtype=torch.long)


def test_a_batch_the_strategy_skipped_keeps_its_time_but_adds_no_samples():
    probe = _make_probe(None)
    strategy = SimpleNamespace(skipped_batches=0)
    trainer = SimpleNamespace(strategy=strategy)
    for index, skipped in enumerate([False, True, False]):
        probe.on_train_batch_start(trainer, None, _batch(32), index)
        strategy.skipped_batches += int(skipped)  # the strategy decides inside the step
        probe.on_train_batch_end(trainer, None, None, _batch(32), index)
    assert probe.samples == 64
    assert len(probe.step_seconds) == 3


def test_strategies_without_a_skip_counter_count_every_batch():
    probe = _make_probe(None)
    trainer = SimpleNamespace(strategy=object())
    for index in range(2):
        probe.on_train_batch_start(trainer, None, _batch(8), index)
        probe.on_train_batch_end(trainer, None, None, _batch(8), index)
    assert probe.samples == 16
