"""Predict the headline scenarios of ``docs/scale.md`` on GPU clusters from profiles taken here.

Predictions, not measurements: each model is profiled once on this machine's CPU
(``lightning-parallel plan --model M --profile-json DIR/M.json``), and its compute is then put on
a GPU that runs the counted matrix products and convolutions at ``--tflops`` times
``--utilization`` (:meth:`~lightning_parallel.plan.profile.StepProfile.on_accelerator`); the
communication follows the collective laws of :mod:`lightning_parallel.plan.network`. Run::

    for m in resnet50 vgg16 gpt; do
        lightning-parallel plan --model $m --scale 2 --profile-json profiles/$m.json
    done
    .venv/bin/python examples/plan_scenarios.py --profiles profiles --plot scale.png

It prints one markdown table per scenario (the rows of ``docs/scale.md``) and, with ``--plot``,
predicted samples per second against workers (2 to 1024 hosts) for ResNet-50 at 10 Gbit/s.

A profile taken on a GPU (``plan --accelerator cuda --profile-json``: its notes say
``"accelerator": "cuda"``) is used as it is: its compute and trainer time were measured there,
and ``--tflops``, ``--utilization`` and ``--overhead-ms`` do not apply to it.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from lightning_parallel.bench.plan import strategy_options
from lightning_parallel.plan.network import Cluster
from lightning_parallel.plan.planner import predict, scaling
from lightning_parallel.plan.prediction import Prediction
from lightning_parallel.plan.profile import StepProfile

# (title, model, cluster arguments, SPECs, straggler)
SCENARIOS: list[tuple[str, str, dict[str, Any], list[str], float]] = [
    ("GroPipe and DDP, ResNet-50, one host of 8 GPUs (PCIe 4.0, 32 GB/s)", "resnet50",
     {"hosts": 1, "processes_per_host": 8, "intra_bandwidth": "256gbit", "intra_latency": "10us"},
     ["ddp", "gropipe", "gropipe:stages=4,micro_batches=8"], 1.0),
    ("GroPipe and DDP, VGG-16, one host of 8 GPUs (PCIe 4.0, 32 GB/s)", "vgg16",
     {"hosts": 1, "processes_per_host": 8, "intra_bandwidth": "256gbit", "intra_latency": "10us"},
     ["ddp", "gropipe", "gropipe:stages=4,micro_batches=8"], 1.0),
    ("GroPipe and DDP, VGG-16, 8 hosts of 1 GPU at 10 Gbit/s", "vgg16",
     {"hosts": 8, "bandwidth": "10gbit", "latency": "50us"},
     ["ddp", "gropipe", "gropipe:stages=4,micro_batches=8"], 1.0),
    ("Hylo and PowerSGD, VGG-16, 16 hosts at 10 Gbit/s", "vgg16",
     {"hosts": 16, "bandwidth": "10gbit", "latency": "50us"},
     ["ddp", "ddp_powersgd", "hylo"], 1.0),
    ("Hylo and PowerSGD, VGG-16, 16 hosts at 25 Gbit/s", "vgg16",
     {"hosts": 16, "bandwidth": "25gbit", "latency": "50us"},
     ["ddp", "ddp_powersgd", "hylo"], 1.0),
    ("DiLoCo, GPT, 8 hosts at 1 Gbit/s", "gpt",
     {"hosts": 8, "bandwidth": "1gbit", "latency": "1ms"},
     ["ddp", "model_averaging", "diloco", "diloco:fragments=4,sync_delay=4,outer_dtype=int8"],
     1.0),
    ("Parameter server with a 2x straggler, ResNet-50, 8 hosts at 10 Gbit/s", "resnet50",
     {"hosts": 8, "bandwidth": "10gbit", "latency": "50us"},
     ["ddp", "parameter_server"], 2.0),
]  # fmt: skip


def _row(prediction: Prediction) -> str:
    if prediction.refused is not None:
        return f"| `{prediction.spec}` | refused: {prediction.refused} | | | |"
    return (
        f"| `{prediction.spec}` | {prediction.step_s * 1e3:.1f} | "
        f"{prediction.exposed_comm_s * 1e3:.1f} | {prediction.wire_bytes_per_step / 1e6:.2f} | "
        f"{prediction.samples_per_s:,.0f} |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profiles", type=Path, required=True, help="folder of MODEL.json")
    parser.add_argument("--tflops", type=float, default=156.0, help="A100 TF32 dense: 156")
    parser.add_argument("--utilization", type=float, default=0.4)
    parser.add_argument(
        "--overhead-ms", type=float, default=5.0,
        help="the trainer's own time a step on a GPU host (an assumption; this CPU's is larger)",
    )  # fmt: skip
    parser.add_argument("--plot", type=Path, default=None)
    args = parser.parse_args()
    rate = args.tflops * 1e12 * args.utilization
    profiles: dict[str, StepProfile] = {}
    for title, model, cluster_args, specs, straggler in SCENARIOS:
        if model not in profiles:
            record = json.loads((args.profiles / f"{model}.json").read_text())
            profile = StepProfile.from_dict(record)
            if profile.notes.get("accelerator") != "cuda":
                profile = profile.on_accelerator(rate, overhead_s=args.overhead_ms / 1e3)
            profiles[model] = profile
        cluster = Cluster.parse(**cluster_args)
        strategies = [(text, *strategy_options(text)) for text in specs]
        basis = (
            "compute and trainer time as profiled on the GPU"
            if profiles[model].notes.get("accelerator") == "cuda"
            else f"{args.tflops:g} TFLOP/s at {args.utilization:.0%}, "
            f"{args.overhead_ms:g} ms of trainer time a step"
        )
        print(f"\n**{title}** (prediction; {basis})\n")
        print("| spec | step ms | exposed comm ms | MB/step/host | samples/s (cluster) |")
        print("| --- | --- | --- | --- | --- |")
        for prediction in predict(profiles[model], cluster, strategies, straggler=straggler):
            print(_row(prediction))
    if args.plot is not None:
        _plot(profiles["resnet50"], args.plot)


def _plot(profile: StepProfile, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    specs = ["ddp", "ddp_powersgd", "hylo", "model_averaging", "diloco", "parameter_server",
             "gropipe"]  # fmt: skip
    cluster = Cluster.parse(hosts=2, bandwidth="10gbit", latency="50us")
    strategies = [(text, *strategy_options(text)) for text in specs]
    hosts = [2**k for k in range(1, 11)]
    curves = scaling(profile, cluster, strategies, hosts)
    figure, axis = plt.subplots(figsize=(7, 4.5))
    for spec, curve in curves.items():
        axis.plot([p[0] for p in curve], [p[2] for p in curve], marker="o", label=spec)
    axis.set_xscale("log", base=2)
    axis.set_yscale("log")
    axis.set(xlabel="workers (one GPU a host)", ylabel="predicted samples/s (cluster)")
    axis.set_title("ResNet-50 (32x32 inputs), 10 Gbit/s between hosts: a prediction")
    axis.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
