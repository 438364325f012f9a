"""``lightning-parallel plan``: predict each strategy's step time, bytes and memory for a model on
a cluster, from one profile taken in this process.

Example::

    lightning-parallel plan --model vgg_mini --data digits --hosts 2 --bandwidth 100mbit \\
        --latency 1ms -s ddp -s hylo -s diloco -s gropipe --json plan.json --plot plan.png

How the profile is taken (one process, ``--threads`` torch threads, one per process as the
bench runs them; :mod:`lightning_parallel.bench.plan_profile`):

1. the model and data are built as the bench builds them (bundled names or class paths with
   init arguments, :mod:`lightning_parallel.bench.modules`);
2. a real ``fit`` of at least ``--profile-steps`` steps, and on until its timed steps add up
   to ``--profile-seconds``, runs under ``ddp`` on this one process, timed step by step as the
   bench times a step (its probe): the trainer's own time per step and the process's peak
   memory come from it;
3. the plain-torch profile (:func:`lightning_parallel.plan.measure.profile_step`) times the
   forward, backward and optimizer step of ``training_step`` on one batch, and, where a
   pipeline is asked for, the per-layer costs of the chain it would split
   (:func:`lightning_parallel.plan.measure.pipeline_layers`).

``--measure`` takes the hosts and links from the world the plan is launched in instead of the
arguments (every host starts it, e.g. under ``torchrun``; rank 0 plans): the links' bandwidth
and latency are fitted from allreduces timed there (:mod:`lightning_parallel.bench.links`).

``--profile-json`` keeps the profile; ``--from-profile`` plans from a kept one (another
cluster without profiling again). The strategies' options are the registered defaults merged
with each SPEC's, as the bench builds them.
"""

from __future__ import annotations

import argparse
import inspect
import json
import math
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

from lightning_parallel.bench.plan_arguments import plan_parser
from lightning_parallel.bench.plan_profile import PROFILE_SECONDS

__all__: list[str] = []


def strategy_options(spec_text: str) -> tuple[str, dict[str, Any]]:
    """The strategy name of ``spec_text`` and its options as the bench builds it: the
    constructor's defaults, the registered ones over them, the SPEC's over those."""
    from lightning_parallel.bench.specs import parse_spec, resolve, split_trainer_options

    spec, _ = split_trainer_options(parse_spec(spec_text))
    try:
        constructor, kwargs = resolve(spec)
    except ValueError:
        return spec.name, dict(spec.options)
    defaults: dict[str, Any] = {}
    try:
        for parameter in inspect.signature(constructor).parameters.values():
            if parameter.default is not inspect.Parameter.empty:
                defaults[parameter.name] = parameter.default
    except (TypeError, ValueError):
        pass
    return spec.name, {**defaults, **kwargs}


def _micro_batch_counts(strategies: list[tuple[str, str, dict[str, Any]]]) -> list[int]:
    counts = {1}  # the whole batch: DDP's gradient readiness
    for _, name, options in strategies:
        if name == "gropipe":
            counts.add(int(options.get("micro_batches", 4)))
        if name == "spectrain":
            counts.add(int(options.get("micro_batches", 1)))
    return sorted(counts)


def take_profile(
    args: argparse.Namespace, strategies: list[tuple[str, str, dict[str, Any]]]
) -> Any:
    """Build the model and data the arguments name, and profile them."""
    import pytorch_lightning as pl

    from lightning_parallel.bench.modules import build
    from lightning_parallel.bench.plan_profile import profile_module
    from lightning_parallel.demo import default_data

    pl.seed_everything(args.seed, workers=True, verbose=False)
    data_text = args.data or default_data(args.model.partition(":")[0])
    model, datamodule = build(args.model, data_text, args.batch_size, args.seed)
    profile = profile_module(
        model, datamodule, micro_batches=_micro_batch_counts(strategies),
        steps=args.profile_steps, seconds=args.profile_seconds, threads=args.threads,
        seed=args.seed,
        accelerator=args.accelerator, hold_memory=args.malloc == "held",
    )  # fmt: skip
    return replace(profile, notes={**profile.notes, "model": args.model, "data": data_text})


def plan(
    model: Any,
    datamodule: Any,
    cluster: Any,
    specs: list[str] | tuple[str, ...] | None = None,
    *,
    steps: int = 8,
    seconds: float = PROFILE_SECONDS,
    threads: int = 1,
    accelerator: str = "cpu",
) -> list[Any]:
    """Predict each strategy of ``specs`` (default: one of each family) for ``model`` trained on
    ``datamodule`` on ``cluster`` (a :class:`~lightning_parallel.plan.network.Cluster`), fastest
    first: a list of :class:`~lightning_parallel.plan.prediction.Prediction`. The profile runs
    on ``accelerator`` ("cpu", or "cuda": this process's GPU), in this process, which holds the
    memory it frees from then on (:func:`~lightning_parallel.cpu_memory.hold_freed_memory`, as
    a bench rank does).

    Example::

        from lightning_parallel.bench.plan import plan
        from lightning_parallel.plan.network import Cluster

        cluster = Cluster.parse(hosts=8, processes_per_host=1, bandwidth="10gbit", latency="50us")
        for prediction in plan(MyModule(), MyData(), cluster, ["ddp", "hylo", "diloco"]):
            print(prediction.spec, prediction.step_s, prediction.wire_bytes_per_step)
    """
    from lightning_parallel.bench.plan_profile import profile_module
    from lightning_parallel.plan.planner import DEFAULT_SPECS, predict, ranked

    texts = list(specs or DEFAULT_SPECS)
    strategies = [(text, *strategy_options(text)) for text in texts]
    profile = profile_module(
        model, datamodule, micro_batches=_micro_batch_counts(strategies), steps=steps,
        seconds=seconds, threads=threads, accelerator=accelerator,
    )  # fmt: skip
    return ranked(predict(profile, cluster, strategies))


def cluster_of(args: argparse.Namespace) -> Any:
    """The cluster the arguments describe."""
    from lightning_parallel.plan.framing import ETHERNET, VETH
    from lightning_parallel.plan.network import Cluster

    cluster = Cluster.parse(
        hosts=args.hosts,
        processes_per_host=args.procs_per_host,
        bandwidth=args.bandwidth,
        latency=args.latency,
        intra_bandwidth=args.intra_bandwidth,
        intra_latency=args.intra_latency,
        hosts_per_link=args.hosts_per_link,
        message_latency=args.message_latency,
        busy_receive=args.busy_receive,
    )
    return replace(cluster, framing=ETHERNET if args.framing == "ethernet" else VETH)


def predictions_for(
    profile: dict[str, Any],
    specs: list[str],
    *,
    hosts: int,
    processes_per_host: int,
    bandwidth: str,
    latency: str,
    steps: int | None = None,
    burst_bytes: float = 0.0,
    intra_bandwidth: str | None = None,
    intra_latency: str | None = None,
    message_latency: str | None = None,
    busy_receive: str | None = None,
    warmup_steps: int = 0,
) -> list[dict[str, Any]]:
    """The predictions (JSON records, fastest first) for ``specs`` from a profile's record on
    the cluster given (no profiling: a plan for another cluster is instant); ``steps``: the
    run's length, whose one-off bytes then count per step as the bench counts them;
    ``burst_bytes``: the links' token bucket (the bench's simulated hosts); ``intra_*``: the
    link inside a host (default: :class:`~lightning_parallel.plan.network.Cluster`'s);
    ``message_latency``: a point-to-point message's between hosts (default: ``latency``);
    ``busy_receive``: what a large request takes longer into a computing host (default 0);
    ``warmup_steps``: each rank's first steps the bench leaves out of its rates."""
    from lightning_parallel.plan.network import Cluster
    from lightning_parallel.plan.planner import predict, ranked
    from lightning_parallel.plan.profile import StepProfile

    strategies = [(text, *strategy_options(text)) for text in specs]
    cluster = Cluster.parse(
        hosts=hosts, processes_per_host=processes_per_host, bandwidth=bandwidth,
        latency=latency, burst_bytes=burst_bytes, intra_bandwidth=intra_bandwidth,
        intra_latency=intra_latency, message_latency=message_latency,
        busy_receive=busy_receive,
    )  # fmt: skip
    loaded = StepProfile.from_dict(profile)
    run = run_length(loaded, cluster.world, steps, warmup_steps)
    predictions = ranked(predict(loaded, cluster, strategies, run))
    return [p.as_dict() for p in predictions]


def run_length(profile: Any, world: int, steps: int | None, warmup_steps: int = 0) -> Any:
    """A run of ``steps`` steps (``None``: the steady state) with the epoch length of the
    profile's data split over ``world`` ranks (as a distributed sampler splits it); the bench
    leaves each rank's first ``warmup_steps`` out of its rates."""
    from lightning_parallel.plan.prediction import RunLength

    samples = profile.notes.get("train_samples")
    epoch = None
    if samples:
        per_rank = math.ceil(samples / world)  # a distributed sampler pads to equal shares
        whole = per_rank // profile.batch_size
        epoch = (
            whole if profile.notes.get("drop_last") else math.ceil(per_rank / profile.batch_size)
        )
    validation = profile.notes.get("validation_samples")
    return RunLength(
        steps=steps,
        epoch_steps=epoch,
        train_samples=samples or None,
        validation_samples=validation or None,
        drop_last=bool(profile.notes.get("drop_last")),
        warmup_steps=warmup_steps,
    )


def measure_into(args: argparse.Namespace) -> bool:
    """``--measure``: measure the launched world's links
    (:func:`~lightning_parallel.bench.links.join_and_measure`) and put its hosts and links in
    ``args``; whether this rank goes on to plan (rank 0)."""
    from lightning_parallel.bench.links import (
        busy_receive_text,
        join_and_measure,
        link_texts,
        message_latency_text,
    )

    measured = join_and_measure(args.accelerator)
    if measured is None:
        return False
    args.hosts, args.procs_per_host = measured["hosts"], measured["processes_per_host"]
    inter, intra = link_texts(measured, "inter"), link_texts(measured, "intra")
    if inter is not None:
        args.bandwidth, args.latency = inter
        args.message_latency = message_latency_text(measured)
        args.busy_receive = busy_receive_text(measured)
    if intra is not None:
        args.intra_bandwidth, args.intra_latency = intra
    args.measured_links = measured
    return True


def run_plan(args: argparse.Namespace) -> dict[str, Any]:
    """Profile (or load a profile), predict, and return the plan's JSON record."""
    from lightning_parallel.plan.planner import DEFAULT_SPECS, predict, ranked, scaling
    from lightning_parallel.plan.profile import StepProfile

    texts = args.spec or list(DEFAULT_SPECS)
    strategies = [(text, *strategy_options(text)) for text in texts]
    if args.from_profile is not None:
        profile = StepProfile.from_dict(json.loads(args.from_profile.read_text()))
    else:
        profile = take_profile(args, strategies)
    if args.profile_json is not None:
        args.profile_json.write_text(json.dumps(profile.as_dict()))
    if args.accelerator_tflops is not None:
        profile = profile.on_accelerator(args.accelerator_tflops * 1e12 * args.utilization)
    cluster = cluster_of(args)
    predictions = ranked(predict(profile, cluster, strategies, straggler=args.straggler))
    hosts = [int(h) for h in str(args.scale).split(",") if h.strip()]
    curves = scaling(profile, cluster, strategies, hosts, straggler=args.straggler)
    return {
        "cluster": {
            "hosts": cluster.hosts, "processes_per_host": cluster.processes_per_host,
            "bandwidth": args.bandwidth, "latency": args.latency, "straggler": args.straggler,
            "message_latency": args.message_latency, "busy_receive": args.busy_receive,
            "intra_bandwidth": args.intra_bandwidth, "intra_latency": args.intra_latency,
            # --measure: the probe's timings and fits
            "measured": getattr(args, "measured_links", None),
        },
        "model": profile.notes.get("model", args.model),
        "batch_size": profile.batch_size,
        "compute": f"measured on this machine's {profile.notes.get('accelerator', 'cpu')}"
        if args.accelerator_tflops is None
        else f"predicted: {args.accelerator_tflops:g} TFLOP/s at {args.utilization:.0%}",
        "profile": {
            "forward_s": profile.forward_s, "backward_s": profile.backward_s,
            "flops": profile.flops,
            # the counted operations' rate the forward and backward reached: against a
            # device's peak, the utilization that --accelerator-tflops would need
            "counted_tflops_per_s": profile.flops
            / max(1e-12, profile.forward_s + profile.backward_s) / 1e12,
            "optimizer_s": profile.optimizer_s, "trainer_step_s": profile.trainer_step_s,
            "parameter_bytes": profile.parameter_bytes,
            "peak_rss_mb": None
            if profile.peak_rss_bytes is None
            else profile.peak_rss_bytes / 2**20,
            "pipeline_error": profile.pipeline_error,
            "freed_memory_held": profile.notes.get("freed_memory_held"),
            "accelerator": profile.notes.get("accelerator", "cpu"),
        },
        "predictions": [p.as_dict() for p in predictions],
        "scaling": {spec: [list(point) for point in curve] for spec, curve in curves.items()},
    }  # fmt: skip


def plot(record: dict[str, Any], path: Path) -> None:
    """Predicted step time against workers, one line per strategy (log-log)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(7, 4.5))
    for spec, curve in record["scaling"].items():
        if curve:
            axis.plot([p[0] for p in curve], [p[1] for p in curve], marker="o", label=spec)
    axis.set_xscale("log", base=2)
    axis.set_yscale("log")
    axis.set_xlabel("workers")
    axis.set_ylabel("predicted step (s, median)")
    cluster = record["cluster"]
    axis.set_title(
        f"{record['model']}: {cluster['bandwidth']}, {cluster['latency']} between hosts "
        "(prediction)"
    )
    axis.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def links_text(cluster: dict[str, Any]) -> str:
    """The cluster of a plan's record in words, with only the links its processes use: between
    hosts where there are 2 or more, inside a host where a host runs 2 processes or more (the
    given or measured link, else :data:`~lightning_parallel.plan.network.INTRA_HOST`)."""
    from lightning_parallel.plan.network import INTRA_HOST

    hosts, per_host = int(cluster["hosts"]), int(cluster["processes_per_host"])
    text = f"{hosts} host{'s' if hosts != 1 else ''} x {per_host}"
    links = []
    if hosts > 1:
        links.append(f"between hosts {cluster['bandwidth']}, {cluster['latency']}")
    if per_host > 1:
        bandwidth = cluster.get("intra_bandwidth") or INTRA_HOST[0]
        latency = cluster.get("intra_latency") or INTRA_HOST[1]
        links.append(f"inside a host {bandwidth}, {latency}")
    return f"{text} ({'; '.join(links)})" if links else text


def main(argv: list[str]) -> int:
    """Parse ``argv`` (after ``plan``), plan, print the ranked table; 0 on success."""
    from lightning_parallel.cpu_memory import HELD_NOTE
    from lightning_parallel.plan.planner import table
    from lightning_parallel.plan.prediction import Prediction

    args = plan_parser().parse_args(argv)
    try:
        if args.measure and not measure_into(args):
            return 0  # a rank other than 0: its part was the measurement
        record = run_plan(args)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    predictions = [Prediction(**p) for p in record["predictions"]]
    cluster = record["cluster"]
    print(
        f"plan for {record['model']} (batch {record['batch_size']} per process) on "
        f"{links_text(cluster)}: predictions, fastest first"
    )
    print(table(predictions))
    # the advice is for training on this CPU as it was timed, not for a plan on an accelerator
    on_cpu = record["profile"]["accelerator"] == "cpu" and args.accelerator_tflops is None
    if record["profile"]["freed_memory_held"] and on_cpu:
        print(HELD_NOTE)
    if args.json is not None:
        args.json.write_text(json.dumps(record, indent=1))
        print(f"wrote {args.json}")
    if args.plot is not None:
        plot(record, args.plot)
        print(f"wrote {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
