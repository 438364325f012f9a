"""Pipelines on models users bring (examples/third_party_models.py): a transformers model called
with keyword arguments is captured with torch.export (its ``ModelOutput`` rebuilt, dropout
following the mode, any batch size); GPT-2's tied embedding and head train under GroPipe as on
one device; torchvision's ResNet-50 (in-place ReLU, batch norm) too; SpecTrain keeps the copies
of a tied weight equal."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import ModelCheckpoint
from test_gropipe import assert_same_weights, trainer
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from lightning_parallel.pipeline.export_split import ModeFollowing, exported_layers
from lightning_parallel.pipeline.stages import PipelineSplitError
from lightning_parallel.strategies.gropipe import GroPipeStrategy
from lightning_parallel.strategies.spectrain import SpecTrainStrategy

pytest.importorskip("transformers", reason="the models extra (transformers) is not installed")
pytest.importorskip("torchvision", reason="the models extra (torchvision) is not installed")

sys.path.insert(0, str(Path(__file__).parents[2] / "examples"))
import third_party_models as models


def _chain(layers: list[torch.nn.Module], inputs: tuple[Any, ...]) -> Any:
    output = layers[0](*inputs)
    for layer in layers[1:]:
        output = layer(output)
    return output


def test_export_splits_a_keyword_call_and_rebuilds_its_model_output() -> None:
    import transformers

    config = transformers.GPT2Config(
        n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=16, bos_token_id=0,
        eos_token_id=0, resid_pdrop=0.3, embd_pdrop=0.3, attn_pdrop=0.3,
    )  # fmt: skip
    model = transformers.GPT2LMHeadModel(config)
    ids = torch.randint(0, 64, (4, 16))
    layers, call = exported_layers(model, (), {"input_ids": ids, "labels": ids})
    assert len(layers) >= 4  # cuts between the blocks
    assert sum(isinstance(m, ModeFollowing) for layer in layers for m in layer.modules()) >= 5
    # another batch size, evaluation mode: exactly the model's output, as its own class
    other = torch.randint(0, 64, (3, 16))
    model.eval()
    expected = model(input_ids=other, labels=other)
    output = call.output(_chain(layers, call.inputs((), {"input_ids": other, "labels": other})))
    assert type(output) is type(expected)
    assert torch.equal(output.logits, expected.logits) and torch.equal(output.loss, expected.loss)
    # training mode: the dropout of the exported graph runs again
    model.train()
    trained = call.output(_chain(layers, call.inputs((), {"input_ids": other, "labels": other})))
    assert not torch.equal(trained.logits, expected.logits)


def _loader(name: str, shuffled: bool) -> DataLoader:
    data = models.loader(name).dataset
    if shuffled:  # the order Lightning's injected sampler gives with one data-parallel replica
        sampler = DistributedSampler(data, num_replicas=1, rank=0, shuffle=True, seed=0)
        return DataLoader(data, batch_size=8, sampler=sampler)
    return DataLoader(data, batch_size=8)


def _fit(name: str, strategy: Any, devices: int, **options: Any) -> pl.LightningModule:
    module = models.build(name)
    for layer in module.modules():  # random masks differ between the runs: none
        if isinstance(layer, torch.nn.Dropout):
            layer.p = 0.0
    run = trainer(strategy, devices, max_epochs=1, limit_train_batches=2, **options)
    run.fit(module, _loader(name, shuffled=devices == 1))
    return module


@pytest.mark.parametrize("name", ["gpt2", "llama", "resnet50"])
def test_gropipe_trains_a_third_party_model_as_one_device_does(name: str, tmp_path: Path) -> None:
    reference = _fit(name, "auto", 1)
    # batch norm normalizes each micro-batch by its own statistics: one micro-batch per batch
    # for the model with batch norm, as one device computes it
    micro_batches = 1 if name == "resnet50" else 2
    strategy = GroPipeStrategy(
        stages=2, micro_batches=micro_batches, partition="even", start_method="fork"
    )
    saver = ModelCheckpoint(dirpath=tmp_path, save_last=True)
    piped = _fit(name, strategy, 2, callbacks=[saver], enable_checkpointing=True)
    assert_same_weights(reference, piped, tolerance=1e-4)
    plain = models.build(name, seed=1)
    plain.load_state_dict(torch.load(tmp_path / "last.ckpt")["state_dict"], strict=True)
    assert_same_weights(plain, piped, tolerance=0)


class TiedCopies(pl.Callback):
    """Writes each rank's copy of GPT-2's tied matrix at the end of training."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder

    def on_train_end(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        weight = module.model.transformer.wte.weight
        if not weight.is_meta:
            torch.save(weight.detach().cpu(), self.folder / f"rank{trainer.global_rank}.pt")


@pytest.mark.parametrize("stages", [2, 4])
def test_spectrain_keeps_the_copies_of_a_tied_weight_equal(stages: int, tmp_path: Path) -> None:
    """The embedding on stage 0 and the head on the last stage: stage 0 owns the tensor and
    trains it with both uses' gradients, the last stage's copy follows; at the end (a drain)
    the copies are equal, and they trained."""
    before = models.build("gpt2").model.transformer.wte.weight.detach().clone()
    strategy = SpecTrainStrategy(stages=stages, micro_batches=2, start_method="fork")
    module = models.build("gpt2")
    # a validation after 2 of the 4 batches drains the pipeline mid-epoch: the copies are
    # settled, and the exchanges still due go on after it
    options = {"limit_val_batches": 1, "val_check_interval": 2}
    run = trainer(strategy, stages, max_epochs=1, callbacks=[TiedCopies(tmp_path)], **options)
    run.fit(module, _loader("gpt2", shuffled=False), _loader("gpt2", shuffled=False))
    copies = [torch.load(path) for path in sorted(tmp_path.glob("rank*.pt"))]
    assert len(copies) == 2  # the first and the last stage hold it, the others do not
    assert torch.equal(copies[0], copies[1])
    assert not torch.equal(copies[0], before)


def test_a_shape_the_export_fixed_is_checked_before_the_micro_batch_runs() -> None:
    class Network(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.first, self.second = torch.nn.Linear(6, 6), torch.nn.Linear(6, 2)

        def forward(self, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
            return self.second(torch.relu(self.first(x))) * scale

    _, call = exported_layers(Network(), (torch.randn(4, 6),), {"scale": torch.ones(1)})
    assert call.fixed_shapes[0] == (None, 6)  # any batch size, the features fixed
    call.inputs((torch.randn(3, 6),), {"scale": torch.ones(1)})
    with pytest.raises(PipelineSplitError, match=r"inputs of shape \(None, 6\).*\(3, 5\)"):
        call.inputs((torch.randn(3, 5),), {"scale": torch.ones(1)})


@pytest.mark.parametrize("demo", ["transformer", "lstm"])
@pytest.mark.parametrize("pipeline", ["GroPipeStrategy", "SpecTrainStrategy"])
def test_lightnings_own_demos_fit_under_both_pipelines_unchanged(demo: str, pipeline: str) -> None:
    # the demos are lightning.pytorch modules: this package's lightning.pytorch build runs them
    import lightning as L
    from lightning.pytorch.demos.lstm import LightningLSTM
    from lightning.pytorch.demos.transformer import LightningTransformer

    import lightning_parallel.lightning

    strategy = getattr(lightning_parallel.lightning, pipeline)

    base = LightningTransformer if demo == "transformer" else LightningLSTM

    class Offline(base):  # type: ignore[misc, valid-type]
        """The demo as it is, with random tokens in place of its WikiText-2 download."""

        def prepare_data(self) -> None:
            pass

        def train_dataloader(self) -> DataLoader:
            tokens = torch.randint(0, 64, (32, 12), generator=torch.Generator().manual_seed(0))
            return DataLoader(TensorDataset(tokens, tokens.roll(-1, 1)), batch_size=8)

    module = Offline(vocab_size=64)
    before = {k: v.clone() for k, v in module.state_dict().items() if v.is_floating_point()}
    run = L.Trainer(
        accelerator="cpu", devices=2, max_steps=2, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False,
        strategy=strategy(stages=2, micro_batches=2, start_method="fork"),
    )  # fmt: skip
    run.fit(module)
    after = module.state_dict()
    assert any(not torch.equal(after[key], value) for key, value in before.items())


def test_a_single_device_checkpoint_of_gpt2_resumes_under_gropipe_as_on_one_device(
    tmp_path: Path,
) -> None:
    """The export path resumes a checkpoint written without a pipeline: the tied matrix and the
    optimizer state go to both stages that hold it, and training goes on as on one device."""
    saver = ModelCheckpoint(dirpath=tmp_path, save_last=True)
    _fit("gpt2", "auto", 1, callbacks=[saver], enable_checkpointing=True)
    resumed = {}
    for name, strategy, devices in (
        ("one device", "auto", 1),
        ("pipeline", GroPipeStrategy(stages=2, micro_batches=2, start_method="fork"), 2),
    ):
        module = models.build("gpt2")
        for layer in module.modules():
            if isinstance(layer, torch.nn.Dropout):
                layer.p = 0.0
        run = trainer(strategy, devices, max_epochs=2, limit_train_batches=2)
        run.fit(module, _loader("gpt2", shuffled=devices == 1), ckpt_path=tmp_path / "last.ckpt")
        resumed[name] = module
    assert_same_weights(resumed["one device"], resumed["pipeline"], tolerance=1e-4)
