"""The command line of ``lightning-parallel plan``: the model and data as the bench takes them,
the cluster (given, or measured where the plan is launched: ``--measure``), the profile's
conditions, and where the record, the plot and the profile go. What each does is in
:mod:`lightning_parallel.bench.plan`.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from lightning_parallel.bench.plan_profile import PROFILE_SECONDS
from lightning_parallel.cpu_memory import MALLOC_MODES

__all__: list[str] = []


def plan_parser() -> argparse.ArgumentParser:
    """The parser of ``lightning-parallel plan``'s arguments."""
    parser = argparse.ArgumentParser(
        prog="lightning-parallel plan",
        description="Predict each strategy's step time, bytes per step per host and peak "
        "memory per rank for a model on a cluster, from one profile taken in this process.",
    )
    parser.add_argument("-s", "--spec", action="append", default=[], metavar="SPEC")
    parser.add_argument("--model", default="vgg_mini", help="as bench's --model")
    parser.add_argument("--data", default=None, help="as bench's --data")
    parser.add_argument("--batch-size", type=int, default=32, help="per process")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--hosts", type=int, default=2)
    parser.add_argument("--procs-per-host", "--devices", dest="procs_per_host", type=int, default=1)
    parser.add_argument(
        "--bandwidth", default="1gbit", help="between hosts, per host and direction"
    )
    parser.add_argument("--latency", default="1ms", help="one way, between hosts")
    parser.add_argument(
        "--message-latency",
        default=None,
        help="one way, a point-to-point message between hosts (default: --latency)",
    )
    parser.add_argument(
        "--busy-receive",
        default=None,
        help="what a large request takes longer into a host whose ranks compute (default 0; "
        "--measure measures it)",
    )
    parser.add_argument("--intra-bandwidth", default=None, help="between processes of a host")
    parser.add_argument("--intra-latency", default=None)
    parser.add_argument("--hosts-per-link", type=int, default=1, help="hosts sharing an uplink")
    parser.add_argument(
        "--measure",
        action="store_true",
        help="measure the links (bandwidth, latency) between the processes of the world this "
        "plan is launched in, e.g. under torchrun on every host, and plan for those hosts: "
        "rank 0 plans, the other ranks stop after the measurement",
    )
    parser.add_argument(
        "--framing",
        choices=("veth", "ethernet"),
        default="veth",
        help="what the interface counters count: veth (the simulated hosts: one header a GSO "
        "packet) or ethernet (a NIC counting every segment, an ACK every second one)",
    )
    parser.add_argument(
        "--straggler",
        type=float,
        default=1.0,
        metavar="FACTOR",
        help="one worker computes FACTOR times slower (the bench's --straggler RANK:FACTOR)",
    )
    parser.add_argument("--threads", type=int, default=1, help="torch threads while profiling")
    parser.add_argument(
        "--malloc",
        choices=MALLOC_MODES,
        default="held",
        help="held: profile with freed memory held (lightning_parallel.hold_freed_memory), as "
        "bench ranks run; system: the C library's defaults",
    )
    parser.add_argument(
        "--accelerator",
        choices=("cpu", "cuda"),
        default="cpu",
        help="where the profile runs: cpu, or cuda (this process's GPU: the compute measured "
        "there, not projected from a rate as --accelerator-tflops does)",
    )
    parser.add_argument(
        "--accelerator-tflops",
        type=float,
        default=None,
        help="predict for a device that runs the model's matrix products and convolutions at "
        "this many TFLOP/s at peak (e.g. 989 for an H100's dense bf16), instead of this "
        "machine's measured compute: a labelled prediction, see --utilization",
    )
    parser.add_argument(
        "--utilization",
        type=float,
        default=0.4,
        help="share of --accelerator-tflops the model reaches (default 0.4)",
    )
    parser.add_argument(
        "--profile-steps", type=int, default=8, help="the least steps of the profile's fit"
    )
    parser.add_argument(
        "--profile-seconds",
        type=float,
        default=PROFILE_SECONDS,
        help="the profile's fit runs until its timed steps add up to this (and its steps)",
    )
    parser.add_argument(
        "--scale", default="2,4,8,16,32,64,128,256,512,1024",
        help="host counts for the scaling plot and JSON",
    )  # fmt: skip
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--plot", type=Path, default=None)
    parser.add_argument("--profile-json", type=Path, default=None, help="write the profile here")
    parser.add_argument("--from-profile", type=Path, default=None, help="plan from this profile")
    return parser
