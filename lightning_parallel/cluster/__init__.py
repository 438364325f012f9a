"""A simulated multi-host cluster on one machine: network namespaces behind shaped links."""

from lightning_parallel.cluster.launcher import (
    STRAGGLER_ENV,
    ClusterInterrupted,
    ClusterRun,
    cluster_environment,
    interrupt_on_signals,
    run_on_hosts,
)
from lightning_parallel.cluster.network import (
    ClusterError,
    Host,
    SimulatedNetwork,
    check_requirements,
    leftovers,
    netns_unavailable_reason,
    remove_stale,
)
from lightning_parallel.cluster.units import (
    format_bandwidth,
    parse_bandwidth,
    parse_latency,
    parse_straggler,
)

__all__ = [
    "STRAGGLER_ENV",
    "ClusterError",
    "ClusterInterrupted",
    "ClusterRun",
    "Host",
    "SimulatedNetwork",
    "check_requirements",
    "cluster_environment",
    "format_bandwidth",
    "interrupt_on_signals",
    "leftovers",
    "netns_unavailable_reason",
    "parse_bandwidth",
    "parse_latency",
    "parse_straggler",
    "remove_stale",
    "run_on_hosts",
]
