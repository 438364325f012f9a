"""Benchmark strategies on a simulated cluster: runner, SPEC parsing, table, JSON and plot."""

from lightning_parallel.bench.report import plot, print_table, table, write_json
from lightning_parallel.bench.runner import BenchConfig, run_benchmark, run_spec
from lightning_parallel.bench.specs import (
    Spec,
    available,
    build_strategy,
    parse_spec,
    parse_value,
    register_baseline,
    resolve,
)
from lightning_parallel.bench.summary import summarize

__all__ = [
    "BenchConfig",
    "Spec",
    "available",
    "build_strategy",
    "parse_spec",
    "parse_value",
    "plot",
    "print_table",
    "register_baseline",
    "resolve",
    "run_benchmark",
    "run_spec",
    "summarize",
    "table",
    "write_json",
]
