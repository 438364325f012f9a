"""The device rule of ``lightning_parallel.comm.devices``, checked on a CPU-only host.

On a CUDA run the default group and every group created without a backend are NCCL groups,
which refuse CPU tensors. A CPU-only CI runs gloo everywhere, so here those groups are
*declared* ``cuda`` (:func:`~lightning_parallel.comm.devices.declare_group_device`); gloo side
groups stay CPU. :class:`DeviceRuleRecorder` wraps every ``torch.distributed`` collective and
point-to-point call and, for each call made from the package, compares the device of each
tensor, as the rule placed it (:func:`~lightning_parallel.comm.devices.placed_device`), with the
group's: a CPU tensor handed to a group meant for CUDA, or a CUDA tensor sent point to point
over gloo, is a violation, reported with the line that made the call. Real 2-process gloo fits
of every strategy family run under it (fork launcher), checkpoints included.

Every test here has ``device_rule`` in its name: ``pytest -k device_rule`` runs them.
"""

from __future__ import annotations

import functools
import inspect
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import pytorch_lightning as pl
import torch
import torch.distributed as dist
from helpers.codecs import make_codec
from helpers.distributed import run_distributed
from helpers.models import ConvBatchNormNet, image_loader
from pytorch_lightning.callbacks import ModelCheckpoint
from torch import Tensor
from torch.distributed import distributed_c10d

import lightning_parallel
from lightning_parallel.comm import devices

_COLLECTIVES = (
    "all_reduce",
    "broadcast",
    "all_gather",
    "all_gather_into_tensor",
    "reduce_scatter_tensor",
    "all_to_all_single",
    "reduce",
    "gather",
    "scatter",
)
_POINT_TO_POINT = ("send", "recv", "isend", "irecv")
_PACKAGE = Path(lightning_parallel.__file__).resolve().parent
# wrappers whose frames stand between a call and the code that made it
_WRAPPERS = {Path(__file__).resolve(), _PACKAGE / "comm" / "accounting.py"}


def _tensors(value: Any) -> list[Tensor]:
    if isinstance(value, Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [item for part in value for item in _tensors(part)]
    return []


@functools.cache
def _where(filename: str) -> str:
    """``"wrapper"``, ``"package"`` or ``"other"`` for a frame's file."""
    path = Path(filename).resolve()
    if path in _WRAPPERS:
        return "wrapper"
    return "package" if _PACKAGE in path.parents else "other"


def _package_caller() -> str | None:
    """``path:line (function)`` of the package code that made the call being recorded, or
    ``None`` when the call came from elsewhere (torch itself, Lightning, torchmetrics)."""
    frame = sys._getframe(2)
    while frame is not None and _where(frame.f_code.co_filename) == "wrapper":
        frame = frame.f_back  # type: ignore[assignment]
    if frame is None or _where(frame.f_code.co_filename) != "package":
        return None
    relative = Path(frame.f_code.co_filename).resolve().relative_to(_PACKAGE.parent)
    return f"{relative}:{frame.f_lineno} ({frame.f_code.co_name})"


@dataclass
class Report:
    checked: int
    violations: list[str]


class DeviceRuleRecorder:
    """Check the device of every tensor the package hands to ``torch.distributed``.

    Installed in the test process before a fork-launched fit, so that every rank inherits it;
    each process appends its findings to a file of ``directory``.
    """

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self._saved: list[tuple[Any, str, Any]] = []

    def install(self) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        devices.clear_declarations()
        devices.declare_group_device(None, "cuda")  # the default group: NCCL on a CUDA run
        for name in (*_COLLECTIVES, *_POINT_TO_POINT):
            self._patch(name, functools.partial(self._checking, name, name in _POINT_TO_POINT))
        self._patch("batch_isend_irecv", self._checking_batch)
        self._patch("new_group", self._declaring)

    def uninstall(self) -> None:
        for module, name, original in reversed(self._saved):
            setattr(module, name, original)
        self._saved.clear()
        devices.clear_declarations()

    def _patch(self, name: str, wrap: Callable[[Any], Any]) -> None:
        for module in (dist, distributed_c10d):
            original = getattr(module, name, None)
            if original is not None:
                self._saved.append((module, name, original))
                setattr(module, name, functools.wraps(original)(wrap(original)))

    def _declaring(self, original: Any) -> Any:
        signature = inspect.signature(original)

        def new_group(*args: Any, **kwargs: Any) -> Any:
            group = original(*args, **kwargs)
            backend = signature.bind(*args, **kwargs).arguments.get("backend")
            if backend is None and isinstance(group, dist.ProcessGroup):
                # inherits the default group's backend: NCCL on a CUDA run
                devices.declare_group_device(group, "cuda")
            return group

        return new_group

    def _checking(self, name: str, point_to_point: bool, original: Any) -> Any:
        signature = inspect.signature(original)

        def checked(*args: Any, **kwargs: Any) -> Any:
            caller = _package_caller()
            if caller is not None:
                arguments = signature.bind(*args, **kwargs).arguments
                tensors = [t for value in arguments.values() for t in _tensors(value)]
                self._check(name, arguments.get("group"), tensors, point_to_point, caller)
            return original(*args, **kwargs)

        return checked

    def _checking_batch(self, original: Any) -> Any:
        def checked(p2p_op_list: list[Any]) -> Any:
            caller = _package_caller()
            if caller is not None:
                for op in p2p_op_list:
                    self._check("batch_isend_irecv", op.group, [op.tensor], True, caller)
            return original(p2p_op_list)

        return checked

    def _check(
        self, name: str, group: Any, tensors: list[Tensor], point_to_point: bool, caller: str
    ) -> None:
        intended = devices.group_device(group)
        lines = []
        for tensor in tensors:
            placed = devices.placed_device(tensor)
            if intended.type == "cuda":
                wrong = placed.type != "cuda"
            else:  # gloo: point to point from host memory; collectives take either
                wrong = point_to_point and placed.type != "cpu"
            status = "VIOLATION" if wrong else "ok"
            lines.append(
                f"{status}: {name} of a {placed.type} {tensor.dtype} tensor over a group meant "
                f"for {intended.type}, at {caller}\n"
            )
        with (self.directory / f"{os.getpid()}.log").open("a") as log:
            log.writelines(lines)

    def report(self) -> Report:
        lines = [
            line.rstrip("\n")
            for path in sorted(self.directory.glob("*.log"))
            for line in path.read_text().splitlines()
        ]
        violations = sorted({line for line in lines if line.startswith("VIOLATION")})
        return Report(checked=len(lines), violations=violations)


@pytest.fixture
def recorder(tmp_path: Path) -> Any:
    recording = DeviceRuleRecorder(tmp_path / "calls")
    recording.install()
    yield recording
    recording.uninstall()


# --------------------------------------------------------------------------- the helper


def _helper_rules(rank: int, world_size: int) -> None:
    side = devices.side_group()
    try:
        cpu = torch.ones(3)
        # gloo as it is: CPU for everything; a collective takes a tensor where it is
        assert devices.group_device() == torch.device("cpu")
        assert devices.to_group(cpu) is cpu
        devices.declare_group_device(None, "cuda")
        assert devices.group_device().type == "cuda"
        assert devices.group_device(side) == torch.device("cpu")
        placed = devices.to_group(cpu)  # no CUDA here: stays, remembered as placed on cuda
        assert placed is cpu and devices.placed_device(placed).type == "cuda"
        assert devices.placed_device(torch.ones(3)).type == "cpu"
        assert devices.placed_device(devices.empty_for(None, (2,), torch.int64)).type == "cuda"
        assert devices.placed_device(devices.empty_like(placed)).type == "cuda"
        # to a gloo group point to point: a host copy, no longer standing in for cuda
        host = devices.to_group(placed, side, point_to_point=True)
        assert host is not placed and devices.placed_device(host).type == "cpu"
        assert torch.equal(host, cpu)
        # a gloo collective takes the tensor where the rule placed it
        assert devices.to_group(placed, side) is placed
        # an in-place result comes back into the original only when they differ
        target = torch.zeros(3)
        assert devices.copy_back(target, target) is target and not target.any()
        devices.copy_back(target, torch.full((3,), 2.0))
        assert torch.equal(target, torch.full((3,), 2.0))
        dist.all_reduce(placed)
        assert torch.equal(cpu, torch.full((3,), float(world_size)))
    finally:
        devices.clear_declarations()


def test_device_rule_helper_places_tensors_by_the_groups_backend() -> None:
    run_distributed(_helper_rules, 2)


@pytest.mark.parametrize(
    "codec_name",
    ["two_bit", "two_bit_blocks", "kernel_topk", "topk", "signsgd", "qsgd", "terngrad"],
)
def test_device_rule_codecs_allocate_on_the_input_device(codec_name: str) -> None:
    """On ``meta`` (no data, no host): a tensor made on the CPU by default would show up in a
    payload or a decoded tensor."""
    codec = make_codec(codec_name)
    shape = (8, 4, 3, 3) if codec_name == "kernel_topk" else (40, 13)  # a block of 512, a tail
    random = getattr(codec, "random", None)
    if random is not None:  # meta has no generator: the noise alone comes from rand_like
        random.uniform_like = lambda tensor: torch.rand_like(tensor, dtype=torch.float32)
    gradient = torch.randn(shape, device="meta")
    encoded = codec.encode(gradient)
    assert [part.device.type for part in encoded.payload] == ["meta"] * len(encoded.payload)
    assert codec.decode(encoded).device.type == "meta"
    residual = torch.randn(shape, device="meta")
    workspace = torch.empty(residual.numel(), device="meta")  # flat, as the exchange's
    encoded = codec.encode_(residual, workspace)
    assert [part.device.type for part in encoded.payload] == ["meta"] * len(encoded.payload)
    out = torch.zeros(shape, device="meta")
    assert codec.decode_add_(encoded, out, workspace).device.type == "meta"


# --------------------------------------------------------------------------- fits


def _strategy(family: str) -> tuple[Any, dict[str, Any], list[Any]]:
    """The strategy, extra Trainer arguments and callbacks of one fit."""
    from lightning_parallel.callbacks.hylo import HyloCompression
    from lightning_parallel.strategies.gropipe import GroPipeStrategy
    from lightning_parallel.strategies.hylo import HyloStrategy
    from lightning_parallel.strategies.model_averaging import ModelAveragingStrategy
    from lightning_parallel.strategies.parameter_server import ParameterServerStrategy
    from lightning_parallel.strategies.spectrain import SpecTrainStrategy

    fork = {"start_method": "fork"}
    clip = {"gradient_clip_val": 1.0}  # the pipelines' cross-stage norms
    hylo = {"min_compress_numel": 16, "block_size": None, "warmup_steps": 1}
    if family == "gropipe:stages=2":
        return GroPipeStrategy(stages=2, micro_batches=2, **fork), clip, []
    if family == "gropipe:stages=1,groups=2":
        return GroPipeStrategy(stages=1, micro_batches=2, **fork), clip, []
    if family == "spectrain:stages=2":
        return SpecTrainStrategy(stages=2, micro_batches=2, **fork), clip, []
    if family == "spectrain:stages=1,groups=2":
        return SpecTrainStrategy(stages=1, **fork), {}, []
    if family == "parameter_server:shards=2":
        return ParameterServerStrategy(shards=2, **fork), {}, []
    if family == "model_averaging:overlap":
        return ModelAveragingStrategy(period=2, overlap=True, **fork), {}, []
    if family == "model_averaging:reduce=tree":
        strategy = ModelAveragingStrategy(period=2, reduce="tree", ranks_per_host=1, **fork)
        return strategy, {}, []
    if family == "model_averaging+hylo":
        return ModelAveragingStrategy(period=2, **fork), {}, [HyloCompression(**hylo)]
    if family == "hylo":
        return HyloStrategy(exchange="two_phase", **hylo, **fork), {}, []
    raise AssertionError(family)


FAMILIES = (
    "gropipe:stages=2",
    "gropipe:stages=1,groups=2",
    "spectrain:stages=2",
    "spectrain:stages=1,groups=2",
    "parameter_server:shards=2",
    "model_averaging:overlap",
    "model_averaging:reduce=tree",
    "model_averaging+hylo",
    "hylo",
)


@pytest.mark.parametrize("family", FAMILIES)
def test_device_rule_every_tensor_is_on_its_groups_device_in_a_fit(
    family: str, recorder: DeviceRuleRecorder, tmp_path: Path
) -> None:
    torch.set_num_threads(1)
    strategy, options, callbacks = _strategy(family)
    checkpoints = ModelCheckpoint(dirpath=tmp_path / "checkpoints", save_last=True)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        max_epochs=1,
        limit_train_batches=4,
        limit_val_batches=2,
        num_sanity_val_steps=0,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[checkpoints, *callbacks],
        default_root_dir=tmp_path,
        **options,
    )
    trainer.fit(ConvBatchNormNet(), image_loader(), image_loader())
    assert (tmp_path / "checkpoints" / "last.ckpt").is_file()
    report = recorder.report()
    assert report.checked > 0, "the recorder saw no call of the package: is it installed?"
    assert not report.violations, (
        f"{len(report.violations)} calls hand a group a tensor on another device than the "
        "group's (lightning_parallel.comm.devices):\n" + "\n".join(report.violations)
    )
