"""The cluster and the cost laws of its collectives: seconds, payload and wire bytes a host.

A :class:`Cluster` is ``hosts`` machines of ``processes_per_host`` ranks each, ranks numbered
host-major (rank ``h·K + l``, as :func:`~lightning_parallel.cluster.launcher.run_on_hosts`
numbers them). Hosts talk over the :attr:`~Cluster.inter` link (one uplink per host,
``bandwidth`` bits/s each way, ``latency`` one-way seconds), ranks of one host over the
:attr:`~Cluster.intra` link. Each law returns a :class:`Transfer` for the busiest host.

Notation: ``W`` ranks, ``H`` hosts, ``K`` ranks a host, ``N`` bytes, ``L`` one-way latency,
``b`` the payload rate of a link in bytes/s (below), ``s = min(hosts_per_link, senders)``
hosts sharing an uplink at once, each getting ``b / s``.

Framing (what the interface counters add to the payload, and gloo's bytes a message) is
:mod:`~lightning_parallel.plan.framing`'s.

The algorithms gloo runs (torch 2.13, CPU tensors), found from the bytes each host sent on 2,
4 and 8 hosts (250 kB to 4 MB): ``all_reduce`` is a ring (reduce-scatter then all-gather,
``2(W-1)/W · N`` a host at every size tried; a tree would be ``log2(W) · N`` at the root);
``all_gather`` sends ``(W-1) · n`` a host; ``broadcast`` is a binomial tree (on 8 hosts the
root sent ``3N``, rank 1 ``2N``, ranks 2-3 ``N``, ranks 4-7 nothing); ``reduce_scatter_tensor``
costs a whole allreduce (``2(W-1)/W · N``, not ``(W-1)/W · N``); ``gather``/``scatter`` go
straight between the root and each rank.

Limits: below about 100 kB gloo's own messages are most of the bytes, which the laws count
message by message (a 4 kB allreduce on 8 hosts: 17.9 kB counted, 18.2 kB by the law with
gloo's segments, 12.9 kB with one message a round); a collective of a few elements costs a
few hundred bytes a host, which vary from run to run by as much; the seconds were checked on 2
hosts (a 4 MB allreduce at 100mbit: 0.334 s measured, 0.3346 s by the law), not the latency
terms nor the tree's rounds, which 8 processes on this machine's 2 cores cannot time.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from lightning_parallel.cluster.units import parse_bandwidth, parse_latency
from lightning_parallel.plan.framing import VETH, Framing, wire_bytes

__all__: list[str] = []


@dataclass(frozen=True)
class Link:
    """One host's connection: ``bandwidth`` bits/s each way (as ``tc`` shapes it), one-way
    ``latency`` seconds a collective's round costs beyond its bytes; ``burst_bytes`` a token
    bucket lets through at once after the link idled (the simulated hosts' shaper; 0 for a real
    link); ``message_latency`` one-way seconds of a point-to-point message between two ranks
    whose receive is posted (``None``: ``latency``). On gloo the two differ: on this machine's
    idle simulated hosts a 64-byte allreduce's round costs 0.4-1.2 ms, a ping-pong's message
    0.08 ms (0.48 ms with the test suite running beside it). ``busy_receive``: the seconds a
    large request takes longer to arrive while the receiving host's ranks compute (the
    probe's :func:`~lightning_parallel.plan.link_probe.busy_receive_extra`; 0: a host with a
    core to spare)."""

    bandwidth: float
    latency: float
    burst_bytes: float = 0.0
    message_latency: float | None = None
    busy_receive: float = 0.0

    def __post_init__(self) -> None:
        if (
            self.bandwidth <= 0
            or self.latency < 0
            or (self.message_latency or 0.0) < 0
            or self.busy_receive < 0
        ):
            raise ValueError(f"a link needs bandwidth > 0 and latencies >= 0, got {self}")

    @property
    def point_latency(self) -> float:
        """A point-to-point message's one-way latency: the measured one, else ``latency``."""
        return self.latency if self.message_latency is None else self.message_latency

    def seconds(self, nbytes: float, framing: Framing, sharing: int = 1) -> float:
        """``L + nbytes · 8 · shaping_factor · sharing / bandwidth``: one message's time."""
        bits = nbytes * 8.0 * framing.shaping_factor * sharing
        return self.latency + bits / self.bandwidth

    def burst_seconds(self, idle_s: float) -> float:
        """Link time a step's traffic saves when the link idled ``idle_s`` before it: the
        token bucket refills at the link's rate up to ``burst_bytes``, which then pass at once."""
        rate = self.bandwidth / 8.0
        return min(self.burst_bytes, max(0.0, idle_s) * rate) / rate


INTRA_HOST = ("80gbit", "5us")
"""The link inside a host where none is given or measured (10 GB/s, 5 us)."""


@dataclass(frozen=True)
class Cluster:
    """``hosts`` machines of ``processes_per_host`` ranks, joined by ``inter`` links.

    ``hosts_per_link`` hosts share one uplink (oversubscription): hosts sending at once divide
    its bandwidth. ``framing`` says what the counters count
    (:data:`~lightning_parallel.plan.framing.VETH`: the simulated hosts).
    """

    hosts: int
    processes_per_host: int = 1
    inter: Link = field(default_factory=lambda: Link(1e9, 0.0))
    intra: Link = field(
        default_factory=lambda: Link(parse_bandwidth(INTRA_HOST[0]), parse_latency(INTRA_HOST[1]))
    )
    hosts_per_link: int = 1
    framing: Framing = VETH

    def __post_init__(self) -> None:
        if self.hosts < 1 or self.processes_per_host < 1 or self.hosts_per_link < 1:
            raise ValueError(
                "hosts, processes_per_host and hosts_per_link must be >= 1, got "
                f"{self.hosts}, {self.processes_per_host}, {self.hosts_per_link}"
            )

    @property
    def world(self) -> int:
        """Ranks in all: ``hosts · processes_per_host``."""
        return self.hosts * self.processes_per_host

    def sharing(self, senders: int) -> int:
        """Hosts dividing one uplink when ``senders`` hosts send at once."""
        return max(1, min(self.hosts_per_link, senders))

    @classmethod
    def parse(
        cls,
        hosts: int,
        processes_per_host: int = 1,
        bandwidth: str = "1gbit",
        latency: str = "0",
        intra_bandwidth: str | None = None,
        intra_latency: str | None = None,
        hosts_per_link: int = 1,
        burst_bytes: float = 0.0,
        message_latency: str | None = None,
        busy_receive: str | None = None,
    ) -> Cluster:
        """A cluster from ``tc``-style text: ``Cluster.parse(4, 1, "100mbit", "1ms")``;
        ``message_latency``: a point-to-point message's between hosts (default: ``latency``);
        ``busy_receive``: what a large request takes longer into a computing host (default 0).

        Raises:
            ValueError: a rate or delay not understood (the message gives the units).
        """
        intra = Link(
            parse_bandwidth(intra_bandwidth or INTRA_HOST[0]),
            parse_latency(intra_latency or INTRA_HOST[1]),
        )
        inter = Link(
            parse_bandwidth(bandwidth),
            parse_latency(latency),
            burst_bytes,
            None if message_latency is None else parse_latency(message_latency),
            0.0 if busy_receive is None else parse_latency(busy_receive),
        )
        return cls(hosts, processes_per_host, inter, intra, hosts_per_link)


@dataclass(frozen=True)
class Transfer:
    """The cost of one collective to its busiest host.

    ``payload_bytes`` crosses that host's inter-host link outward; ``wire_bytes`` is what its
    ``tx_bytes`` counter adds (payload, framing, the ACKs it sends); ``messages`` counts the
    sequential rounds (latency terms) in ``seconds``.
    """

    seconds: float
    payload_bytes: float
    wire_bytes: float
    messages: int


def _rounds(cluster: Cluster, count: int, nbytes: float, senders: int) -> float:
    """Seconds of ``count`` lockstep rounds in which every rank passes ``nbytes`` to the next
    rank: each round waits for its slowest edge, the inter-host one (shared by ``senders``
    hosts) where there is more than one host, the intra-host one where a host has more than
    one rank."""
    edges = []
    if cluster.hosts > 1:
        edges.append(cluster.inter.seconds(nbytes, cluster.framing, cluster.sharing(senders)))
    if cluster.processes_per_host > 1:
        edges.append(cluster.intra.seconds(nbytes, cluster.framing))
    return count * max(edges, default=0.0)


def _transfer(
    cluster: Cluster,
    seconds: float,
    sent: float,
    received: float,
    messages: int,
    messages_sent: float | None = None,
    messages_received: float | None = None,
) -> Transfer:
    """A :class:`Transfer` of a host that sends ``messages_sent`` (default ``messages``) and
    receives ``messages_received`` (default: one a round where it receives anything); no
    inter-host bytes on one host."""
    if cluster.hosts == 1:
        return Transfer(seconds, 0.0, 0.0, messages)
    sent_count = float(messages if messages_sent is None else messages_sent)
    received_count = float(messages if received else 0)
    if messages_received is not None:
        received_count = messages_received
    wire = wire_bytes(sent, received, sent_count, received_count, cluster.framing)
    return Transfer(seconds, sent, wire, messages)


GLOO_MAX_SEGMENT_BYTES = 2 * 2**20
"""The largest piece gloo's ring all-reduce sends at once (its ``kMaxSegmentSize``)."""


def ring_segments(world: int, nbytes: float, element_bytes: int = 4) -> int:
    """The pieces gloo's ring all-reduce sends a tensor in, those that hold data.

    gloo cuts the tensor into ``S = roundup(max(⌈N / 2 MiB⌉, 2W), W)`` segments of
    ``⌈N / S⌉`` bytes (rounded up to whole elements), at least two per rank so that one is on
    the wire while the other is reduced; a tensor of fewer elements than that leaves the
    last segments empty, and gloo sends no empty one. A rank forwards every segment but those
    of its own chunk in each half: a host sends ``2(W-1)/W`` of the segments on average.
    """
    elements = max(1, math.ceil(nbytes / element_bytes))
    total = elements * element_bytes
    pieces = max(math.ceil(total / GLOO_MAX_SEGMENT_BYTES), 2 * world)
    pieces = math.ceil(pieces / world) * world
    segment = math.ceil(math.ceil(total / pieces) / element_bytes) * element_bytes
    return min(pieces, math.ceil(total / segment))


def all_reduce(
    cluster: Cluster, nbytes: float, algorithm: str = "ring", element_bytes: int = 4
) -> Transfer:
    """Every rank ends with the sum of every rank's ``nbytes``.

    ``"ring"`` (what gloo runs, any size): reduce-scatter then all-gather, ``2(W-1)`` rounds
    of ``N/W`` bytes around the host-major ring, which leaves each host once:
    ``seconds = 2(W-1) · max(L + N/W/(b/s), L_intra + N/W/b_intra)``, payload
    ``2(W-1)/W · N`` a host, the same received. Each round moves a chunk in gloo's segments
    (:func:`ring_segments`, at least two a chunk): a host sends and receives
    ``2(W-1)/W · E`` messages of the ``E`` segments that hold data, on average over the hosts,
    each with its framing (:func:`~lightning_parallel.plan.framing.wire_bytes`). Below about
    100 kB that framing is most of the bytes: on 2 hosts a 2 kB all-reduce is 8 messages a
    host, 3.5 kB counted (3.6 kB by this law, 2.9 kB by one message a round); the averaging's
    8-byte loss, one float64, a single segment: 0.55 kB a host counted on average on 2, 4 and
    8 hosts.

    ``"tree"``: binomial reduce to rank 0 then binomial broadcast, ``⌈log2 H⌉`` rounds across
    hosts and ``⌈log2 K⌉`` inside each, each way:
    ``seconds = 2(⌈log2 H⌉ · (L + N/(b/s)) + ⌈log2 K⌉ · (L_intra + N/b_intra))``, the busiest
    host (the root's) sending ``⌈log2 H⌉ · N``.

    Raises:
        ValueError: another algorithm.
    """
    world = cluster.world
    if world == 1:
        return Transfer(0.0, 0.0, 0.0, 0)
    if algorithm == "ring":
        rounds = 2 * (world - 1)
        chunk = nbytes / world
        seconds = _rounds(cluster, rounds, chunk, cluster.hosts)
        # the messages a host sends and receives: hosts' mean
        messages = rounds * ring_segments(world, nbytes, element_bytes) / world
        return _transfer(
            cluster, seconds, rounds * chunk, rounds * chunk, rounds, messages, messages
        )
    if algorithm == "tree":
        return _tree_all_reduce(cluster, nbytes)
    raise ValueError(f"all_reduce algorithm must be 'ring' or 'tree', got {algorithm!r}")


def _tree_all_reduce(cluster: Cluster, nbytes: float) -> Transfer:
    host_rounds = math.ceil(math.log2(cluster.hosts))
    local_rounds = math.ceil(math.log2(cluster.processes_per_host))
    one_way = _binomial_seconds(cluster, nbytes, host_rounds, local_rounds)
    sent = host_rounds * nbytes
    rounds = 2 * (host_rounds + local_rounds)
    return _transfer(cluster, 2 * one_way, sent, sent, rounds)


def _binomial_seconds(
    cluster: Cluster, nbytes: float, host_rounds: int, local_rounds: int
) -> float:
    """A binomial tree's time: in host round ``i`` ``2^i`` hosts send at once."""
    framing = cluster.framing
    seconds = local_rounds * cluster.intra.seconds(nbytes, framing) if local_rounds else 0.0
    for i in range(host_rounds):
        seconds += cluster.inter.seconds(nbytes, framing, cluster.sharing(2**i))
    return seconds


def all_gather(cluster: Cluster, nbytes_per_rank: float) -> Transfer:
    """Every rank ends with every rank's ``n = nbytes_per_rank`` bytes (a ring).

    ``W-1`` rounds of ``n`` bytes around the host-major ring:
    ``seconds = (W-1) · max(L + n/(b/s), L_intra + n/b_intra)``, payload ``(W-1) · n`` a host,
    the same received. gloo's framing is that of two messages a round each way: measured on
    2, 4 and 8 hosts, 0.5 to 32 kB a rank, each host's counter adds 0.71-0.79, 2.2-2.4 and
    5.4-5.7 kB to the payload, ``4(W-1)`` messages' worth (190 bytes each).
    """
    rounds = cluster.world - 1
    seconds = _rounds(cluster, rounds, nbytes_per_rank, cluster.hosts)
    sent = rounds * nbytes_per_rank
    return _transfer(cluster, seconds, sent, sent, rounds, 2 * rounds, 2 * rounds)


def reduce_scatter(cluster: Cluster, nbytes: float, algorithm: str = "ring") -> Transfer:
    """Every rank ends with the sum of its ``N/W`` share of every rank's ``nbytes``.

    ``"ring"`` (NCCL's, the textbook one): ``W-1`` rounds of ``N/W``,
    ``seconds = (W-1) · max(L + N/W/(b/s), L_intra + N/W/b_intra)``, payload
    ``(W-1)/W · N`` a host. ``"allreduce"``: what gloo's ``reduce_scatter_tensor`` costs in
    torch 2.13 (measured: a whole ring allreduce, ``2(W-1)/W · N``), see :func:`all_reduce`.

    Raises:
        ValueError: another algorithm.
    """
    if algorithm == "allreduce":
        return all_reduce(cluster, nbytes)
    if algorithm != "ring":
        raise ValueError(
            f"reduce_scatter algorithm must be 'ring' or 'allreduce', got {algorithm!r}"
        )
    world = cluster.world
    chunk = nbytes / world
    seconds = _rounds(cluster, world - 1, chunk, cluster.hosts)
    sent = (world - 1) * chunk
    return _transfer(cluster, seconds, sent, sent, world - 1)


def broadcast(cluster: Cluster, nbytes: float) -> Transfer:
    """Every rank ends with root's ``nbytes`` (a binomial tree, as gloo's).

    ``⌈log2 H⌉`` rounds across hosts (round ``i``: ``2^i`` hosts send at once) and
    ``⌈log2 K⌉`` inside them:
    ``seconds = Σ_i (L + N/(b/s_i)) + ⌈log2 K⌉ · (L_intra + N/b_intra)``; the root's host
    sends ``⌈log2 H⌉ · N``, the most.
    """
    host_rounds = math.ceil(math.log2(cluster.hosts))
    local_rounds = math.ceil(math.log2(cluster.processes_per_host))
    seconds = _binomial_seconds(cluster, nbytes, host_rounds, local_rounds)
    sent = host_rounds * nbytes
    return _transfer(cluster, seconds, sent, 0.0, host_rounds + local_rounds, host_rounds)


def broadcast_mean(cluster: Cluster, nbytes: float) -> Transfer:
    """:func:`broadcast` with its bytes as the hosts' mean (what the bench compares): the
    tree's ``H − 1`` copies over ``H`` hosts (the root's host sends ``⌈log2 H⌉`` of them, the
    last round's hosts none), each receiver's ACK beside it; the seconds are the tree's."""
    tree = broadcast(cluster, nbytes)
    if cluster.hosts == 1:
        return tree
    rounds = math.ceil(math.log2(cluster.hosts))
    share = (cluster.hosts - 1) / cluster.hosts
    acks = cluster.framing.receiver_acks(nbytes)
    return replace(
        tree,
        payload_bytes=tree.payload_bytes * share / rounds,
        wire_bytes=(tree.wire_bytes / rounds + acks) * share,
    )


STEP_FLAG_BYTES = 8
"""Lightning's SIGTERM flag: one int64, broadcast from rank 0 before every training batch."""


def step_flag(cluster: Cluster) -> Transfer:
    """The trainer's broadcast of rank 0's SIGTERM flag before every training batch (Lightning's
    fit loop in a world of more than one; the library's strategies keep it, raising on a lost
    peer, all but the parameter server's, whose workers never wait for each other): a
    :func:`broadcast_mean` of :data:`STEP_FLAG_BYTES`. Measured on 2 hosts, an 8-byte
    broadcast: 268 bytes counted on the root's host, 68 on the other's (168 a host; this law
    143)."""
    return broadcast_mean(cluster, STEP_FLAG_BYTES)


def gather(cluster: Cluster, nbytes_per_rank: float) -> Transfer:
    """Rank 0 ends with every rank's ``n = nbytes_per_rank`` bytes (parameter-server style).

    Every rank sends to the root at once; the root host's inbound link carries
    ``(W-K) · n``: ``seconds = L + (W-K) · n/b + (K-1) · n/b_intra``. The busiest sender is a
    host of ``K`` ranks: payload ``K · n``.
    """
    return _to_or_from_root(cluster, nbytes_per_rank, outward=False)


def scatter(cluster: Cluster, nbytes_per_rank: float) -> Transfer:
    """Each rank ends with its ``n = nbytes_per_rank`` bytes from rank 0.

    The root host sends ``(W-K) · n`` over its link:
    ``seconds = L + (W-K) · n/b + (K-1) · n/b_intra``, payload ``(W-K) · n``.
    """
    return _to_or_from_root(cluster, nbytes_per_rank, outward=True)


def _to_or_from_root(cluster: Cluster, nbytes_per_rank: float, outward: bool) -> Transfer:
    local = cluster.processes_per_host
    remote = cluster.world - local
    seconds = 0.0
    if remote:
        seconds += cluster.inter.seconds(remote * nbytes_per_rank, cluster.framing)
    if local > 1:
        seconds += (local - 1) * cluster.intra.seconds(nbytes_per_rank, cluster.framing)
    sent = remote * nbytes_per_rank if outward else local * nbytes_per_rank
    messages = remote if outward else local
    wire = wire_bytes(sent, 0.0, messages, 0, cluster.framing) if remote else 0.0
    return Transfer(seconds, sent if remote else 0.0, wire, 1)


def send(cluster: Cluster, nbytes: float) -> Transfer:
    """One rank's ``nbytes`` to another (a pipeline's activations): ``L + N/b``, over the
    inter-host link if the cluster has more than one host, else over the intra link.

    ``wire_bytes`` is what both hosts' counters add: the sender's message and the receiver's
    ACKs, at least one (measured on 2 hosts, 4 B to 128 kB: the receiver 68 to 144 bytes a
    message); the pipelines and the server sum their messages and divide by the hosts.
    """
    link = cluster.inter if cluster.hosts > 1 else cluster.intra
    seconds = link.seconds(nbytes, cluster.framing)
    transfer = _transfer(cluster, seconds, nbytes, 0.0, 1)
    if cluster.hosts == 1:
        return transfer
    acks = cluster.framing.receiver_acks(nbytes)
    return replace(transfer, wire_bytes=transfer.wire_bytes + acks)
