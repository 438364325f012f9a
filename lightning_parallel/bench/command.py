"""``lightning-parallel bench``: train one model under several strategies on a simulated cluster.

Example::

    lightning-parallel bench -s ddp -s ddp_fp16 -s ddp_powersgd:rank=2 --hosts 2 \\
        --bandwidth 1gbit --latency 1ms --model vgg_mini --data digits --max-steps 60 \\
        --json out.json --plot out.png
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import warnings
from pathlib import Path

from lightning_parallel.cluster.command import add_memory_per_host
from lightning_parallel.cluster.launcher import ClusterInterrupted, interrupt_on_signals
from lightning_parallel.cluster.network import ClusterError
from lightning_parallel.cpu_memory import MALLOC_MODES

__all__: list[str] = []


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lightning-parallel bench",
        description=(
            "Train the same model on the same data for the same steps under each SPEC, each "
            "on a fresh simulated cluster (network namespaces, shaped links; or, with "
            "--network local, processes on loopback), and compare. "
            "SPEC is NAME or NAME:key=value,... (e.g. ddp_powersgd:rank=2; the option "
            "accumulate_grad_batches goes to the run's Trainer). --network netns needs root."
        ),
    )
    parser.add_argument(
        "-s",
        "--spec",
        action="append",
        default=[],
        metavar="SPEC",
        help="strategy (repeat); 'all': every strategy name of this package, ddp and the "
        "pipeline peers",
    )
    parser.add_argument("--hosts", type=int, default=2)
    parser.add_argument(
        "--procs-per-host",
        "--devices",
        dest="procs_per_host",
        type=int,
        default=1,
        help="processes per host, one device each (--devices is the same option)",
    )
    parser.add_argument(
        "--accelerator",
        choices=("cpu", "cuda"),
        default="cpu",
        help="cpu (one thread per process), or cuda: process R uses GPU R mod the GPUs "
        "visible; NCCL is kept to its socket transport so the shaped links carry its "
        "traffic, and ranks sharing a GPU use gloo on CUDA tensors",
    )
    parser.add_argument(
        "--network",
        choices=("netns", "local"),
        default="netns",
        help="netns: each host a network namespace behind a shaped link (root, iproute2); "
        "local: every host's processes on this machine's loopback, unshaped, no root (times "
        "compute; --bandwidth and --latency are ignored)",
    )
    parser.add_argument(
        "--malloc",
        choices=MALLOC_MODES,
        default="held",
        help="held: every rank keeps the memory it frees for its next tensors "
        "(lightning_parallel.hold_freed_memory: no page faults for blocks under 32 MiB, as the "
        "plan's profile runs); system: the C library's defaults, under which large temporary "
        "tensors can fault in every step",
    )
    parser.add_argument("--bandwidth", default="1gbit", help="per host and direction (tc units)")
    parser.add_argument("--latency", default="1ms", help="one-way delay per host (e.g. 1ms, 0)")
    parser.add_argument(
        "--model",
        default="vgg_mini",
        help="vgg_mini | convnet | mlp | vgg16 | resnet18 | resnet50 | gpt | recommender, "
        "or your LightningModule's class path pkg.module.ClassName (importable by every "
        "process: PYTHONPATH or this directory); with init arguments NAME:k=v,... or "
        "NAME:{JSON object}",
    )
    parser.add_argument(
        "--data",
        default=None,
        help="digits | synthetic | corpus | interactions | cifar10:path=DIR, or your "
        "LightningDataModule's class path, with options as --model's (default: the bundled "
        "model's kind: digits for vgg_mini, convnet and mlp, synthetic 32x32x3 images for "
        "vgg16 and the ResNets, corpus for gpt, interactions for recommender; a class-path "
        "model needs --data)",
    )
    length = parser.add_mutually_exclusive_group()
    length.add_argument("--max-steps", type=int, default=None, help="default 200")
    length.add_argument("--epochs", type=int, default=None)
    parser.add_argument("--batch-size", type=int, default=32, help="per process")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--target-acc", type=float, default=0.9)
    parser.add_argument("--straggler", default=None, metavar="RANK:FACTOR")
    parser.add_argument("--warmup-steps", type=int, default=5, help="excluded from step times")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per run")
    parser.add_argument(
        "--fault",
        action="append",
        default=[],
        metavar="KIND:TARGET@SECONDS",
        help="inject into every run, SECONDS after its processes start (or @stepN: once the "
        "target finished training step N): kill:RANK (SIGKILL), freeze:RANK (SIGSTOP) or "
        "link:HOST (drop the host's link); repeat for several. Give SPECs a short timeout "
        "(e.g. -s ddp_fp16:timeout=30)",
    )
    add_memory_per_host(parser)
    parser.add_argument("--json", type=Path, default=None, help="write the BENCH.md JSON here")
    parser.add_argument("--plot", type=Path, default=None, help="write the PNG plot here")
    parser.add_argument("--log-dir", type=Path, default=None, help="per-run worker logs")
    parser.add_argument(
        "--predict",
        action="store_true",
        help="profile the model first and print the plan's prediction beside each run (JSON: "
        "extra.predicted_step_s, predicted_peak_rss_mb, predicted_wire_bytes_per_step)",
    )
    parser.add_argument("--list", action="store_true", help="list the known SPEC names")
    return parser


def main(argv: list[str]) -> int:
    """Parse ``argv`` (after ``bench``), run, report; 0 when every run succeeded, else 1."""
    parser = _parser()
    args = parser.parse_args(argv)
    if args.plot is not None and importlib.util.find_spec("matplotlib") is None:
        parser.error("--plot draws with matplotlib: pip install 'lightning-parallel[bench]'")
    from rich.console import Console

    from lightning_parallel.bench.modules import is_class_path
    from lightning_parallel.bench.report import plot, print_table, write_json
    from lightning_parallel.bench.runner import BenchConfig, run_benchmark
    from lightning_parallel.bench.specs import available, expand_specs, parse_spec
    from lightning_parallel.demo import DATAMODULES, default_data

    console = Console(width=None if sys.stdout.isatty() else 200)
    if args.list:
        for name, description in available().items():
            console.print(f"{name:34s} {description}", markup=False, highlight=False)
        return 0
    try:
        model = parse_spec(args.model)
        if args.data is not None:
            parse_spec(args.data)
    except ValueError as error:
        parser.error(str(error))
    if args.data is None and is_class_path(model.name):
        parser.error(
            f"--model {model.name} is your own model: give its data too, --data "
            f"pkg.module.DataModuleName (or a bundled data set: {', '.join(DATAMODULES)})"
        )
    config = BenchConfig(
        hosts=args.hosts,
        bandwidth=args.bandwidth,
        latency=args.latency,
        model=args.model,
        data=args.data or default_data(model.name),
        max_steps=args.max_steps if args.max_steps or args.epochs else 200,
        epochs=args.epochs,
        batch_size=args.batch_size,
        seed=args.seed,
        target_acc=args.target_acc,
        straggler=args.straggler,
        procs_per_host=args.procs_per_host,
        accelerator=args.accelerator,
        warmup_steps=args.warmup_steps,
        timeout=args.timeout,
        faults=args.fault,
        memory_per_host=args.memory_per_host,
        network=args.network,
        malloc=args.malloc,
    )
    warnings.filterwarnings("ignore", "latency .* is NOT emulated", RuntimeWarning)
    warnings.filterwarnings("ignore", "swap is not capped", RuntimeWarning)
    specs = expand_specs(args.spec or ["ddp"])
    profile = links = None
    if args.predict:
        from lightning_parallel.bench.links import probe_hosts
        from lightning_parallel.bench.predicted import take_profile

        try:
            profile = take_profile(specs, config)
            links = probe_hosts(config)
        except RuntimeError as error:
            print(f"error: {error}", file=sys.stderr)
            return 2
    try:
        with interrupt_on_signals():
            result = run_benchmark(
                specs,
                config,
                log_dir=args.log_dir,
                progress=lambda line: console.print(line, markup=False, highlight=False),
            )
    except (ValueError, ClusterError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    except ClusterInterrupted as interrupt:
        removed = "namespaces" + (" and memory cgroups" if args.memory_per_host else "")
        print(f"error: {interrupt}; hosts stopped and {removed} removed", file=sys.stderr)
        return 128 + interrupt.signum
    print_table(result, console)
    if profile is not None:
        from lightning_parallel.bench.predicted import attach, comparison, predict_runs

        emulated = bool(result["config"].get("latency_emulated", True))
        attach(result, predict_runs(profile, specs, config, emulated, links))
        result["plan_profile"] = profile  # to plan again from it (plan --from-profile)
        result["plan_links"] = links  # the links measured on the bench's hosts
        console.print(comparison(result), markup=False, highlight=False)
    if args.json is not None:
        write_json(result, args.json)
        console.print(f"wrote {args.json}")
    if args.plot is not None:
        plot(result, args.plot)
        console.print(f"wrote {args.plot}")
    return 0 if all(run["ok"] for run in result["runs"]) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
