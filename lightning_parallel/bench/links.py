"""The links a plan takes, measured where the training will run (``plan --measure``, and
``bench --predict`` on its hosts): :mod:`lightning_parallel.plan.link_probe` run as one rank of
a launched world.

1. ``plan --measure`` under a launcher (``torchrun --nnodes H --nproc-per-node K``, or any
   that sets ``RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR`` and
   ``MASTER_PORT``): every rank joins a process group, the links are measured
   (:func:`join_and_measure`), and rank 0 goes on to profile and plan for the hosts the launch
   had, with the measured bandwidths and latencies; the other ranks stop there.
2. ``bench --predict``: before the runs, the probe runs on the bench's own hosts
   (:func:`probe_hosts`), the simulated ones or loopback, launched as the runs are. The
   prediction takes the measured latencies; where ``tc`` shapes the link the configured rate
   stays the bandwidth (the shaper enforces it exactly; the probe's fit is kept beside it),
   and on loopback the measured one is used.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

__all__: list[str] = []

#: the environment a launched rank needs to join its world
LAUNCH_VARIABLES = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def join_and_measure(accelerator: str = "cpu") -> dict[str, Any] | None:
    """Join the launched world, measure its links, leave it: the measurement's record on rank
    0, ``None`` on the other ranks (collective: every rank calls it).

    Raises:
        ValueError: not launched as one rank of a world of 2 or more (the message names the
            launcher to use).
    """
    missing = [name for name in LAUNCH_VARIABLES if name not in os.environ]
    if missing or int(os.environ.get("WORLD_SIZE", "1")) < 2:
        raise ValueError(
            "--measure measures the links between the processes of a launched world: start "
            "the plan on every host, e.g. `torchrun --nnodes H --nproc-per-node K "
            "--rdzv-endpoint HOST0:29500 -m lightning_parallel.bench.plan --measure ...` "
            f"(missing: {', '.join(missing) or 'a world of 2 ranks or more'})"
        )
    import torch
    import torch.distributed as dist

    from lightning_parallel.plan.link_probe import PROBE_TIMEOUT, measure_links

    use_cuda = accelerator == "cuda" and torch.cuda.is_available()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if use_cuda else None
    if device is not None:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if use_cuda else "gloo", timeout=PROBE_TIMEOUT)
    try:
        measured = measure_links(int(os.environ.get("LOCAL_WORLD_SIZE", "1")), device)
        return measured.as_dict() if dist.get_rank() == 0 else None
    finally:
        dist.destroy_process_group()


def probe_hosts(config: Any) -> dict[str, Any] | None:
    """Run the probe on hosts like the bench's runs (``config``: its
    :class:`~lightning_parallel.bench.runner.BenchConfig`); the measurement's record, ``None``
    for a world of one process (no link to measure).

    Raises:
        RuntimeError: the probe failed (its output's tail in the message).
    """
    from lightning_parallel.bench.runner import bench_hosts, master_port
    from lightning_parallel.cluster.launcher import run_on_hosts

    if config.hosts * config.procs_per_host < 2:
        return None
    with tempfile.TemporaryDirectory(prefix="lp-links-") as directory:
        output = Path(directory) / "links.json"
        command = [sys.executable, "-m", "lightning_parallel.plan.link_probe", str(output)]
        with bench_hosts(config) as network:
            result = run_on_hosts(
                network, command, procs_per_host=config.procs_per_host, quiet=True,
                timeout=300.0, master_port=master_port(config),
            )  # fmt: skip
        if result.returncode != 0 or not output.exists():
            tail = "\n".join(result.tail[-12:])
            raise RuntimeError(f"bench --predict: the link probe failed:\n{tail}")
        return dict(json.loads(output.read_text()))


def link_texts(measured: dict[str, Any], which: str) -> tuple[str, str] | None:
    """``(bandwidth, latency)`` of the ``"inter"`` or ``"intra"`` link of a measurement, as
    ``Cluster.parse`` reads them; ``None`` where it was not measured."""
    fit = measured.get(which)
    if not fit:
        return None
    bits, seconds = float(fit["bandwidth"]), float(fit["latency"])
    unit, scale = next((u, s) for u, s in _UNITS if bits >= s)
    return f"{bits / max(scale, 1.0):.4g}{unit}", _microseconds(seconds)


def message_latency_text(measured: dict[str, Any]) -> str | None:
    """The measured point-to-point latency between hosts, as ``Cluster.parse`` reads it;
    ``None`` where it was not measured (one host, or a measurement from before it was)."""
    return _seconds_text((measured.get("inter") or {}).get("message_latency"))


def busy_receive_text(measured: dict[str, Any]) -> str | None:
    """The measured extra seconds of a large request into a host whose ranks compute
    (:func:`~lightning_parallel.plan.link_probe.busy_receive_extra`), as ``Cluster.parse``
    reads it; ``None`` where it was not measured."""
    return _seconds_text((measured.get("inter") or {}).get("busy_receive"))


def _seconds_text(seconds: float | None) -> str | None:
    return None if seconds is None else _microseconds(float(seconds))


def _microseconds(seconds: float) -> str:
    """``seconds`` as ``Cluster.parse`` reads a delay, in whole tenths of a microsecond and
    never in exponent form (``"16920us"``, ``"80.5us"``, ``"0us"``)."""
    return f"{seconds * 1e6:.1f}".rstrip("0").rstrip(".") + "us"


_UNITS = (("gbit", 1e9), ("mbit", 1e6), ("kbit", 1e3), ("bit", 0.0))
