"""Fit the bundled demo on 2 CPU processes under one strategy, with the Lightning you choose.

The script imports only the Lightning namespace it is told to (``lightning.pytorch`` or
``pytorch_lightning``), builds the strategy from its registered name or from the public class,
fits a few steps and prints one line; it fails if the other namespace was imported::

    python examples/any_lightning.py --lightning lightning --strategy gropipe
    python examples/any_lightning.py --lightning pytorch_lightning --instance ModelAveragingStrategy

``--all`` runs every registered name and every strategy class under every installed Lightning,
each in its own process (Lightning's default launcher re-runs the script per rank), and prints
a table; it exits 1 if any run failed::

    python examples/any_lightning.py --all
"""

from __future__ import annotations

import argparse
import importlib
import subprocess
import sys
import time

# the public strategy classes and the arguments that make each one fit the demo on 2 processes
INSTANCES: dict[str, dict[str, object]] = {
    "HookedDDPStrategy": {"ddp_comm_hook": "fp16"},
    "PowerSGDDDPStrategy": {},
    "HyloStrategy": {},
    "ModelAveragingStrategy": {"period": 2},
    "ParameterServerStrategy": {},
    "GroPipeStrategy": {"stages": 2, "micro_batches": 2},
    "SpecTrainStrategy": {"stages": 2},
}
NAMESPACES = {"lightning": "lightning.pytorch", "pytorch_lightning": "pytorch_lightning"}


def fit(namespace: str, name: str | None, instance: str | None, steps: int) -> None:
    """One fit in this process (and the rank Lightning starts for it)."""
    pl = importlib.import_module(NAMESPACES[namespace])
    import torch

    from lightning_parallel.demo import build_datamodule, build_model

    torch.set_num_threads(1)
    pl.seed_everything(0, verbose=False)
    data = build_datamodule("synthetic", batch_size=32, num_samples=512, image_size=16)
    model = build_model("convnet", data)
    if instance is not None:
        options = dict(INSTANCES[instance])
        if options.get("ddp_comm_hook") == "fp16":
            from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

            options["ddp_comm_hook"] = default_hooks.fp16_compress_hook
        # each Lightning's public classes: lightning_parallel.lightning or .pytorch_lightning
        classes = importlib.import_module(f"lightning_parallel.{namespace}")
        strategy = getattr(classes, instance)(**options)
    else:
        strategy = name
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        max_epochs=1,
        limit_train_batches=steps,
        limit_val_batches=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, datamodule=data)
    other = [
        key for key, module in NAMESPACES.items() if key != namespace and module in sys.modules
    ]
    if other:
        raise SystemExit(f"{other[0]} was imported by a script that uses only {namespace}")
    if trainer.global_rank == 0:
        built = type(trainer.strategy)
        print(
            f"ok {namespace} {name or instance}: {built.__module__}.{built.__name__}, "
            f"{trainer.global_step} steps, val_acc {float(trainer.callback_metrics['val_acc']):.3f}"
        )


def run_all(steps: int) -> int:
    """Every name and class under every installed Lightning, one subprocess each."""
    from lightning_parallel.compat import installed

    namespaces = [namespace.key for namespace in installed()]
    names = sorted(_names())
    cases = [(ns, "--strategy", name) for ns in namespaces for name in names]
    cases += [(ns, "--instance", cls) for ns in namespaces for cls in INSTANCES]
    failed = 0
    for namespace, flag, value in cases:
        start = time.perf_counter()
        command = [sys.executable, __file__, "--lightning", namespace, flag, value]
        command += ["--steps", str(steps)]
        done = subprocess.run(command, capture_output=True, text=True, timeout=300)
        seconds = time.perf_counter() - start
        lines = [line for line in done.stdout.splitlines() if line.startswith("ok ")]
        if done.returncode == 0 and lines:
            print(f"{lines[-1]} ({seconds:.0f} s)", flush=True)
        else:
            failed += 1
            tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
            print(f"FAILED {namespace} {value} ({seconds:.0f} s): {' | '.join(tail)}", flush=True)
    print(f"{len(cases) - failed} passed, {failed} failed")
    return 1 if failed else 0


def _names() -> list[str]:
    import lightning_parallel

    return list(lightning_parallel.registered_names())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lightning", choices=sorted(NAMESPACES), default="lightning")
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument("--strategy", help="a registered strategy name")
    what.add_argument("--instance", choices=sorted(INSTANCES), help="a public strategy class")
    what.add_argument("--all", action="store_true", help="every name and class, every Lightning")
    parser.add_argument("--steps", type=int, default=6)
    args = parser.parse_args()
    if args.all:
        return run_all(args.steps)
    fit(args.lightning, args.strategy, args.instance, args.steps)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
