"""The ``lightning-parallel`` command.

Subcommands:

- ``fit``, ``validate``, ``test``, ``predict``: a ``LightningCLI`` over the bundled demo models
  and data (``--model vgg_mini|convnet|mlp|vgg16|resnet18|resnet50|gpt|recommender``,
  ``--data digits|synthetic|corpus|interactions|cifar10``; without ``--data`` a bundled model
  trains on the bundled data of its kind) or any ``--model``/``--data`` class path, with every
  strategy of this package available by name, e.g. ``lightning-parallel fit --model convnet
  --data digits --accelerator cpu --devices 2 --trainer.strategy ddp_spawn``
  (``--accelerator`` and ``--devices`` are ``--trainer.accelerator`` and
  ``--trainer.devices``; ``cuda`` trains on GPUs). The demo model's ``input_shape`` and
  ``num_classes`` follow the data; a ``CommStats`` callback logs communication per step.
- ``cluster``: run a command on a simulated multi-host cluster (network namespaces).
- ``bench``: compare strategies on the simulated cluster.
- ``plan``: predict each strategy's step time, bytes per step and memory for a model on a
  cluster, from one profile.
- ``codecs``: time each gradient codec's encode and decode per 10M floats, on CPU and CUDA.
- ``strategies``: list the strategy names this package registers.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Sequence
from typing import Any

_LIGHTNING_SUBCOMMANDS = ("fit", "validate", "test", "predict")
_TOOLS = {
    "cluster": "lightning_parallel.cluster.command",
    "bench": "lightning_parallel.bench.command",
    "codecs": "lightning_parallel.bench.codecs",
    "plan": "lightning_parallel.bench.plan",
}
_USAGE = (
    "usage: lightning-parallel\n"
    "       {fit,validate,test,predict,cluster,bench,plan,codecs,strategies} ...\n"
    "       lightning-parallel fit --help   (and likewise for every subcommand)\n"
)


# ``fit --accelerator cuda --devices 2`` means the trainer's
_TRAINER_SHORTHANDS = {"--accelerator": "--trainer.accelerator", "--devices": "--trainer.devices"}


def _expand_short_names(argv: list[str]) -> tuple[list[str], bool]:
    """Replace demo short names after ``--model``/``--data`` by class paths, add the model's
    bundled data when a bundled model is given without ``--data``, and spell ``--accelerator``
    and ``--devices`` as the trainer's options.

    Returns the new argument list and whether both model and data are demo classes (then the
    model's input shape is linked to the data's).
    """
    import lightning_parallel.demo.data as demo_data
    import lightning_parallel.demo.models as demo_models
    from lightning_parallel.demo import default_data

    MODELS, DATAMODULES = demo_models.MODELS, demo_data.DATAMODULES
    tables: dict[str, dict[str, type]] = {"--model": MODELS, "--data": DATAMODULES}
    # a short name expands to the class's path in the module that registers it (the models
    # are defined by family, in modules next to ``demo.models``)
    registry = {"--model": demo_models.__name__, "--data": demo_data.__name__}
    out: list[str] = []
    demo = {"--model": True, "--data": True}
    given: dict[str, str] = {}
    i = 0
    while i < len(argv):
        arg = argv[i]
        flag, _, value = arg.partition("=")
        flag = _TRAINER_SHORTHANDS.get(flag, flag)
        if flag in tables and (value or i + 1 < len(argv)):
            if not value:
                value = argv[i + 1]
                i += 1
            given[flag] = value
            table = tables[flag]
            if value in table:
                value = f"{registry[flag]}.{table[value].__name__}"
            elif not value.startswith(
                ("lightning_parallel.demo", "lightning_parallel.lightning.demo")
            ):
                if "." not in value and not value.endswith((".yaml", ".yml", "}")):
                    kind = "model" if flag == "--model" else "data"
                    raise SystemExit(
                        f"error: unknown {kind} {value!r}: use one of {sorted(table)} "
                        f"or a class path such as my_package.MyModule"
                    )
                demo[flag] = False
            out.append(f"{flag}={value}")
        elif flag in _TRAINER_SHORTHANDS.values():
            out.append(f"{flag}={value}" if value else flag)
        else:
            out.append(arg)
        i += 1
    if given.get("--model") in MODELS and "--data" not in given:
        # a bundled model without --data trains on the bundled data of its kind
        cls = DATAMODULES[default_data(given["--model"])]
        out.append(f"--data={registry['--data']}.{cls.__name__}")
    return out, demo["--model"] and demo["--data"]


def _run_lightning_cli(argv: list[str]) -> int:
    from pytorch_lightning import LightningDataModule, LightningModule
    from pytorch_lightning.cli import LightningCLI

    import lightning_parallel  # noqa: F401  (registers strategy names)
    from lightning_parallel.callbacks import CommStats

    argv, link_demo = _expand_short_names(argv)
    cli_class = __getattr__("_DemoLinkedCLI") if link_demo else LightningCLI
    cli_class(
        LightningModule,
        LightningDataModule,
        subclass_mode_model=True,
        subclass_mode_data=True,
        args=argv,
        trainer_defaults={"callbacks": [CommStats(summary=True)]},
        save_config_kwargs={"overwrite": True},
    )
    return 0


def _make_demo_cli() -> type:
    from pytorch_lightning.cli import LightningArgumentParser, LightningCLI

    class DemoLinkedCLI(LightningCLI):
        """LightningCLI that sizes the demo model from the demo data."""

        def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
            parser.link_arguments(
                "data", "model.init_args.input_shape", _input_shape, apply_on="instantiate"
            )
            parser.link_arguments(
                "data", "model.init_args.num_classes", _num_classes, apply_on="instantiate"
            )

    return DemoLinkedCLI


def _input_shape(data: Any) -> tuple[int, int, int]:
    return tuple(data.input_shape)  # type: ignore[return-value]


def _num_classes(data: Any) -> int:
    return int(data.num_classes)


def _cli_namespace(argv: list[str]) -> Any:
    """The Lightning to run the CLI under: that of a ``--model``/``--data`` class path given,
    else the preferred installed one (``lightning.pytorch``, then ``pytorch_lightning``)."""
    from lightning_parallel.compat.namespaces import active, of_class

    for i, arg in enumerate(argv):
        flag, _, value = arg.partition("=")
        if flag in ("--model", "--data") and not value and i + 1 < len(argv):
            value = argv[i + 1]
        if (
            flag not in ("--model", "--data")
            or "." not in value
            or value.endswith((".yaml", ".yml"))
        ):
            continue
        module_name, _, class_name = value.rpartition(".")
        if module_name.startswith("lightning_parallel."):
            continue
        try:
            cls = getattr(importlib.import_module(module_name), class_name)
        except (ImportError, AttributeError):
            continue  # LightningCLI reports it
        namespace = of_class(cls) if isinstance(cls, type) else None
        if namespace is not None:
            return namespace
    return active()


def _list_strategies() -> int:
    import lightning_parallel

    for name, description in sorted(lightning_parallel.registered_names().items()):
        print(f"{name:24s} {description}")
    return 0


def __getattr__(name: str) -> Any:
    # built lazily so that ``import lightning_parallel.cli`` stays light, but at module level
    # (as ``lightning_parallel.cli._DemoLinkedCLI``) so that spawn launchers can pickle it
    if name == "_DemoLinkedCLI":
        cls = _make_demo_cli()
        cls.__qualname__ = cls.__name__ = "_DemoLinkedCLI"
        globals()["_DemoLinkedCLI"] = cls
        return cls
    raise AttributeError(name)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``lightning-parallel``; returns the exit code."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(_USAGE, end="")
        return 0 if args else 2
    command, rest = args[0], args[1:]
    if command in ("-V", "--version"):
        from lightning_parallel import __version__

        print(__version__)
        return 0
    if command in _LIGHTNING_SUBCOMMANDS:
        build = importlib.import_module(_cli_namespace(rest).module_of("cli"))
        return int(build._run_lightning_cli([command, *rest]))
    if command == "strategies":
        return _list_strategies()
    if command in _TOOLS:
        module = importlib.import_module(_TOOLS[command])
        return int(module.main(rest))
    print(f"error: unknown command {command!r}\n{_USAGE}", end="", file=sys.stderr)
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
