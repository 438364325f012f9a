"""The strategy base: checked arguments, one meaning of timeout, subgroups that keep it."""

from __future__ import annotations

import re
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from helpers.distributed import run_distributed
from helpers.sources import PACKAGE, source_files
from helpers.trainers import QUIET
from pytorch_lightning import Callback, Trainer

from lightning_parallel.comm import groups
from lightning_parallel.demo import build_datamodule, build_model
from lightning_parallel.strategies import (
    GroPipeStrategy,
    HookedDDPStrategy,
    HyloStrategy,
    ModelAveragingStrategy,
    ParameterServerStrategy,
    PowerSGDDDPStrategy,
    SpecTrainStrategy,
)
from lightning_parallel.strategies.base import ParallelStrategyBase, as_timeout

ALL = [
    GroPipeStrategy,
    HyloStrategy,
    ModelAveragingStrategy,
    ParameterServerStrategy,
    PowerSGDDDPStrategy,
    SpecTrainStrategy,
]


@pytest.mark.parametrize("cls", ALL, ids=lambda c: c.__name__)
def test_every_strategy_builds_on_the_base(cls) -> None:
    assert issubclass(cls, ParallelStrategyBase)
    assert issubclass(HookedDDPStrategy, ParallelStrategyBase)


@pytest.mark.parametrize("cls", ALL, ids=lambda c: c.__name__)
def test_an_unknown_keyword_fails_at_construction_naming_the_accepted_ones(cls) -> None:
    with pytest.raises(TypeError, match=r"'not_an_option'.*it accepts .*start_method.*timeout"):
        cls(not_an_option=1)


def test_the_issues_examples_fail_at_construction() -> None:
    with pytest.raises(TypeError, match=r"conv_ratio.*conv_rate"):
        HyloStrategy(conv_ratio=0.1)
    with pytest.raises(TypeError, match="'bad'"):
        PowerSGDDDPStrategy(bad=1)
    with pytest.raises(TypeError, match=r"matrix_approximation_rank.*rank"):
        PowerSGDDDPStrategy(matrix_approximation_rank=0)
    with pytest.raises(ValueError, match="bandwidth"):
        HyloStrategy(bandwidth=-1)
    with pytest.raises(ValueError, match="memory_limit_bytes"):
        GroPipeStrategy(memory_limit_bytes=-1)


def test_ddp_keywords_pass_only_where_the_model_is_wrapped_in_ddp() -> None:
    HyloStrategy(find_unused_parameters=True)  # DDP's own keyword: accepted
    with pytest.raises(TypeError, match="find_unused_parameters"):
        GroPipeStrategy(find_unused_parameters=True)


@pytest.mark.parametrize("cls", ALL, ids=lambda c: c.__name__)
def test_timeout_is_a_timedelta_everywhere(cls) -> None:
    with pytest.raises(TypeError, match=r"timedelta\(seconds=60\)"):
        cls(timeout=60)
    strategy = cls(timeout=timedelta(seconds=90))
    assert strategy.collective_timeout == timedelta(seconds=90)


def test_timeout_checks() -> None:
    assert as_timeout(None).total_seconds() > 0
    with pytest.raises(ValueError, match="positive"):
        as_timeout(timedelta(0))
    with pytest.raises(TypeError):
        as_timeout(True)


def test_the_parameter_servers_heartbeat_is_its_own_argument() -> None:
    strategy = ParameterServerStrategy(heartbeat_timeout=12.5, timeout=timedelta(seconds=90))
    assert strategy.fault_timeout == 12.5
    assert strategy.collective_timeout == timedelta(seconds=90)
    with pytest.raises(ValueError, match="heartbeat_timeout"):
        ParameterServerStrategy(heartbeat_timeout=0)


def test_a_world_size_the_stages_do_not_divide_fails_when_the_trainer_is_built() -> None:
    # before any process starts: Trainer(...) itself raises
    with pytest.raises(ValueError, match="not a multiple of stages=3"):
        Trainer(accelerator="cpu", devices=2, strategy=GroPipeStrategy(stages=3), logger=False)
    with pytest.raises(ValueError, match="not a multiple of stages=3"):
        Trainer(accelerator="cpu", devices=2, strategy=SpecTrainStrategy(stages=3), logger=False)


def test_every_process_group_of_the_package_is_made_with_the_run_timeout() -> None:
    direct = [
        f"{path.relative_to(PACKAGE)}:{number}"
        for path in source_files()
        if path.name != "groups.py"
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if re.search(r"\bdist\.new_group\(|distributed\.new_group\(", line)
    ]
    assert direct == []


def _subgroup_collective_times_out(rank: int, world_size: int) -> float:
    groups.set_group_timeout(timedelta(seconds=3))
    group = groups.new_group(list(range(world_size)))
    if rank == 1:
        time.sleep(10)  # never joins the collective
        return 0.0
    start = time.monotonic()
    try:
        dist.all_reduce(torch.ones(4), group=group)
    except RuntimeError:
        return time.monotonic() - start
    raise AssertionError("the collective on the subgroup did not time out")


@pytest.mark.faults
def test_a_subgroup_collective_raises_after_the_run_timeout_not_torchs_default() -> None:
    waited = run_distributed(_subgroup_collective_times_out, 2, timeout=60.0)[0]
    assert 2.5 <= waited < 9.0


class _RecordGroupTimeout(Callback):
    def on_train_start(self, trainer, pl_module) -> None:
        assert groups.group_timeout() == timedelta(seconds=47), groups.group_timeout()


@pytest.mark.parametrize("cls", [GroPipeStrategy, ModelAveragingStrategy], ids=lambda c: c.__name__)
def test_the_strategy_sets_its_timeout_for_the_groups_it_creates(cls) -> None:
    data = build_datamodule("synthetic", batch_size=16, num_samples=128, image_size=8)
    model = build_model("mlp", data, depth=2, width=16)
    trainer = Trainer(
        accelerator="cpu",
        devices=2,
        strategy=cls(start_method="fork", timeout=timedelta(seconds=47)),
        max_steps=2,
        limit_val_batches=0,
        callbacks=[_RecordGroupTimeout()],
        **QUIET,
    )
    trainer.fit(model, datamodule=data)
    assert trainer.state.finished


def test_a_later_trainer_in_a_process_that_joined_the_run_is_launched_externally(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Lightning's teardown removes WORLD_SIZE; a second Trainer in a process started by torchrun
    # or the simulated cluster must not start processes of its own
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        trainer = Trainer(accelerator="cpu", devices=1, strategy=ModelAveragingStrategy(), **QUIET)
        strategy = trainer.strategy
        assert isinstance(strategy, ParallelStrategyBase) and strategy.launched_externally()
    finally:
        dist.destroy_process_group()
    trainer = Trainer(accelerator="cpu", devices=1, strategy=ModelAveragingStrategy(), **QUIET)
    assert not trainer.strategy.launched_externally()  # type: ignore[attr-defined]
