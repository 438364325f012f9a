"""Models from torchvision, timm and transformers under the pipelines, as a user brings them.

Each model sits in a ``LightningModule`` **without** ``forward`` whose ``training_step`` calls
it: ``self.net(images)`` for an image model, ``self.model(input_ids=ids, labels=ids)`` for a
language model (the loss is computed inside the model and read from its ``ModelOutput``). For
each model, strategy and stage count: a fit on that many CPU processes (fork launcher, gloo)
for ``--steps`` steps and one validation batch; the bytes of parameters each rank holds (none
may hold the whole model); and the saved checkpoint loaded with ``strict=True`` into a plain
copy of the module. Prints the table (model, strategy, stages, fit, per-rank MB, strict
load) and exits 1 if a run fails (a strategy refusing a model, with its reason, is no
failure: it says so in the table)::

    python examples/third_party_models.py
    python examples/third_party_models.py --models gpt2 resnet50 --strategies gropipe --stages 2
    python examples/third_party_models.py --strategies ddp model_averaging hylo parameter_server \
        --stages 2

(for a data-parallel strategy, "stages" is the number of processes: each holds the whole model).

Every model is at a small configuration (32-pixel images, 16-token texts, narrow language
models), except the torchvision ones, which keep their layer widths.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from pytorch_lightning.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

IMAGE, TEXT = "image", "text"
VOCABULARY, TOKENS, CLASSES = 128, 16, 10


def _torchvision(name: str, **options: Any) -> nn.Module:
    import torchvision

    return getattr(torchvision.models, name)(num_classes=CLASSES, **options)


def _vit_b_16() -> nn.Module:  # ViT-B/16's layers at 32 pixels (4 patches)
    import torchvision

    return torchvision.models.VisionTransformer(
        image_size=32, patch_size=16, num_layers=12, num_heads=12, hidden_dim=768,
        mlp_dim=3072, num_classes=CLASSES,
    )  # fmt: skip


def _timm(name: str, **options: Any) -> nn.Module:
    import timm

    return timm.create_model(name, num_classes=CLASSES, **options)


def _gpt2() -> nn.Module:  # ties its input embedding and output head
    import transformers

    config = transformers.GPT2Config(
        n_layer=4, n_embd=64, n_head=4, vocab_size=VOCABULARY, n_positions=TOKENS,
        bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    return transformers.GPT2LMHeadModel(config)


def _bert() -> nn.Module:  # masked language model; ties its embedding and decoder
    import transformers

    config = transformers.BertConfig(
        num_hidden_layers=4, hidden_size=64, num_attention_heads=4, intermediate_size=128,
        vocab_size=VOCABULARY, max_position_embeddings=TOKENS,
    )  # fmt: skip
    return transformers.BertForMaskedLM(config)


def _llama() -> nn.Module:  # a Llama-style decoder: RMSNorm, rotary positions, grouped queries
    import transformers

    config = transformers.LlamaConfig(
        num_hidden_layers=4, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=128, vocab_size=VOCABULARY, max_position_embeddings=TOKENS,
        bos_token_id=0, eos_token_id=0, pad_token_id=0,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config)


#: name -> (kind, builder)
MODELS: dict[str, tuple[str, Callable[[], nn.Module]]] = {
    "resnet50": (IMAGE, lambda: _torchvision("resnet50")),
    "vgg16": (IMAGE, lambda: _torchvision("vgg16")),
    "mobilenet_v3": (IMAGE, lambda: _torchvision("mobilenet_v3_small")),
    "vit_b_16": (IMAGE, _vit_b_16),
    "timm_vit": (IMAGE, lambda: _timm("vit_tiny_patch16_224", img_size=32)),
    "timm_convnext": (IMAGE, lambda: _timm("convnext_atto")),
    "timm_efficientnet": (IMAGE, lambda: _timm("efficientnet_b0")),
    "gpt2": (TEXT, _gpt2),
    "bert": (TEXT, _bert),
    "llama": (TEXT, _llama),
}


class ImageModule(pl.LightningModule):
    """A classifier as users write it: no ``forward``; the step calls ``self.net``."""

    def __init__(self, name: str, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.net = MODELS[name][1]()

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        images, labels = batch
        loss = F.cross_entropy(self.net(images), labels)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        images, labels = batch
        self.log("val_acc", (self.net(images).argmax(-1) == labels).float().mean())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


class TextModule(pl.LightningModule):
    """A language model as users write it: keyword arguments, the loss inside the model."""

    def __init__(self, name: str, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.model = MODELS[name][1]()

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (ids,) = batch
        loss = self.model(input_ids=ids, labels=ids).loss
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        (ids,) = batch
        self.log("val_loss", self.model(input_ids=ids, labels=ids).loss)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


def build(name: str, seed: int = 0) -> pl.LightningModule:
    """The ``LightningModule`` around model ``name``."""
    return (ImageModule if MODELS[name][0] == IMAGE else TextModule)(name, seed)


def loader(name: str, batch: int = 8, samples: int = 32) -> DataLoader:
    """Random data in the model's input form (images and labels, or token ids)."""
    generator = torch.Generator().manual_seed(1)
    if MODELS[name][0] == IMAGE:
        images = torch.randn(samples, 3, 32, 32, generator=generator)
        labels = torch.randint(0, CLASSES, (samples,), generator=generator)
        return DataLoader(TensorDataset(images, labels), batch_size=batch)
    ids = torch.randint(0, VOCABULARY, (samples, TOKENS), generator=generator)
    return DataLoader(TensorDataset(ids), batch_size=batch)


class HeldBytes(pl.Callback):
    """Writes the bytes of real (not ``meta``) parameters this rank holds during training."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder

    def on_train_batch_end(self, trainer: pl.Trainer, module: Any, *args: Any) -> None:
        held = sum(p.numel() * p.element_size() for p in module.parameters() if not p.is_meta)
        path = self.folder / f"held_rank{trainer.global_rank}.json"
        path.write_text(json.dumps(held))


def strategy_for(name: str, stages: int) -> Any:
    """GroPipe or SpecTrain with ``stages`` stages, or another registered strategy (``ddp``,
    ``model_averaging``, ``hylo``, ``parameter_server``: the data-parallel families, for the
    regression check) over as many processes; fork launcher."""
    from pytorch_lightning.strategies import DDPStrategy, StrategyRegistry

    import lightning_parallel  # noqa: F401  (registers the names)

    if name in ("gropipe", "spectrain"):
        entry = StrategyRegistry[name]
        return entry["strategy"](stages=stages, micro_batches=2, start_method="fork")
    if name == "ddp":
        return DDPStrategy(start_method="fork")
    entry = StrategyRegistry[name]
    return entry["strategy"](**{**entry["init_params"], "start_method": "fork"})


def run(model: str, strategy: str, stages: int, steps: int, folder: Path) -> dict[str, Any]:
    """One fit; returns the row of the table."""
    torch.set_num_threads(1)
    module = build(model)
    whole = sum(p.numel() * p.element_size() for p in module.parameters())
    saver = ModelCheckpoint(dirpath=folder, save_last=True)
    trainer = pl.Trainer(
        accelerator="cpu", devices=stages, strategy=strategy_for(strategy, stages),
        max_steps=steps, limit_val_batches=1, num_sanity_val_steps=0, logger=False,
        callbacks=[saver, HeldBytes(folder)], enable_progress_bar=False,
        enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(module, loader(model), loader(model))
    held = [json.loads((folder / f"held_rank{r}.json").read_text()) for r in range(stages)]
    plain = build(model, seed=1)
    plain.load_state_dict(torch.load(folder / "last.ckpt")["state_dict"], strict=True)
    return {"held": held, "whole": whole, "strict": "yes", "fit": "ok"}


def _child(model: str, strategy: str, stages: int, steps: int, queue: Any) -> None:
    try:
        with tempfile.TemporaryDirectory() as folder:
            queue.put(run(model, strategy, stages, steps, Path(folder)))
    except BaseException as error:
        # a rank's error arrives as the whole traceback: its last line says what failed; a
        # PipelineSplitError is the strategy refusing the model, with the reason
        lines = [line for line in str(error).splitlines() if line.strip()] or [""]
        last = lines[-1].strip()
        if "PipelineSplitError: " in last:
            queue.put({"fit": "refused: " + last.split("PipelineSplitError: ", 1)[1][:160]})
        else:
            queue.put({"fit": f"FAILED: {type(error).__name__}: {last[:200]}"})


def row(model: str, strategy: str, stages: int, result: dict[str, Any]) -> str:
    """A markdown row: per-rank MB of held parameters, against the whole model's."""
    mb = 2**20
    if result["fit"] != "ok":
        return f"| {model} | {strategy} | {stages} | {result['fit']} | | | |"
    held = " / ".join(f"{b / mb:.1f}" for b in result["held"])
    whole = result["whole"] / mb
    return f"| {model} | {strategy} | {stages} | ok | {held} | {whole:.1f} | {result['strict']} |"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--strategies", nargs="+", default=["gropipe", "spectrain"])
    parser.add_argument("--stages", nargs="+", type=int, default=[2, 4])
    parser.add_argument("--steps", type=int, default=2)
    args = parser.parse_args()
    context = multiprocessing.get_context("spawn")  # each fit in a fresh process
    rows, failed = [], False
    for model in args.models:
        for strategy in args.strategies:
            for stages in args.stages:
                queue = context.Queue()
                child = context.Process(
                    target=_child, args=(model, strategy, stages, args.steps, queue)
                )
                child.start()
                child.join(timeout=900)
                if child.is_alive():
                    child.kill()
                result = queue.get() if not queue.empty() else {"fit": "FAILED: no result"}
                failed |= result["fit"].startswith("FAILED")
                rows.append(row(model, strategy, stages, result))
                print(rows[-1], flush=True)
    print("\n| model | strategy | stages | fit | per-rank MB | whole MB | strict load |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    print("\n".join(rows))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
