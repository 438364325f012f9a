"""``lightning-parallel cluster``: run any command on N simulated hosts behind shaped links.

Example::

    lightning-parallel cluster --hosts 2 --bandwidth 1gbit --latency 1ms -- \\
        python train.py --trainer.num_nodes=2

With ``--memory-per-host 2GB`` every host's processes share a 2 GB memory cgroup
(:mod:`lightning_parallel.cluster.memory`); a host that needs more loses a process to the
kernel's OOM killer, and the command says which host ran out of memory.
"""

from __future__ import annotations

import argparse
import sys
import warnings
from contextlib import nullcontext

from lightning_parallel.cluster.faults import check_faults, fault_report, parse_fault
from lightning_parallel.cluster.launcher import (
    ClusterInterrupted,
    interrupt_on_signals,
    run_on_hosts,
)
from lightning_parallel.cluster.memory import MemoryCaps
from lightning_parallel.cluster.network import ClusterError, SimulatedNetwork
from lightning_parallel.cluster.units import (
    parse_bandwidth,
    parse_latency,
    parse_memory_size,
    parse_straggler,
)

__all__: list[str] = []

MEMORY_PER_HOST_HELP = (
    "memory size of every host, e.g. 2000MB, 2GB, 1.5GiB (MB/GB: powers of 1000, MiB/GiB: of "
    "1024): each host's processes and their children share one memory cgroup capped there, "
    "swap included (cgroup v2: memory.max and memory.swap.max=0; v1: memory.limit_in_bytes and "
    "memory.memsw.limit_in_bytes); a process the kernel kills at the cap is reported as "
    "'host H ran out of memory: its SIZE cap (--memory-per-host) was reached and the kernel "
    "killed rank R'. Needs root and the memory cgroup controller (default: no cap)"
)


def add_memory_per_host(parser: argparse.ArgumentParser) -> None:
    """The ``--memory-per-host SIZE`` option (``cluster`` and ``bench``), parsed to bytes."""
    parser.add_argument(
        "--memory-per-host",
        type=memory_size_argument,
        default=None,
        metavar="SIZE",
        help=MEMORY_PER_HOST_HELP,
    )


def memory_size_argument(text: str) -> int:
    """``argparse`` type of ``--memory-per-host``: the size in bytes, parsed once at the edge."""
    try:
        return parse_memory_size(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from error


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lightning-parallel cluster",
        description=(
            "Run CMD once per simulated host (each in its own network namespace, linked "
            "through a shaped virtual network) with the multi-node environment Lightning "
            "reads (MASTER_ADDR, MASTER_PORT, NODE_RANK, WORLD_SIZE, LOCAL_RANK, RANK, "
            "GLOO_SOCKET_IFNAME). Needs root and iproute2."
        ),
        usage="%(prog)s [options] -- CMD [ARG ...]",
    )
    parser.add_argument("--hosts", type=int, default=2, help="number of hosts (default 2)")
    parser.add_argument(
        "--bandwidth", default="1gbit", help="link rate per host and direction (tc units)"
    )
    parser.add_argument(
        "--latency", default="0", help="one-way delay added per host, e.g. 1ms (default 0)"
    )
    parser.add_argument(
        "--procs-per-host", type=int, default=1, help="processes per host (LOCAL_RANK 0..K-1)"
    )
    parser.add_argument(
        "--straggler",
        default=None,
        metavar="RANK:FACTOR",
        help="global RANK computes FACTOR times slower (exported as LP_STRAGGLER)",
    )
    parser.add_argument("--master-port", type=int, default=29500)
    parser.add_argument(
        "--threads", type=int, default=1, help="OMP_NUM_THREADS per process (default 1)"
    )
    parser.add_argument(
        "--timeout", type=float, default=None, help="kill everything after this many seconds"
    )
    parser.add_argument(
        "--fault",
        action="append",
        default=[],
        metavar="KIND:TARGET@SECONDS",
        help="inject a fault SECONDS after the start (or @stepN: once the target printed "
        "'[progress] rank R step N' for N or later): kill:RANK (SIGKILL), freeze:RANK "
        "(SIGSTOP) or link:HOST (drop the host's link); repeat for several",
    )
    parser.add_argument(
        "--hang-after",
        type=float,
        default=300.0,
        help="with --fault: a survivor still running and silent (no output line) this many "
        "seconds after the first fault counts as hung and is killed (default 300)",
    )
    add_memory_per_host(parser)
    return parser


def main(argv: list[str]) -> int:
    """Parse ``argv`` (the arguments after ``cluster``), run, return the exit code."""
    parser = _parser()
    if "--" not in argv and any(arg in ("-h", "--help") for arg in argv):
        parser.print_help()
        return 0
    if "--" not in argv:
        parser.print_usage(sys.stderr)
        print("error: give the command to run after `--`", file=sys.stderr)
        return 2
    split = argv.index("--")
    args = parser.parse_args(argv[:split])
    command = argv[split + 1 :]
    try:
        if not command:
            raise ValueError("the command after `--` is empty")
        if args.hosts < 1 or args.procs_per_host < 1 or args.threads < 1:
            raise ValueError("--hosts, --procs-per-host and --threads must be >= 1")
        parse_bandwidth(args.bandwidth)
        parse_latency(args.latency)
        if args.straggler is not None:
            rank, _ = parse_straggler(args.straggler)
            if rank >= args.hosts * args.procs_per_host:
                raise ValueError(
                    f"--straggler rank {rank} does not exist: the world size is "
                    f"{args.hosts * args.procs_per_host}"
                )
        faults = [parse_fault(text) for text in args.fault]
        check_faults(faults, args.hosts, args.hosts * args.procs_per_host)
        if args.hang_after <= 0:
            raise ValueError("--hang-after must be > 0 seconds")
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    warnings.filterwarnings("ignore", "latency .* is NOT emulated", RuntimeWarning)
    warnings.filterwarnings("ignore", "swap is not capped", RuntimeWarning)
    try:
        with (
            interrupt_on_signals(),
            SimulatedNetwork(args.hosts, args.bandwidth, args.latency) as network,
            (
                MemoryCaps(network.prefix, args.hosts, args.memory_per_host)
                if args.memory_per_host is not None
                else nullcontext()
            ) as memory,
        ):
            for note in network.notes + (memory.notes if memory is not None else []):
                print(f"warning: {note}", file=sys.stderr)
            result = run_on_hosts(
                network,
                command,
                procs_per_host=args.procs_per_host,
                master_port=args.master_port,
                threads=args.threads,
                straggler=args.straggler,
                timeout=args.timeout,
                faults=faults,
                hang_after=args.hang_after,
                memory=memory,
            )
    except ClusterError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    except ClusterInterrupted as interrupt:
        removed = "namespaces" + (" and memory cgroups" if args.memory_per_host else "")
        print(f"error: {interrupt}; hosts stopped and {removed} removed", file=sys.stderr)
        return 128 + interrupt.signum
    if faults:
        for line in fault_report(result.faults, result.ends, result.orphans):
            print(f"[faults] {line}", file=sys.stderr)
    if result.returncode != 0:
        print(f"error: {result.message}; its last output:", file=sys.stderr)
        for line in result.tail:
            print(f"  {line}", file=sys.stderr)
    return result.returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
