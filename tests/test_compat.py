"""Both Lightning namespaces: the two builds of the layer, registration, public names, private API.

The tests marked ``compat`` fit one strategy of each family under every installed Lightning;
CI runs them on the newest ``lightning`` and on the oldest supported ``pytorch-lightning``.
"""

from __future__ import annotations

import importlib
import re
import subprocess
import sys
import textwrap
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from helpers.environment import user_environment
from helpers.sources import source_files
from helpers.trainers import QUIET

import lightning_parallel
from lightning_parallel.compat import (
    LIGHTNING,
    PYTORCH_LIGHTNING,
    SUPPORTED,
    LightningCompatError,
    generate,
    installed,
    private,
    registration,
)
from lightning_parallel.compat.namespaces import NAMESPACE_VARIABLE, of_class
from lightning_parallel.compat.public import PUBLIC_CLASSES, PUBLIC_MODULES, top_level_namespace

INSTALLED = installed()
IDS = [namespace.key for namespace in INSTALLED]
PACKAGE = Path(lightning_parallel.__file__).parent


def _layer_files() -> list[Path]:
    files = []
    for relative in generate.LAYER_MODULES:
        base = PACKAGE.joinpath(*relative.split("."))
        files += sorted(base.rglob("*.py")) if base.is_dir() else [base.with_suffix(".py")]
    return files


def _public(namespace, name: str) -> type:
    """The public class ``name`` of ``namespace``'s build, from its module of public names."""
    return getattr(importlib.import_module(PUBLIC_MODULES[namespace.key]), name)


@pytest.mark.parametrize("path", _layer_files(), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_the_lightning_build_maps_every_lightning_import_and_keeps_the_lines(path: Path) -> None:
    source = path.read_text()
    mapped = generate.rewrite(source)
    assert "pytorch_lightning" not in mapped and "lightning_fabric" not in mapped
    assert mapped.count("\n") == source.count("\n")  # tracebacks point at the real lines
    for relative in generate.LAYER_MODULES:
        assert f"lightning_parallel.{relative}." not in mapped.replace(
            f"lightning_parallel.lightning.{relative}.", ""
        )


def test_only_the_layer_and_compat_import_lightning() -> None:
    layer_files = set(_layer_files())
    allowed = layer_files | set((PACKAGE / "compat").rglob("*.py"))
    allowed |= set((PACKAGE / "bench").rglob("*.py"))  # the benchmark runs under pytorch_lightning
    offenders = [
        str(path.relative_to(PACKAGE))
        for path in source_files()
        if path not in allowed
        and any(
            line.lstrip().startswith(("import ", "from "))
            and ("pytorch_lightning" in line or "lightning_fabric" in line or "lightning." in line)
            and "lightning_parallel" not in line
            for line in path.read_text().splitlines()
        )
    ]
    assert offenders == []


def test_private_lightning_names_appear_only_in_compat() -> None:
    # the modules that hold Lightning objects; `self._x` there is the module's own attribute
    files = _layer_files() + sorted((PACKAGE / "bench").rglob("*.py"))
    offenders = []
    for use in private.PRIVATE_USES:
        if use.name in ("_configure_launcher", "_register_ddp_hooks"):
            continue  # overriding these hooks is how a strategy uses them
        pattern = re.compile(rf"(?<!self)\.{use.name}\b|\b{use.name}\(")
        offenders += [
            f"{path.name}: {use.name}" for path in files if pattern.search(path.read_text())
        ]
    assert offenders == []


@pytest.mark.parametrize("namespace", INSTALLED, ids=IDS)
def test_every_private_use_exists_in_the_installed_lightning(namespace) -> None:
    assert private.problems(namespace) == ()


@pytest.mark.parametrize(
    "public",
    ["GroPipeStrategy", "HyloStrategy", "ParameterServerStrategy", "CommStats", "HyloCompression"],
)
def test_a_missing_private_name_fails_at_construction_naming_it_and_the_range(
    monkeypatch, public
) -> None:
    gone = replace(private.PRIVATE_USES[0], name="_a_name_lightning_removed")
    monkeypatch.setattr(private, "PRIVATE_USES", (*private.PRIVATE_USES, gone))
    private.problems.cache_clear()
    try:
        with pytest.raises(LightningCompatError) as raised:
            _public(PYTORCH_LIGHTNING, public)()
    finally:
        private.problems.cache_clear()
    assert "_a_name_lightning_removed" in str(raised.value)
    assert SUPPORTED in str(raised.value)


@pytest.mark.parametrize("namespace", INSTALLED, ids=IDS)
def test_every_name_resolves_to_that_namespaces_build(namespace) -> None:
    registration.load(namespace)
    pl = namespace.module()
    for name in lightning_parallel.registered_names():
        trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=name, logger=False)
        assert of_class(type(trainer.strategy)) is namespace, name
        assert isinstance(trainer.strategy, pl.strategies.Strategy)


def test_the_lightning_build_on_disk_is_its_source_mapped_with_a_footer_naming_it() -> None:
    generate.ensure_current()  # what importing lightning_parallel.lightning does first
    assert generate.stale() == []
    for source in _layer_files():
        relative = source.relative_to(PACKAGE)
        built = (PACKAGE / "lightning" / relative).read_text().splitlines()
        assert built[:-1] == generate.rewrite(source.read_text()).splitlines()
        assert built[-1] == (
            f"# generated from lightning_parallel/{relative.as_posix()} by "
            "lightning_parallel.compat.generate: edit that file instead"
        )


def test_a_stale_or_missing_build_file_is_written_again_and_a_removed_sources_file_deleted(
    tmp_path,
) -> None:
    written = generate.write(PACKAGE, tmp_path)
    assert sorted(written) == sorted(generate.expected_files(PACKAGE))
    assert generate.write(PACKAGE, tmp_path) == []  # nothing to do a second time
    gropipe = tmp_path / "lightning" / "strategies" / "gropipe.py"
    gropipe.write_text(gropipe.read_text().replace("lightning.pytorch", "pytorch_lightning"))
    leftover = tmp_path / "lightning" / "strategies" / "removed.py"
    leftover.write_text(gropipe.read_text())  # ends with the footer: a file the build wrote
    mine = tmp_path / "lightning" / "strategies" / "notes.py"
    mine.write_text("x = 1\n")  # no footer: not the build's, kept
    assert sorted(generate.stale(PACKAGE, tmp_path)) == [
        Path("lightning/strategies/gropipe.py"),
        Path("lightning/strategies/removed.py"),
    ]
    generate.write(PACKAGE, tmp_path)
    assert generate.stale(PACKAGE, tmp_path) == []
    assert not leftover.exists() and mine.exists()


@pytest.mark.parametrize("namespace", INSTALLED, ids=IDS)
def test_each_builds_public_names_are_real_classes_of_that_lightning(namespace) -> None:
    module = importlib.import_module(PUBLIC_MODULES[namespace.key])
    assert sorted(module.__all__) == sorted(PUBLIC_CLASSES)
    bases = (namespace.module().Callback, namespace.module().strategies.Strategy)
    for name, package in PUBLIC_CLASSES.items():
        cls = getattr(module, name)
        assert isinstance(cls, type) and issubclass(cls, bases), name
        assert cls.__module__.startswith(namespace.module_of(package) + "."), name
        assert of_class(cls) is namespace


def test_the_top_level_names_are_one_build_chosen_by_installation_or_the_variable(
    monkeypatch,
) -> None:
    monkeypatch.delenv(NAMESPACE_VARIABLE)
    assert top_level_namespace() is (LIGHTNING if LIGHTNING in INSTALLED else PYTORCH_LIGHTNING)
    for namespace in INSTALLED:
        monkeypatch.setenv(NAMESPACE_VARIABLE, namespace.key)
        assert top_level_namespace() is namespace
    # this session pins pytorch_lightning (conftest.py)
    assert lightning_parallel.GroPipeStrategy is _public(PYTORCH_LIGHTNING, "GroPipeStrategy")
    assert sorted(set(lightning_parallel.__all__) & set(PUBLIC_CLASSES)) == sorted(PUBLIC_CLASSES)
    with pytest.raises(AttributeError, match="no attribute 'GroPipe'"):
        lightning_parallel.GroPipe  # noqa: B018


_SCRIPT = """
import sys
{imports}
strategy = lp.GroPipeStrategy(stages=2)
callback = lp.CommStats()

class Mine(lp.ModelAveragingStrategy):
    pass

mine = Mine(period=3)
trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=strategy, callbacks=[callback],
                     logger=False)
by_name = pl.Trainer(accelerator="cpu", devices=2, strategy="diloco", logger=False)
pl.Trainer(accelerator="cpu", devices=2, strategy=mine, logger=False)
print(type(strategy).__module__, type(by_name.strategy).__module__, type(mine).__mro__[1].__module__)
print(sorted(m for m in ("lightning.pytorch", "pytorch_lightning") if m in sys.modules))
"""


_IMPORTS = {
    # lightning_parallel imported first, as isort orders `import pytorch_lightning` after it
    PYTORCH_LIGHTNING: "import lightning_parallel.pytorch_lightning as lp\nimport pytorch_lightning as pl",
    # the top-level names are the lightning.pytorch build where lightning is installed
    LIGHTNING: "import lightning.pytorch as pl\nimport lightning_parallel as lp",
}


@pytest.mark.slow
@pytest.mark.parametrize("expected", INSTALLED, ids=IDS)
def test_a_script_gets_the_build_of_the_lightning_it_imports(expected) -> None:
    script = _SCRIPT.format(imports=_IMPORTS[expected])
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script)],
        capture_output=True,
        text=True,
        timeout=120,
        env=user_environment(PYTHONWARNINGS="ignore"),
    )
    assert done.returncode == 0, done.stderr[-2000:]
    modules, imported = done.stdout.strip().splitlines()[-2:]
    prefix = expected.layer + ".strategies."
    assert all(module.startswith(prefix) for module in modules.split()), modules
    assert imported == str([expected.pytorch])  # nothing imported the other Lightning


def test_the_override_variable_decides(monkeypatch) -> None:
    from lightning_parallel.compat import active

    for namespace in INSTALLED:
        monkeypatch.setenv(NAMESPACE_VARIABLE, namespace.key)
        assert active() is namespace
    monkeypatch.setenv(NAMESPACE_VARIABLE, "tensorflow")
    with pytest.raises(ValueError, match="unknown Lightning namespace"):
        active()


# --------------------------------------------------------------------------- fits per family

FAMILIES = {
    "hylo": ("HyloStrategy", {}),
    "model_averaging": ("ModelAveragingStrategy", {"period": 2}),
    "parameter_server": ("ParameterServerStrategy", {}),
    "gropipe": ("GroPipeStrategy", {"stages": 2, "micro_batches": 2}),
    "spectrain": ("SpecTrainStrategy", {"stages": 2}),
}


def _fit(
    namespace,
    family: str,
    start_method: str = "fork",
    callbacks: list[object] | None = None,
    ckpt_path: str | None = None,
    max_epochs: int = 1,
    more: dict[str, object] | None = None,
) -> dict[str, float]:
    from lightning_parallel.demo import build_datamodule, build_model

    pl = namespace.module()
    pl.seed_everything(0, verbose=False)
    data = build_datamodule(
        "synthetic", namespace=namespace, batch_size=16, num_samples=256, image_size=8
    )
    model = build_model("mlp", data, depth=2, width=32)
    class_name, options = FAMILIES[family]
    cls = _public(namespace, class_name)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=cls(start_method=start_method, **options, **(more or {})),
        max_epochs=max_epochs,
        limit_train_batches=4,
        limit_val_batches=2,
        callbacks=callbacks,
        **{**QUIET, "enable_checkpointing": bool(callbacks)},
    )
    trainer.fit(model, datamodule=data, ckpt_path=ckpt_path)
    # fork and spawn return rank 0's metrics to this process (not its step counter)
    assert trainer.state.finished
    return {key: float(value) for key, value in trainer.callback_metrics.items()}


@pytest.mark.compat
@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("namespace", INSTALLED, ids=IDS)
def test_one_fit_per_family_under_each_lightning(namespace, family) -> None:
    torch.set_num_threads(1)
    metrics = _fit(namespace, family)
    assert 0.0 <= metrics["val_acc"] <= 1.0
    assert torch.isfinite(torch.tensor(metrics["val_loss"]))


@pytest.mark.compat
@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("namespace", INSTALLED, ids=IDS)
def test_a_resumed_run_ends_where_the_uninterrupted_one_does_under_each_lightning(
    namespace, family, tmp_path
) -> None:
    """Two epochs in one go, and a resume for the second from the first epoch's checkpoint:
    the second epoch's checkpoints hold the same weights and the runs end on the same metrics."""
    checkpoint_class = importlib.import_module(f"{namespace.pytorch}.callbacks").ModelCheckpoint

    def saving(folder: str) -> object:
        return checkpoint_class(dirpath=tmp_path / folder, filename="{epoch}", save_top_k=-1)

    # the parameter server's asynchronous order differs from run to run: synchronous here
    more = {"max_staleness": 0} if family == "parameter_server" else {}
    whole = _fit(namespace, family, callbacks=[saving("whole")], max_epochs=2, more=more)
    first = tmp_path / "whole" / "epoch=0.ckpt"  # what a run stopped after one epoch left
    assert first.is_file()
    resumed = _fit(
        namespace,
        family,
        callbacks=[saving("resumed")],
        ckpt_path=str(first),
        max_epochs=2,
        more=more,
    )
    ends = [
        torch.load(tmp_path / run / "epoch=1.ckpt", weights_only=False)["state_dict"]
        for run in ("whole", "resumed")
    ]
    assert ends[0].keys() == ends[1].keys() and ends[0]
    for name, tensor in ends[0].items():
        assert torch.equal(tensor, ends[1][name]), name
    assert whole == resumed


@pytest.mark.compat
@pytest.mark.slow
def test_spawned_ranks_unpickle_the_lightning_build() -> None:
    namespace = INSTALLED[0]
    metrics = _fit(namespace, "model_averaging", start_method="spawn")
    assert "val_acc" in metrics


@pytest.mark.skipif(LIGHTNING not in INSTALLED, reason="the lightning distribution is absent")
def test_the_lightning_build_is_not_read_from_the_real_modules_bytecode() -> None:
    # the real module's .pyc holds the unmapped code; the mapped loader must never read it
    module = importlib.import_module("lightning_parallel.lightning.strategies.base")
    assert module.DDPStrategy.__module__.startswith("lightning.pytorch")
