"""A simulated multi-host cluster on one machine: network namespaces behind shaped links, and
optionally a memory size per host (memory cgroups)."""

from lightning_parallel.cluster.cgroups import detect_hierarchy, memory_unavailable_reason
from lightning_parallel.cluster.launcher import (
    STRAGGLER_ENV,
    ClusterInterrupted,
    ClusterRun,
    cluster_environment,
    interrupt_on_signals,
    run_on_hosts,
)
from lightning_parallel.cluster.local import LocalHosts, free_port
from lightning_parallel.cluster.memory import MemoryCaps, OutOfMemory
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
    format_memory_size,
    parse_bandwidth,
    parse_latency,
    parse_memory_size,
    parse_straggler,
)

__all__ = [
    "STRAGGLER_ENV",
    "ClusterError",
    "ClusterInterrupted",
    "ClusterRun",
    "Host",
    "LocalHosts",
    "MemoryCaps",
    "OutOfMemory",
    "SimulatedNetwork",
    "check_requirements",
    "cluster_environment",
    "detect_hierarchy",
    "format_bandwidth",
    "format_memory_size",
    "free_port",
    "interrupt_on_signals",
    "leftovers",
    "memory_unavailable_reason",
    "netns_unavailable_reason",
    "parse_bandwidth",
    "parse_latency",
    "parse_memory_size",
    "parse_straggler",
    "remove_stale",
    "run_on_hosts",
]
