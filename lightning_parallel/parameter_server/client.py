"""The worker's side: push the gradient to every shard, pull the fresh weights back.

One exchange (:meth:`ParameterClient.step`), for every shard k hosted on rank h_k:

1. flatten the gradients of the trained parameters into one vector (zeros where a parameter
   has no gradient);
2. post the receives of the reply (header, weights) from h_k, then ``isend`` the request header
   and the gradient slice of shard k; a shard hosted on this very rank is handed the request
   in-process instead;
3. wait for every reply: an ``ABORT`` raises :class:`WorkerFailure` naming the failed rank, a
   lost connection names the shard's host;
4. copy each shard's weights into the model's parameters and remember the version read, which
   goes with the next gradient so the server knows its staleness exactly.

With ``overlap=True`` a step does not wait for its reply: the worker computes its next batch
on the weights it already has while the gradient travels, is applied and the fresh weights
travel back (Downpour SGD's overlap of communication with computation, Dean et al. 2012).
Step t+1 then (a) waits for the reply of step t, (b) flattens its own gradient, computed on
the weights of reply t−1, and tags it with that version, (c) loads the weights of reply t and
(d) posts its request. One request per worker is in flight at most, so the server sees the
same protocol; each gradient is computed on weights one exchange older (its staleness, still
exact, grows by the updates of one exchange). Every other exchange (a budget claim, the
epoch's drain, leaving) settles the step in flight first.

The client also keeps this worker's share of the epoch budget (:meth:`take_batch`).
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor
from torch.distributed import ProcessGroup
from torch.distributed import distributed_c10d as c10d

from lightning_parallel.parameter_server.faults import WorkerFailure
from lightning_parallel.parameter_server.host import ShardHost
from lightning_parallel.parameter_server.layout import ShardLayout, copy_flat_to, flatten_gradients
from lightning_parallel.parameter_server.protocol import (
    FAILURE_TEXT,
    HEADER_SIZE,
    REPLY_HEADER_TAG,
    REPLY_WEIGHTS_TAG,
    REQUEST_GRADIENT_TAG,
    REQUEST_HEADER_TAG,
    Reply,
    ReplyFlag,
    ReplyKind,
    Request,
    RequestFlag,
    RequestKind,
)

__all__: list[str] = []


def _posted(*works: c10d.Work | None) -> list[c10d.Work]:
    """The handles of point-to-point calls (``None`` only for a rank outside the group)."""
    return [work for work in works if work is not None]


@dataclass
class _Posted:
    """An exchange whose requests have left: what to wait for to get its replies."""

    kind: RequestKind
    remote: list[tuple[int, list[c10d.Work], list[c10d.Work], list[Tensor]]] = field(
        default_factory=list
    )
    local: list[int] = field(default_factory=list)


class ParameterClient:
    """A worker's connection to all shards of the parameter server.

    Args:
        rank: this worker's global rank.
        parameters: the trained parameters in flat order (the model's own tensors).
        layout: which parameters each shard owns.
        hosts: global rank hosting each shard.
        group: the parameter-server process group.
        local_hosts: shard index → :class:`ShardHost` for shards hosted by this rank.
        lookahead: batches to keep granted ahead (prefetching takes one batch early, gradient
            accumulation takes several per step).
        overlap: do not wait for a step's reply before computing the next batch (see above).
        lends: the worker starts at most one batch between two requests, so the server may
            lend its other granted batches to faster workers (``False`` with gradient
            accumulation).
        wire_dtype: dtype of the gradients sent and the weights received from remote shards
            (``None``: the parameters' own); the shards keep full-precision weights.
    """

    def __init__(
        self,
        rank: int,
        parameters: Sequence[Tensor],
        layout: ShardLayout,
        hosts: Sequence[int],
        group: ProcessGroup,
        local_hosts: Mapping[int, ShardHost],
        lookahead: int = 2,
        overlap: bool = False,
        lends: bool = True,
        wire_dtype: torch.dtype | None = None,
    ) -> None:
        self.rank = rank
        self.parameters = list(parameters)
        self.layout = layout
        self.hosts = list(hosts)
        self.group = group
        self.local_hosts = dict(local_hosts)
        self.lookahead = max(1, lookahead)
        self.overlap = overlap
        self.lends = lends
        self._in_flight: _Posted | None = None
        dtype = self.parameters[0].dtype
        self.gradient = torch.zeros(layout.total, dtype=dtype)
        self._slices = [layout.elements_of(shard) for shard in range(layout.shards)]
        wire = wire_dtype or dtype
        self._weights = [torch.zeros(stop - start, dtype=wire) for start, stop in self._slices]
        # the gradient slice in the wire's dtype (None: sent as it is)
        self._outgoing = [
            torch.zeros(stop - start, dtype=wire) if wire != dtype else None
            for start, stop in self._slices
        ]
        self._headers = [torch.zeros(HEADER_SIZE, dtype=torch.int64) for _ in self.hosts]
        self.read_versions = [0] * layout.shards
        # epoch budget
        self.allowance = 0
        self.reserved = 0  # batches fetched ahead, granted, not started (reserve_batch)
        self.reserving = False  # this epoch's batches are reserved, then started
        self.epoch_over = False
        self.run_over = False
        self.in_epoch = False
        self.steps_this_epoch = 0
        self.epochs_drained = 0
        #: workers the server went on without, as of shard 0's last reply
        self.lost = 0
        # telemetry
        self.staleness: Counter[int] = Counter()
        self.dropped = 0
        self.gradients_sent = 0
        self.wait_seconds = 0.0
        self.drain_wait_seconds = 0.0  # the part of wait_seconds spent in epoch-end drains
        self._bytes_sent = 0.0

    # ------------------------------------------------------------------ epoch budget

    def begin_epoch(self, epoch_batches: int, reserving: bool = False) -> None:
        """Start an epoch with this rank's ``epoch_batches``: read the weights, get batches.

        Beginning again before any step of the epoch (Lightning re-created the data iterator)
        restarts it: the batches granted so far go back to the pool.

        ``reserving``: the epoch's batches will be reserved as they are fetched and spent as
        they start (:meth:`reserve_batch`, :meth:`start_batch`), so the server may lend all
        but one of the batches it grants now to faster workers, as it may after every later
        request. Without it the ``BEGIN`` keeps its grants (``KEEPS_GRANTS``): a slow remote
        worker then trains its second batch even where the fast workers would have finished
        the epoch first, and they wait for it at the drain (torchvision's ResNet-18 on
        2 hosts at 100 Mbit/s: the server's worker waited one 7.5-second exchange at the
        run's end).
        """
        flags = RequestFlag.NONE
        if self.in_epoch:
            if self.steps_this_epoch:
                raise RuntimeError(
                    "a new training epoch began on this worker before the previous one drained "
                    f"({self.steps_this_epoch} steps into it); reloading the training data "
                    "inside an epoch is not supported with the parameter server"
                )
            flags = RequestFlag.RESTART
        self.allowance, self.epoch_over, self.reserved = 0, False, 0
        self.reserving = reserving
        self.in_epoch = True
        self.steps_this_epoch = 0
        self._exchange(RequestKind.BEGIN, flags, epoch_batches=epoch_batches)

    def take_batch(self) -> bool:
        """Use one granted batch; ask for more if none is left. ``False``: the epoch is over."""
        if self.allowance == 0 and not self.epoch_over:
            self._exchange(RequestKind.CLAIM, RequestFlag.NONE)
        if self.allowance == 0:
            return False
        self.allowance -= 1
        return True

    def reserve_batch(self) -> bool:
        """A data loader fetched a batch ahead of training it: is there a grant for it?

        With :meth:`start_batch` instead of :meth:`take_batch`: the grant is spent when the
        batch starts, so the server may lend it to a faster worker meanwhile (see
        :mod:`~lightning_parallel.parameter_server.budget`). ``False``: the epoch is over.
        """
        self.reserving = True
        if self.allowance - self.reserved <= 0 and not self.epoch_over:
            self._exchange(RequestKind.CLAIM, RequestFlag.NONE)
        if self.allowance - self.reserved <= 0:
            return False
        self.reserved += 1
        return True

    def start_batch(self) -> bool:
        """Spend the grant of a reserved batch as it starts; ``False``: it went to another
        worker (skip the batch). Always ``True`` when the epoch began without ``reserving`` and
        no batch was reserved (a loader without a length trains on its own data, outside the
        budget)."""
        if not self.reserving:
            return True
        self.reserved = max(0, self.reserved - 1)
        if self.allowance == 0:
            self.settle()  # an overlapped step's reply may carry the grant
        if self.allowance == 0:
            return False
        self.allowance -= 1
        return True

    # ------------------------------------------------------------------ steps

    def step(self, has_gradient: bool, drain: bool = False) -> None:
        """Push this worker's gradient (or nothing: a pull) and read the fresh weights.

        Args:
            has_gradient: send the parameters' ``.grad`` (else only pull the weights).
            drain: this is the worker's last step of the epoch; return once every worker has
                drained, with the epoch's final weights.
        """
        flags = RequestFlag.DRAIN if drain else RequestFlag.NONE
        # the step in flight must be answered before its gradient buffer is reused
        previous = self._collect(self._in_flight) if self._in_flight is not None else None
        self._in_flight = None
        if has_gradient:
            flatten_gradients(self.gradient, self.parameters)
            flags |= RequestFlag.HAS_GRADIENT
            self.gradients_sent += 1
        versions = list(self.read_versions)  # the weights this gradient was computed on
        if previous is not None:
            self._accept(RequestKind.STEP, previous)
        self.steps_this_epoch += 1
        overlapped = self.overlap and not drain
        posted = self._post(RequestKind.STEP, flags, versions=versions)
        if overlapped:
            self._in_flight = posted
        else:
            before = self.wait_seconds
            self._accept(RequestKind.STEP, self._collect(posted))
            if drain:  # the epoch's end: waiting for the other workers to finish
                self.drain_wait_seconds += self.wait_seconds - before
        if drain:
            self.in_epoch = False
            self.epochs_drained += 1

    def settle(self) -> None:
        """Wait for the step in flight (``overlap``) and load its weights; no-op otherwise."""
        if self._in_flight is not None:
            posted, self._in_flight = self._in_flight, None
            self._accept(RequestKind.STEP, self._collect(posted))

    def drain(self) -> None:
        """End the epoch without a gradient (the last step sent none)."""
        self.step(has_gradient=False, drain=True)

    def leave(self) -> None:
        """Tell every shard this worker stops (no reply is awaited)."""
        self._exchange(RequestKind.LEAVE, RequestFlag.NONE)

    def take_bytes(self) -> float:
        """Bytes this worker sent since the last call (request headers and gradients)."""
        sent, self._bytes_sent = self._bytes_sent, 0.0
        return sent

    # ------------------------------------------------------------------ exchange

    def _exchange(self, kind: RequestKind, flags: RequestFlag, epoch_batches: int = 0) -> None:
        self.settle()
        replies = self._collect(self._post(kind, flags, epoch_batches=epoch_batches))
        if kind != RequestKind.LEAVE:
            self._accept(kind, replies)

    def _post(
        self,
        kind: RequestKind,
        flags: RequestFlag,
        epoch_batches: int = 0,
        versions: Sequence[int] | None = None,
    ) -> _Posted:
        """Send the request to every shard, receives of the replies posted first.

        A worker that may start more than one batch between two requests flags its requests:
        the server lends none of its granted batches to others. That is every worker but one
        that spends grants as batches start (:meth:`start_batch`), with one batch per step
        (no gradient accumulation) and no overlapped steps.
        """
        if self.overlap or not self.lends or not self.reserving:
            flags |= RequestFlag.KEEPS_GRANTS
        start = time.perf_counter()
        versions = self.read_versions if versions is None else versions
        want = max(0, self.lookahead - self.allowance) if kind != RequestKind.LEAVE else 0
        posted = _Posted(kind)
        for shard, host in enumerate(self.hosts):
            first, stop = self._slices[shard]
            request = Request(
                kind,
                self.rank,
                versions[shard],
                flags,
                want if shard == 0 else 0,
                epoch_batches if shard == 0 else 0,
                self.gradient[first:stop] if RequestFlag.HAS_GRADIENT in flags else None,
                self.allowance if shard == 0 else 0,
            )
            if host == self.rank:
                self.local_hosts[shard].submit(request)
                posted.local.append(shard)
                continue
            receives: list[c10d.Work] = []
            if kind != RequestKind.LEAVE:
                # receives are posted before the request leaves, so the reply lands directly
                receives = _posted(
                    c10d.irecv(
                        self._headers[shard], src=host, group=self.group, tag=REPLY_HEADER_TAG
                    ),
                    c10d.irecv(
                        self._weights[shard], src=host, group=self.group, tag=REPLY_WEIGHTS_TAG
                    ),
                )
            header = request.header()
            sends = _posted(c10d.isend(header, dst=host, group=self.group, tag=REQUEST_HEADER_TAG))
            self._bytes_sent += header.numel() * 8
            if request.gradient is not None:
                outgoing = self._outgoing[shard]
                gradient = (
                    request.gradient if outgoing is None else outgoing.copy_(request.gradient)
                )
                sends += _posted(
                    c10d.isend(gradient, dst=host, group=self.group, tag=REQUEST_GRADIENT_TAG)
                )
                self._bytes_sent += gradient.numel() * gradient.element_size()
            posted.remote.append((shard, receives, sends, [header]))
        self.wait_seconds += time.perf_counter() - start  # a local shard applies in-line
        return posted

    def _collect(self, posted: _Posted) -> dict[int, Reply]:
        """Wait for the sends and the replies of ``posted`` (none for ``LEAVE``)."""
        start = time.perf_counter()
        replies: dict[int, Reply] = {}
        try:
            for shard, receives, sends, _keep_alive in posted.remote:
                host = self.hosts[shard]
                try:
                    for work in sends + receives:
                        work.wait()
                except Exception as error:
                    raise WorkerFailure(
                        f"parameter server: lost the connection to shard {shard} on rank {host}: "
                        f"rank {host} failed or is unreachable ({str(error).splitlines()[0]})",
                        rank=host,
                    ) from error
                if receives:
                    replies[shard] = Reply.from_header(
                        self.rank, self._headers[shard], self._weights[shard]
                    )
            if posted.kind != RequestKind.LEAVE:
                for shard in posted.local:
                    replies[shard] = self._wait_local(self.local_hosts[shard])
        finally:
            self.wait_seconds += time.perf_counter() - start
        return replies

    def _wait_local(self, host: ShardHost) -> Reply:
        while True:
            reply = host.take_local(timeout=0.5)
            if reply is not None:
                return reply

    def _accept(self, kind: RequestKind, replies: dict[int, Reply]) -> None:
        for reply in replies.values():
            if reply.kind == ReplyKind.ABORT and reply.failed_rank == self.rank:
                raise WorkerFailure(
                    f"parameter server: this worker (rank {self.rank}) was silent or unreachable "
                    "for longer than heartbeat_timeout and the others went on without it; it "
                    "stops",
                    rank=self.rank,
                )
            if reply.kind == ReplyKind.ABORT:
                reason = reply.reason or FAILURE_TEXT[reply.failure]
                raise WorkerFailure(
                    f"parameter server: worker rank {reply.failed_rank} failed: {reason}; the "
                    "run stops (every worker is told the same)",
                    rank=reply.failed_rank,
                )
        for shard, reply in sorted(replies.items()):
            if kind != RequestKind.CLAIM:
                first, stop = self.layout.bounds[shard]
                copy_flat_to(reply.weights, self.parameters[first:stop])
                self.read_versions[shard] = reply.version
            if shard == 0:
                self.lost = max(self.lost, reply.lost)
                self.allowance += reply.granted
                if self.allowance < 0:
                    raise RuntimeError(
                        f"parameter server: worker rank {self.rank} lost {-reply.granted} "
                        "granted batches to faster workers, more than it had not started (a "
                        "budget protocol error); please report it"
                    )
                # the latest word counts: batches taken back from a worker (a negative grant)
                # reopen the pool, and that worker must come back for them
                self.epoch_over = ReplyFlag.EPOCH_OVER in reply.flags
                self.run_over |= ReplyFlag.RUN_OVER in reply.flags
                if reply.staleness >= 0:
                    self.staleness[reply.staleness] += 1
                    self.dropped += ReplyFlag.DROPPED in reply.flags

    @property
    def staleness_mean(self) -> float:
        """Mean staleness of this worker's gradients (as reported by the first shard)."""
        count = sum(self.staleness.values())
        return sum(s * n for s, n in self.staleness.items()) / count if count else 0.0
