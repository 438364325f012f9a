"""Measure the links a plan's laws need, on the cluster the processes run on.

The laws of :mod:`lightning_parallel.plan.network` take each link as a one-way latency ``L``
and a bandwidth ``B``: a ring allreduce of ``N`` bytes on ``W`` ranks lasts
``2(W−1) · (L + (N/W) · 8 · f / B)`` (``f`` the framing's shaping factor). :func:`measure_links`
inverts that law from two allreduces timed where they run:

1. every rank joins; a small allreduce (:data:`SMALL_BYTES`, 4 bytes a rank at least) and a
   large one are each run
   ``repeats`` times back to back (the way a step issues its collectives: DDP's buckets,
   PowerSGD's three a bucket, Hylo's three), each timed alone, after ``warmup`` untimed runs;
   the mean of each is kept;
2. the large size starts at :data:`LARGE_START_BYTES` and doubles until its allreduce takes at
   least :data:`LARGE_MIN_RATIO` times the small one's and :data:`LARGE_MIN_SECONDS`, so that
   its time is the link's rate, not its latency, on 10 Mbit/s and on 100 Gbit/s alike (at most
   :data:`LARGE_MAX_BYTES`);
3. per round (``t / 2(W−1)``) and per chunk (``N / W``), two sizes give the line's slope and
   intercept: ``B = 8 f (c_large − c_small) / (r_large − r_small)``,
   ``L = r_small − 8 f c_small / B``.

The world's ring crosses every host's uplink once, and each round waits for its slowest edge,
so with several hosts the fit describes the link between hosts. With several processes a host
the ranks of host 0 measure the link inside a host the same way, in a group of their own.

``L`` is what a collective costs beyond its bytes where it runs: wire latency, and the
software's own (gloo's threads waking, the message's handshake). On this machine's simulated
hosts, whose ``tc`` adds no delay, a 64-byte allreduce between two hosts at 1 Gbit/s takes
either about 0.5 ms or about 3.5 ms, each about half the time (300 back to back: median
2.9 ms, mean 2.5 ms): a millisecond or so a round that a law with ``L = 0`` leaves out.

Between hosts a ping-pong of the small message between host 0's first rank and host 1's also
gives a point-to-point message's latency (:func:`message_latency`), which the pipelines' laws
take for the messages between their stages.

Last, host 1's first rank sends host 0's first rank requests as a parameter server's worker
does, first while host 0's ranks idle, then while each computes (:func:`busy_receive_extra`).
Where a host has no core to spare, the threads that read a request wait for the
computation's time slice: on this machine's simulated hosts (one core each, not pinned) the
probe measured 2.0 to 3.9 ms at 1 Gbit/s and 100 Mbit/s (0 at 10 Mbit/s), and 0.0 to 0.3 ms
where the sender slept instead of computing before it sent, or sent with a blocking send.
The parameter server's law adds it to every gradient pushed to the server's host.

Run as a program on every rank (``python -m lightning_parallel.plan.link_probe OUT.json``,
the ``torch.distributed`` environment set): rank 0 writes the measurement as JSON.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from lightning_parallel.comm.groups import new_group
from lightning_parallel.plan.framing import VETH, Framing

__all__: list[str] = []

#: the small allreduce's bytes (4 a rank at least: gloo sends no empty chunk): its bytes take
#: no time worth the name at any rate, and a shaper's burst cannot hide them, so its time is
#: the latency's
SMALL_BYTES = 64
#: the large allreduce's first size, doubled until it takes long enough
LARGE_START_BYTES = 64 * 2**10
#: the large allreduce takes at least this many times the small one's time ...
LARGE_MIN_RATIO = 8.0
#: ... and at least this many seconds
LARGE_MIN_SECONDS = 0.02
#: the large allreduce never exceeds this many bytes
LARGE_MAX_BYTES = 64 * 2**20
#: how long the busy-receive probe's sender computes before each request, as a worker does
BUSY_GAP_S = 0.02
#: the busy-receive probe's request: at least this many bytes (beyond a shaper's burst) ...
BUSY_MIN_BYTES = 256 * 2**10
#: ... and at most this many seconds of timed rounds a phase
BUSY_PHASE_SECONDS = 1.0
#: how long the probe's process groups wait for a peer (a dead host ends it, never hangs it)
PROBE_TIMEOUT = timedelta(minutes=5)


@dataclass(frozen=True)
class LinkFit:
    """One link as the laws take it, and the timings it was fitted from.

    Args:
        bandwidth: bits per second, each way.
        latency: one-way seconds a message costs beyond its bytes.
        small_bytes: the small allreduce's size.
        small_s: the small allreduce's mean seconds.
        large_bytes: the large allreduce's size.
        large_s: the large allreduce's mean seconds.
        ranks: ranks in the ring that was timed.
        message_latency: one-way seconds of a small message between two ranks whose receive
            is posted (half a ping-pong's round trip); ``None``: not measured.
        busy_receive: mean seconds a request from host 1 and its small reply take longer
            while host 0's ranks compute (:func:`busy_receive_extra`); ``None``: not measured
            (on an accelerator).
    """

    bandwidth: float
    latency: float
    small_bytes: int
    small_s: float
    large_bytes: int
    large_s: float
    ranks: int
    message_latency: float | None = None
    busy_receive: float | None = None


@dataclass(frozen=True)
class LinkMeasurement:
    """The links of a cluster of ``hosts`` hosts of ``processes_per_host`` processes:
    ``inter`` between hosts (``None`` on one host), ``intra`` inside one (``None`` with one
    process a host)."""

    hosts: int
    processes_per_host: int
    inter: LinkFit | None
    intra: LinkFit | None

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


def fit_ring(
    ranks: int,
    small: tuple[int, float],
    large: tuple[int, float],
    framing: Framing = VETH,
) -> LinkFit:
    """The link whose ring allreduce law (module docstring) gives the two ``(bytes, seconds)``
    timings on ``ranks`` ranks; the latency is at least 0, and the bandwidth is taken from the
    large allreduce alone where the two do not rise with size.

    Raises:
        ValueError: fewer than 2 ranks, or the large size is not larger.
    """
    if ranks < 2:
        raise ValueError(f"a ring needs 2 ranks or more, got {ranks}")
    if large[0] <= small[0]:
        raise ValueError(f"the large size must exceed the small one, got {large[0]} <= {small[0]}")
    rounds = 2 * (ranks - 1)
    chunk_small, chunk_large = small[0] / ranks, large[0] / ranks
    round_small, round_large = small[1] / rounds, large[1] / rounds
    bits = 8.0 * framing.shaping_factor
    rise = round_large - round_small
    if rise > 0:
        bandwidth = bits * (chunk_large - chunk_small) / rise
    else:
        bandwidth = bits * chunk_large / max(round_large, 1e-9)
    latency = max(0.0, round_small - bits * chunk_small / bandwidth)
    return LinkFit(bandwidth, latency, small[0], small[1], large[0], large[1], ranks)


def _mean_allreduce_s(
    nbytes: int, repeats: int, warmup: int, device: torch.device, group: ProcessGroup | None
) -> float:
    """The mean of ``repeats`` back-to-back allreduces of ``nbytes`` (float32), each timed
    alone, after ``warmup`` untimed ones; every rank agrees on the figure (rank 0's, sent).
    The mean, not the median: where a collective's time has two modes (module docstring), a
    step's several collectives add up to their mean, and a median flips between the modes."""
    tensor = torch.zeros(max(1, nbytes // 4), device=device)
    for _ in range(warmup):
        dist.all_reduce(tensor, group=group)
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        dist.all_reduce(tensor, group=group)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        seconds.append(time.perf_counter() - start)
    agreed = torch.tensor([statistics.fmean(seconds)], dtype=torch.float64, device=device)
    dist.broadcast(agreed, src=_first_rank(group), group=group)
    return float(agreed.item())


def message_latency(
    peer: int, repeats: int, warmup: int, device: torch.device, root: int = 0
) -> float:
    """Half the mean round trip of a ``SMALL_BYTES`` message from ``root`` to ``peer`` and
    back, each round timed alone after ``warmup`` untimed ones (collective over the default
    group: the two peers play ping-pong, every rank gets ``root``'s figure). A pipeline's
    stages exchange such messages, with the receive posted: no collective's rounds."""
    rank = dist.get_rank()
    tensor = torch.zeros(SMALL_BYTES // 4, device=device)
    seconds = []
    if rank in (root, peer):
        other = peer if rank == root else root
        for index in range(warmup + repeats):
            start = time.perf_counter()
            if rank == root:
                dist.send(tensor, other)
                dist.recv(tensor, other)
            else:
                dist.recv(tensor, other)
                dist.send(tensor, other)
            if device.type == "cuda":  # NCCL's calls return once queued
                torch.cuda.synchronize(device)
            if index >= warmup:
                seconds.append(time.perf_counter() - start)
    one_way = statistics.fmean(seconds) / 2.0 if seconds else 0.0
    agreed = torch.tensor([one_way], dtype=torch.float64, device=device)
    dist.broadcast(agreed, src=root)
    return float(agreed.item())


def busy_receive_extra(
    sender: int,
    nbytes: int,
    repeats: int,
    device: torch.device,
    receiver: int = 0,
    receiver_host: Sequence[int] = (0,),
) -> float:
    """The mean seconds a request of ``nbytes`` from ``sender`` to ``receiver`` and its small
    reply take longer while every rank of ``receiver_host`` computes than while they idle (at
    least 0; collective over the default group, every rank gets the sender's figure).

    The request goes as a parameter-server worker's does: the sender computes for
    :data:`BUSY_GAP_S`, posts the reply's receives, and sends a header and the payload
    without blocking; the receiver receives the two, then sends a header and
    :data:`SMALL_BYTES` back. Each phase times ``repeats`` such rounds on the sender, after one
    untimed; in the busy phase each rank of the receiver's host runs a thread of small matrix
    products, as a training step keeps its core busy. Where the hosts have no core to spare,
    the receiver's threads wait for a time slice to read the request (module docstring)."""
    rank = dist.get_rank()
    header = torch.zeros(8, dtype=torch.int64, device=device)
    answer = torch.zeros_like(header)
    payload = torch.zeros(max(1, nbytes // 4), device=device)
    reply = torch.zeros(SMALL_BYTES // 4, device=device)
    means = []
    for busy in (False, True):
        stop = threading.Event()
        computing = None
        if busy and rank in receiver_host:
            computing = threading.Thread(target=_compute, args=(stop, None), daemon=True)
            computing.start()
        dist.barrier()
        seconds = []
        for index in range(repeats + 1):
            if rank == sender:
                _compute(threading.Event(), BUSY_GAP_S)
                start = time.perf_counter()
                _wait_all(
                    dist.irecv(answer, receiver),
                    dist.irecv(reply, receiver),
                    dist.isend(header, receiver),
                    dist.isend(payload, receiver),
                )
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                if index:
                    seconds.append(time.perf_counter() - start)
            elif rank == receiver:
                dist.recv(header, sender)
                dist.recv(payload, sender)
                _wait_all(dist.isend(header, sender), dist.isend(reply, sender))
        dist.barrier()  # every rank of the receiver's host computes until the last round ends
        stop.set()
        if computing is not None:
            computing.join()
        means.append(statistics.fmean(seconds) if seconds else 0.0)
    agreed = torch.tensor([max(0.0, means[1] - means[0])], dtype=torch.float64, device=device)
    dist.broadcast(agreed, src=sender)
    return float(agreed.item())


def _wait_all(*works: dist.Work | None) -> None:
    for work in works:
        if work is not None:
            work.wait()


def _compute(stop: threading.Event, seconds: float | None) -> None:
    """Keep a core busy with small products on the CPU (each releases the interpreter's lock,
    as a training step's operations do) for ``seconds``, or until ``stop`` is set."""
    end = float("inf") if seconds is None else time.perf_counter() + seconds
    matrix = torch.randn(64, 64)
    while not stop.is_set() and time.perf_counter() < end:
        matrix = torch.tanh(matrix @ matrix)


def _busy_receive(
    inter: LinkFit, processes_per_host: int, repeats: int, device: torch.device
) -> float | None:
    """:func:`busy_receive_extra` from host 1's first rank to host 0's, with a request of the
    large allreduce's size (:data:`BUSY_MIN_BYTES` at least), as many rounds as fit
    :data:`BUSY_PHASE_SECONDS` (4 to ``repeats // 5``, at least 4); ``None`` on an
    accelerator, where the transfers do not wait for the host's cores and NCCL has no tags to
    keep the request's receives apart."""
    if device.type != "cpu":
        return None
    nbytes = max(inter.large_bytes, BUSY_MIN_BYTES)
    round_s = BUSY_GAP_S + inter.large_s * nbytes / inter.large_bytes
    rounds = max(4, min(max(4, repeats // 5), int(BUSY_PHASE_SECONDS / round_s)))
    return busy_receive_extra(
        processes_per_host, nbytes, rounds, device, receiver_host=range(processes_per_host)
    )


def _first_rank(group: ProcessGroup | None) -> int:
    return 0 if group is None else int(dist.get_global_rank(group, 0))


def fit_group(
    ranks: int,
    device: torch.device,
    group: ProcessGroup | None = None,
    repeats: int = 100,
    warmup: int = 3,
    framing: Framing = VETH,
) -> LinkFit:
    """Time the small and the growing large allreduce in ``group`` (every member calls it) and
    fit the link (module docstring)."""
    small_bytes = max(SMALL_BYTES, 4 * ranks)
    small = _mean_allreduce_s(small_bytes, repeats, warmup, device, group)
    size = LARGE_START_BYTES
    while True:
        large = _mean_allreduce_s(size, max(3, repeats // 20), 1, device, group)
        long_enough = large >= max(LARGE_MIN_RATIO * small, LARGE_MIN_SECONDS)
        if long_enough or size >= LARGE_MAX_BYTES:
            break
        size *= 2
    return fit_ring(ranks, (small_bytes, small), (size, large), framing)


def measure_links(
    processes_per_host: int,
    device: torch.device | None = None,
    repeats: int = 100,
    framing: Framing = VETH,
) -> LinkMeasurement:
    """Measure the cluster's links in the default process group, whose ranks are numbered
    host-major with ``processes_per_host`` a host (collective: every rank calls it).

    Raises:
        ValueError: the world is not a whole number of hosts, or has one rank.
    """
    world = dist.get_world_size()
    if world < 2 or world % processes_per_host:
        raise ValueError(
            f"a world of {world} ranks cannot be measured as hosts of {processes_per_host} "
            "processes: start 2 ranks or more, the same number on every host"
        )
    device = device or torch.device("cpu")
    hosts = world // processes_per_host
    inter = fit_group(world, device, None, repeats, framing=framing) if hosts > 1 else None
    if inter is not None:  # host 0's first rank and host 1's
        inter = replace(
            inter,
            message_latency=message_latency(processes_per_host, repeats, 3, device),
            busy_receive=_busy_receive(inter, processes_per_host, repeats, device),
        )
    intra = None
    if processes_per_host > 1:
        groups = [
            new_group(
                list(range(h * processes_per_host, (h + 1) * processes_per_host)),
                timeout=PROBE_TIMEOUT,
            )
            for h in range(hosts)
        ]
        if dist.get_rank() < processes_per_host:
            intra = fit_group(processes_per_host, device, groups[0], repeats, framing=framing)
        dist.barrier()
    return LinkMeasurement(hosts, processes_per_host, inter, intra)


def main(argv: list[str] | None = None) -> int:
    """Measure as one rank of a launched world (``LOCAL_WORLD_SIZE`` processes a host, else
    1); rank 0 writes the JSON to the path given."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m lightning_parallel.plan.link_probe OUT.json", file=sys.stderr)
        return 2
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=PROBE_TIMEOUT)
    try:
        measured = measure_links(int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
        if dist.get_rank() == 0:
            with open(args[0], "w") as out:
                json.dump(measured.as_dict(), out)
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
