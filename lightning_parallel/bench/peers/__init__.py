"""Benchmark peers that are not strategy names of this package (pipelining baselines, ...).

Every module in this package is imported before the benchmark resolves a SPEC; a module
registers its names with :func:`lightning_parallel.bench.specs.register_baseline`.
"""

__all__: list[str] = []
