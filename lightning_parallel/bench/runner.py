"""Run every SPEC on a fresh simulated cluster and collect one BENCH.md record per run.

For each SPEC, in order:

1. the name is resolved first (a bad SPEC is recorded as a failed run at once);
2. a new :class:`~lightning_parallel.cluster.SimulatedNetwork` is built with the configured
   hosts, bandwidth and latency, so no run inherits another's queues or counters;
3. the worker (``python -m lightning_parallel.bench.worker``) runs on every process slot with
   the same model, data, seed, batch size and steps; its output goes to a log file;
4. the per-rank JSON files are summarized
   (:func:`~lightning_parallel.bench.summary.summarize`); a run whose process failed or wrote
   no record is kept with ``ok: false`` and the error, and the next SPEC runs; where a
   process reports that the strategy declined the model or its settings (a clean error before
   the first step, see :mod:`~lightning_parallel.bench.worker`) the run has ``refused: true``
   and the reason as its error.

With ``network="local"`` step 2 builds :class:`~lightning_parallel.cluster.LocalHosts` instead:
every host is a set of plain processes of this machine on loopback, unshaped, with no root
needed; ``wire_bytes_per_step`` is then ``null`` (loopback carries every host's traffic) and
link faults are refused. It times compute and the strategies' own overheads where namespaces or
``tc`` are missing (e.g. a GPU machine's image without iproute2).

With ``memory_per_host`` every host of step 2 also gets a memory cgroup of that size
(:class:`~lightning_parallel.cluster.MemoryCaps`); a run whose process the kernel killed at the
cap is recorded with ``ok: false``, the error ``host H ran out of memory: its SIZE cap
(--memory-per-host) was reached and the kernel killed rank R`` and ``extra.out_of_memory``.

Figures (see ``BENCH.md``): how a run's record pools its ranks' records is
:mod:`~lightning_parallel.bench.summary`'s docstring.
"""

from __future__ import annotations

import json
import re
import sys
import tempfile
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from lightning_parallel.bench.fault_outcome import fault_error, fault_outcome, spec_timeout_s
from lightning_parallel.bench.specs import build_strategy, parse_spec, split_trainer_options
from lightning_parallel.bench.summary import failed_record, summarize
from lightning_parallel.cluster.cgroups import check_memory_requirements
from lightning_parallel.cluster.faults import check_faults, parse_fault
from lightning_parallel.cluster.launcher import run_on_hosts
from lightning_parallel.cluster.local import UNSHAPED, LocalHosts, free_port
from lightning_parallel.cluster.memory import MemoryCaps
from lightning_parallel.cluster.network import SimulatedNetwork, check_requirements
from lightning_parallel.cluster.units import (
    MIN_MEMORY_BYTES,
    parse_bandwidth,
    parse_latency,
    parse_straggler,
)
from lightning_parallel.cpu_memory import MALLOC_MODES

__all__: list[str] = []


@dataclass
class BenchConfig:
    """What every run of one benchmark shares: network, model, data, steps, seed.

    Exactly one of ``max_steps`` and ``epochs`` is set. ``memory_per_host`` is every host's
    memory size in bytes (``None``: no cap).
    """

    hosts: int = 2
    bandwidth: str = "1gbit"
    latency: str = "1ms"
    model: str = "vgg_mini"
    data: str = "digits"
    max_steps: int | None = 200
    epochs: int | None = None
    batch_size: int = 32
    seed: int = 0
    target_acc: float = 0.9
    straggler: str | None = None
    procs_per_host: int = 1
    accelerator: str = "cpu"
    warmup_steps: int = 5
    timeout: float = 900.0
    faults: list[str] = field(default_factory=list)
    memory_per_host: int | None = None
    network: str = "netns"
    malloc: str = "held"

    def validate(self) -> None:
        """Raise ``ValueError`` naming the fix for any inconsistent setting."""
        if self.hosts < 1 or self.procs_per_host < 1:
            raise ValueError("hosts and procs_per_host must be >= 1")
        if self.network not in NETWORKS:
            raise ValueError(f"network must be one of {', '.join(NETWORKS)}, got {self.network!r}")
        if self.network == "local" and any(parse_fault(f).kind == "link" for f in self.faults):
            raise ValueError(
                "a link fault needs --network netns: loopback hosts share one link (kill and "
                "freeze faults work on --network local)"
            )
        if self.malloc not in MALLOC_MODES:
            raise ValueError(
                f"malloc must be one of {', '.join(MALLOC_MODES)}, got {self.malloc!r}"
            )
        if self.accelerator not in ("cpu", "cuda"):
            raise ValueError(f"accelerator must be 'cpu' or 'cuda', got {self.accelerator!r}")
        if (self.max_steps is None) == (self.epochs is None):
            raise ValueError("give exactly one of max_steps and epochs")
        if (self.max_steps is not None and self.max_steps < 1) or (
            self.epochs is not None and self.epochs < 1
        ):
            raise ValueError("max_steps / epochs must be >= 1")
        if self.batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {self.batch_size}")
        if not 0.0 < self.target_acc <= 1.0:
            raise ValueError(f"target_acc must be in (0, 1], got {self.target_acc}")
        if self.warmup_steps < 0:
            raise ValueError(f"warmup_steps must be >= 0, got {self.warmup_steps}")
        if self.memory_per_host is not None and self.memory_per_host < MIN_MEMORY_BYTES:
            raise ValueError(
                f"memory_per_host must be at least 1 MiB (in bytes), got {self.memory_per_host}"
            )
        parse_bandwidth(self.bandwidth)
        parse_latency(self.latency)
        check_faults([parse_fault(f) for f in self.faults], self.hosts, self.world_size)
        if self.straggler is not None:
            rank, _ = parse_straggler(self.straggler)
            if rank >= self.world_size:
                raise ValueError(
                    f"straggler rank {rank} does not exist: the world size is {self.world_size}"
                )

    @property
    def world_size(self) -> int:
        return self.hosts * self.procs_per_host


def _worker_command(spec: str, config: BenchConfig, output: Path) -> list[str]:
    command = [
        sys.executable, "-m", "lightning_parallel.bench.worker",
        "--spec", spec, "--model", config.model, "--data", config.data,
        "--batch-size", str(config.batch_size), "--seed", str(config.seed),
        "--output", str(output), "--accelerator", config.accelerator,
        "--malloc", config.malloc,
    ]  # fmt: skip
    if config.max_steps is not None:
        command += ["--max-steps", str(config.max_steps)]
    else:
        command += ["--epochs", str(config.epochs)]
    if config.faults:
        command += ["--progress-every", str(PROGRESS_EVERY_S)]
    return command


# seconds of silence past the strategy's timeout after which a survivor of a fault counts as
# hung: the bar is timeout + 30 s; waiting 30 s more shows by how much a late rank misses it
HANG_MARGIN_S = 60.0
NETWORKS = ("netns", "local")  # simulated hosts behind shaped links, or processes on loopback
# with faults, each rank prints a progress line this often: a rank that goes on without the
# lost one is seen to work
PROGRESS_EVERY_S = 10.0


def bench_hosts(config: BenchConfig) -> AbstractContextManager[Any]:
    """The hosts of one run, fresh: a :class:`~lightning_parallel.cluster.SimulatedNetwork`
    (``network="netns"``) or :class:`~lightning_parallel.cluster.LocalHosts` on loopback."""
    if config.network == "netns":
        return SimulatedNetwork(config.hosts, config.bandwidth, config.latency)
    return nullcontext(LocalHosts(config.hosts))


def master_port(config: BenchConfig) -> int:
    """The rendezvous port of a run on :func:`bench_hosts`: a fixed one inside the namespaces,
    a free one on loopback (which other processes share)."""
    return 29500 if config.network == "netns" else free_port()


def run_spec(spec: str, config: BenchConfig, log_dir: Path) -> dict[str, Any]:
    """Train under ``spec`` on a fresh simulated cluster; the run's BENCH.md record."""
    started = time.perf_counter()
    try:
        name = parse_spec(spec).name
        # bad names and options fail here, before a cluster is built
        build_strategy(split_trainer_options(parse_spec(spec))[0])
        parse_spec(config.model)
        parse_spec(config.data)
    except (ValueError, TypeError) as error:
        return failed_record(spec, spec.split(":")[0], config.world_size, str(error))
    log_path = log_dir / (re.sub(r"[^A-Za-z0-9_.=-]+", "_", spec) + ".log")
    with tempfile.TemporaryDirectory(prefix="lp-bench-") as directory, log_path.open("w") as log:
        output = Path(directory)
        faults = [parse_fault(text) for text in config.faults]
        timeout_s = spec_timeout_s(spec)
        with (
            bench_hosts(config) as network,
            (
                MemoryCaps(network.prefix, config.hosts, config.memory_per_host)
                if config.memory_per_host is not None
                else nullcontext()
            ) as memory,
        ):
            result = run_on_hosts(
                network,
                _worker_command(spec, config, output),
                procs_per_host=config.procs_per_host,
                straggler=config.straggler,
                timeout=config.timeout,
                output=log,
                faults=faults,
                hang_after=timeout_s + HANG_MARGIN_S if faults else None,
                memory=memory,
                master_port=master_port(config),
            )
            latency_emulated = network.latency_emulated
        records = [json.loads(path.read_text()) for path in sorted(output.glob("rank*.json"))]
    extra: dict[str, Any] = {"log": str(log_path), "total_s": time.perf_counter() - started}
    if result.out_of_memory:
        extra["out_of_memory"] = [asdict(oom) for oom in result.out_of_memory]
    if result.first_fault_s is not None:
        outcome = fault_outcome(result, records, timeout_s)
        ended = [r["end_s"] for r in outcome["ranks"] if not r["faulted"] and r["end_s"]]
        finished = [r for r in records if r.get("ok")]
        if outcome["survivors_within_bar"] and all(
            r["went_on"] for r in outcome["ranks"] if not r["faulted"]
        ):
            # the strategy went on without the faulted ranks and finished
            run = summarize(spec, name, finished, config)
            run["extra"].update(extra, **outcome, latency_emulated=latency_emulated)
            return run
        report = fault_error(outcome)
        if result.out_of_memory:
            report = f"{result.out_of_memory[0].describe()}\n{report}"
        failed = failed_record(spec, name, config.world_size, report, **extra, **outcome)
        failed["wall_s"] = max(ended) if ended else None
        return failed
    failing = [r for r in records if not r.get("ok")]
    if any(r.get("refused") for r in failing):
        # the strategy declined the model or its settings: the reason, not the other ranks'
        # lost connections that follow it
        reasons = sorted({r["error"] for r in failing if r.get("refused")})
        refusal = failed_record(spec, name, config.world_size, "\n".join(reasons), **extra)
        refusal["refused"] = True
        return refusal
    errors = [f"rank {r['rank']}: {r['error']}" for r in failing]
    if result.returncode != 0 or errors or len(records) != config.world_size:
        lines = [result.message if result.returncode else "a process failed"]
        if result.returncode:
            lines += [f"  {line}" for line in result.tail[-12:] if line.strip()]
        lines += errors or [f"{len(records)} of {config.world_size} processes wrote a record"]
        return failed_record(spec, name, config.world_size, "\n".join(lines), **extra)
    run = summarize(spec, name, records, config)
    run["extra"].update(extra, latency_emulated=latency_emulated)
    return run


def run_benchmark(
    specs: list[str],
    config: BenchConfig,
    log_dir: Path | None = None,
    progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Run every SPEC in turn; the BENCH.md object (``config`` and ``runs``).

    Raises:
        ValueError: an inconsistent configuration, or a model or data class path that cannot
            be imported, is not a Lightning class or rejects its arguments (before anything
            runs).
        ClusterError: the simulated cluster cannot run here (not root, no iproute2, or no
            memory cgroup controller when ``memory_per_host`` is set).
    """
    import pytorch_lightning
    import torch

    from lightning_parallel.bench.modules import check

    config.validate()
    check(config.model, config.data, config.batch_size, config.seed)
    if config.accelerator == "cuda" and not torch.cuda.is_available():
        raise ValueError("--accelerator cuda: this machine has no CUDA device; use cpu")
    if not specs:
        raise ValueError("give at least one SPEC, e.g. -s ddp")
    if config.network == "netns":
        check_requirements()
    if config.memory_per_host is not None:
        check_memory_requirements()
    log_dir = log_dir or Path(tempfile.mkdtemp(prefix="lightning-parallel-bench-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    say = progress or (lambda line: None)
    runs = []
    for index, spec in enumerate(specs, 1):
        where = "simulated" if config.network == "netns" else "loopback"
        say(f"[{index}/{len(specs)}] {spec}: training on {config.hosts} {where} hosts ...")
        run = run_spec(spec, config, log_dir)
        verdict = "REFUSED" if run.get("refused") else "FAILED"
        first = (str(run["error"]).strip().splitlines() or [""])[0][:200]
        status = "ok" if run["ok"] else f"{verdict} ({first})"
        say(f"[{index}/{len(specs)}] {spec}: {status} in {run['extra'].get('total_s', 0):.0f} s")
        runs.append(run)
    settings = asdict(config)
    described = {
        "hosts": config.hosts,
        "bandwidth": config.bandwidth,
        "latency": config.latency,
        "model": config.model,
        "data": config.data,
        "max_steps": config.max_steps,
        "seed": config.seed,
        "straggler": config.straggler,
        "torch": torch.__version__.split("+")[0],
        "lightning": pytorch_lightning.__version__,
        "cores": _cores(),
    }
    if config.network == "local":
        described.update(bandwidth=UNSHAPED, latency="0")
    described.update({k: v for k, v in settings.items() if k not in described})
    described["latency_emulated"] = all(
        r["extra"].get("latency_emulated", True) for r in runs if r["ok"]
    )
    described["log_dir"] = str(log_dir)
    return {"config": described, "runs": runs}


def _cores() -> int:
    import os

    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
