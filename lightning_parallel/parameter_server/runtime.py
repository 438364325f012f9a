"""Everything one rank runs for the parameter server: its shards, its client, its heartbeat.

:class:`ParameterServerRuntime` is built on every rank at once (it creates a process group,
a collective call) from the rank's trained parameters and the user's optimizer:

1. a gloo process group for parameter-server traffic only, so that its point-to-point messages
   (from server threads) never interleave with Lightning's collectives on the default group,
   and a second one for checkpoint state; the shards and every message are on the CPU, whatever
   the workers' device (the device rule of :mod:`lightning_parallel.comm.devices`);
2. the flat layout of the parameters and the host of each shard: shard k on rank
   ``(server_rank + k) % world_size``;
3. on a hosting rank, the :class:`ShardServer` (optimizer: the user's class, hyperparameters and
   parameter groups, restricted to the shard:
   :mod:`~lightning_parallel.parameter_server.shard_optimizer`) inside a :class:`ShardHost`;
4. the rank's :class:`ParameterClient`, its :class:`Heartbeat` and, on hosts, the
   :class:`Watchdog` over the other workers;
5. the list of workers lost so far (:meth:`ParameterServerRuntime.lost_workers`), published by
   shard 0's host in the store before any reply tells the workers how many there are.

Plain torch: the Lightning strategy and the tests drive it the same way.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import distributed_c10d as c10d
from torch.optim import Optimizer

from lightning_parallel.comm.devices import side_group
from lightning_parallel.comm.liveness import Watchdog
from lightning_parallel.parameter_server.budget import EpochBudget
from lightning_parallel.parameter_server.client import ParameterClient
from lightning_parallel.parameter_server.faults import Heartbeat, heartbeat_store
from lightning_parallel.parameter_server.host import ShardHost
from lightning_parallel.parameter_server.layout import ShardLayout
from lightning_parallel.parameter_server.policies import UpdatePolicy
from lightning_parallel.parameter_server.protocol import FailureKind
from lightning_parallel.parameter_server.server import ShardServer, WorkerStatus
from lightning_parallel.parameter_server.shard_optimizer import (
    HyperparameterMirror,
    group_origins,
    optimizer_factory,
    trained_parameters,
)
from lightning_parallel.parameter_server.shard_optimizer import shard_optimizer as shard_optimizer
from lightning_parallel.parameter_server.transfer import recv_state, send_state

__all__: list[str] = []

log = logging.getLogger(__name__)

# The parameter-server group has the run's timeout (comm.groups), not a shorter one: a receive
# that times out makes gloo close every connection of the group, and a worker may legitimately
# be silent for a whole validation. Failures are detected sooner by heartbeats and connection
# loss; the timeout bounds what those miss.


def check_overlap(overlap: bool, policy: UpdatePolicy) -> None:
    """Refuse ``overlap`` with an SSP bound, naming the fix."""
    if overlap and policy.max_staleness is not None:
        raise ValueError(
            "overlap=True computes every gradient on weights one exchange older, which the SSP "
            "bound cannot account for; drop max_staleness (unbounded) or set overlap=False"
        )


class ParameterServerRuntime:
    """The parameter server's shards, client and failure detection on this rank.

    Args:
        optimizer: the user's optimizer on this rank; its parameters are trained, its class and
            hyperparameters run on the shards (it never steps itself).
        policy: the update rules.
        shards: number of shards (each owns whole parameters; ``<= world size``).
        server_rank: rank hosting shard 0.
        timeout: seconds of heartbeat silence after which a worker counts as failed; also how
            long :meth:`close` waits for the other workers to leave.
        run_batches: batches the whole run may take (``max_steps``), ``None`` for no limit.
        lookahead: batches each worker keeps granted ahead.
        overlap: workers compute their next batch while a step's exchange is in flight
            (:class:`ParameterClient`); needs unbounded staleness (``max_staleness=None``).
        lends: this rank starts at most one batch between two requests, so the server may lend
            its spare granted batches to faster workers (:class:`ParameterClient`).
        wire_dtype: dtype of gradients and weights between ranks (``None``: the parameters'
            own; ``torch.bfloat16`` halves the bytes; the shards keep full precision).
        keep_trace: record every gradient's (worker, staleness) on the shards (tests).
        continue_without_lost: a failed worker that hosts no shard and is not rank 0 is lost
            and the others go on (:meth:`lost_workers`); ``False``: every failure stops the run.
    """

    def __init__(
        self,
        optimizer: Optimizer,
        policy: UpdatePolicy,
        *,
        shards: int = 1,
        server_rank: int = 0,
        timeout: float = 60.0,
        run_batches: int | None = None,
        lookahead: int = 2,
        overlap: bool = False,
        lends: bool = True,
        wire_dtype: torch.dtype | None = None,
        keep_trace: bool = False,
        continue_without_lost: bool = True,
    ) -> None:
        if not dist.is_initialized():
            raise RuntimeError("the parameter server needs torch.distributed to be initialised")
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        if not 0 <= server_rank < self.world_size:
            raise ValueError(f"server_rank must be in [0, {self.world_size}), got {server_rank}")
        if not 1 <= shards <= self.world_size:
            raise ValueError(
                f"shards must be in [1, world size {self.world_size}] (one shard per rank at "
                f"most), got {shards}"
            )
        if timeout <= 0:
            raise ValueError(f"timeout must be > 0 seconds, got {timeout}")
        check_overlap(overlap, policy)
        self.optimizer = optimizer
        self.policy = policy
        self.timeout = float(timeout)
        parameters = trained_parameters(optimizer)
        if not parameters:
            raise ValueError("the optimizer has no parameters to train")
        dtypes = {parameter.dtype for parameter in parameters}
        if len(dtypes) != 1:
            raise ValueError(
                f"the parameter server needs all trained parameters in one dtype, got "
                f"{sorted(map(str, dtypes))}; cast the model (e.g. model.float())"
            )
        self.parameters = parameters
        self.layout = ShardLayout.balanced([p.shape for p in parameters], shards)
        self.hosts = [(server_rank + shard) % self.world_size for shard in range(shards)]
        self.group = side_group()  # gloo, with the run's timeout (comm.groups)
        # checkpoint state (CPU tensors) travels apart from the server threads' messages
        self.state_group = side_group()
        workers = list(range(self.world_size))
        self.store = heartbeat_store(str(self.group.group_name))
        # the run goes on without a lost worker unless it hosts a shard or is rank 0 (the
        # rendezvous store, Lightning's loggers and checkpoints); it cannot without a store
        expendable = (
            set(workers) - set(self.hosts) - {0}
            if continue_without_lost and self.store is not None
            else set()
        )
        self._lost: list[tuple[int, str]] = []
        self.local_hosts: dict[int, ShardHost] = {}
        for shard, host_rank in enumerate(self.hosts):
            if host_rank != self.rank:
                continue
            first, stop = self.layout.bounds[shard]
            server = ShardServer(
                parameters[first:stop],
                optimizer_factory(optimizer, first),
                policy,
                workers,
                expendable=expendable,
                budget=EpochBudget(run_batches, share=policy.max_staleness != 0)
                if shard == 0
                else None,
                before_update=HyperparameterMirror(
                    optimizer, group_origins(optimizer, first, stop - first)
                ),
            )
            server.statistics.keep_trace = keep_trace
            self.local_hosts[shard] = ShardHost(
                server,
                shard,
                self.rank,
                workers,
                self.group,
                wire_dtype=wire_dtype,
                on_lost=self._publish_lost if shard == 0 else None,
            )
        self.client = ParameterClient(
            self.rank,
            parameters,
            self.layout,
            self.hosts,
            self.group,
            self.local_hosts,
            lookahead,
            overlap=overlap,
            lends=lends,
            wire_dtype=wire_dtype,
        )
        for host in self.local_hosts.values():
            host.start()
        self._heartbeat: Heartbeat | None = None
        self._watchdog: Watchdog | None = None
        store = self.store
        if store is not None:
            self._heartbeat = Heartbeat(store, self.rank, interval=min(2.0, self.timeout / 4))
            if self.local_hosts:
                self._watchdog = Watchdog(store, self._watched, self.timeout, self._silent)
        self.closed = False

    # ------------------------------------------------------------------ failure detection

    def _watched(self) -> list[int]:
        host = next(iter(self.local_hosts.values()))
        return [
            rank
            for rank in host.server.live_workers
            if rank != self.rank and host.server.status(rank) != WorkerStatus.LEFT
        ]

    def _silent(self, rank: int, seconds: float) -> None:
        for host in self.local_hosts.values():
            host.fail(
                rank,
                f"no heartbeat from worker rank {rank} for {seconds:.1f} s",
                FailureKind.SILENT,
            )

    def _publish_lost(self, rank: int, reason: str) -> None:
        # before any reply carries the new count (the host holds its lock), so that every
        # worker that reads the count finds the rank
        assert self.store is not None
        index = len(self.local_hosts[0].server.lost) - 1
        self.store.set(f"lost/{index}", f"{rank}\n{reason}")
        self.store.add("lost/count", 1)

    def published_lost(self) -> int:
        """How many workers shard 0's server has gone on without so far (asks the store)."""
        return 0 if self.store is None else int(self.store.add("lost/count", 0))

    def lost_workers(self, count: int | None = None) -> list[tuple[int, str]]:
        """``(rank, reason)`` of the first ``count`` workers the server went on without, in
        order (default: as many as this worker's last reply from shard 0 said; the same list
        on every worker after a drain)."""
        count = self.client.lost if count is None else count
        while len(self._lost) < count:
            assert self.store is not None
            text = self.store.get(f"lost/{len(self._lost)}").decode("utf-8", errors="replace")
            rank, _, reason = text.partition("\n")
            self._lost.append((int(rank), reason))
        return list(self._lost)

    @property
    def failure(self) -> tuple[int, str] | None:
        """``(rank, reason)`` of a failure a shard on this rank detected, else ``None``."""
        for host in self.local_hosts.values():
            if host.failure is not None:
                return host.failure
        return None

    # ------------------------------------------------------------------ telemetry

    def take_bytes(self) -> float:
        """Bytes this rank sent (requests, gradients, and replies of its shards) since last call."""
        return self.client.take_bytes() + sum(
            host.take_bytes() for host in self.local_hosts.values()
        )

    def gauges(self) -> dict[str, float]:
        """This rank's figures: its own waits and staleness; on shard hosts, the shard's."""
        figures = {
            "ps_wait_s": self.client.wait_seconds,
            "ps_wait_drain_s": self.client.drain_wait_seconds,
            "ps_own_staleness_mean": self.client.staleness_mean,
            "ps_gradients_sent": float(self.client.gradients_sent),
        }
        for shard, host in sorted(self.local_hosts.items()):
            prefix = "" if shard == 0 else f"shard{shard}_"
            figures.update(host.server.statistics.gauges(prefix))
            figures[f"{prefix}ps_version"] = float(host.server.version)
        return figures

    # ------------------------------------------------------------------ state

    def gather_state(self) -> tuple[dict[str, Any], dict[str, Any]] | None:
        """Collect every shard's optimizer state and counters on rank 0 (call on all ranks).

        Returns, on rank 0, ``(optimizer_state, server_state)`` where ``optimizer_state`` has
        the user's optimizer layout (loadable by the same optimizer under any strategy);
        ``None`` elsewhere. Meant for epoch boundaries (nothing pending).
        """
        optimizer_state: dict[int, dict[str, Any]] = {}
        versions: list[int] = []
        statistics: list[Tensor] = []
        run_remaining: int | None = None
        for shard, host_rank in enumerate(self.hosts):
            first = self.layout.bounds[shard][0]
            if host_rank == self.rank:
                server = self.local_hosts[shard].server
                state = server.optimizer.state_dict()["state"]
                counters = torch.cat(
                    [
                        torch.tensor([server.version], dtype=torch.int64),
                        server.statistics.to_tensor(),
                    ]
                )
                if shard == 0 and server.budget is not None:
                    run_remaining = server.budget.run_remaining
            else:
                state, counters = {}, torch.zeros(0, dtype=torch.int64)
            if host_rank != 0:  # move it to rank 0 with tensors only, on the gloo state group
                group = self.state_group
                if self.rank == host_rank:
                    send_state(state, 0, group=group)
                    size = torch.tensor([counters.numel()], dtype=torch.int64)
                    c10d.send(size, 0, group=group)
                    c10d.send(counters, 0, group=group)
                elif self.rank == 0:
                    state = recv_state(host_rank, group=group)
                    size = torch.zeros(1, dtype=torch.int64)
                    c10d.recv(size, host_rank, group=group)
                    counters = torch.zeros(int(size.item()), dtype=torch.int64)
                    c10d.recv(counters, host_rank, group=group)
            if self.rank == 0:
                for index, values in state.items():
                    optimizer_state[first + int(index)] = values
                versions.append(int(counters[0].item()))
                statistics.append(counters[1:])
        if self.rank != 0:
            return None
        param_groups = self.optimizer.state_dict()["param_groups"]
        server_state = {
            "format": 1,
            "shards": self.layout.shards,
            "versions": versions,
            "statistics": statistics,
            "run_remaining": run_remaining,
            "policy": repr(self.policy),
        }
        return {"state": optimizer_state, "param_groups": param_groups}, server_state

    def load_state(
        self, optimizer_state: dict[str, Any] | None, server_state: dict[str, Any] | None
    ) -> None:
        """Restore the shards hosted here from a checkpoint read on this rank.

        Args:
            optimizer_state: the user's optimizer state (the layout :meth:`gather_state` gives,
                which is also what any other strategy saves).
            server_state: versions and counters from :meth:`gather_state`, or ``None``.
        """
        for shard, host in self.local_hosts.items():
            first, stop = self.layout.bounds[shard]
            server = host.server
            state: dict[str, Any] = {"version": server.version}
            if optimizer_state is not None:
                own = server.optimizer.state_dict()
                origins = group_origins(self.optimizer, first, stop - first)
                for group, origin in zip(own["param_groups"], origins):
                    saved = optimizer_state["param_groups"][origin]
                    group.update({k: v for k, v in saved.items() if k != "params"})
                own["state"] = {
                    int(index) - first: values
                    for index, values in optimizer_state["state"].items()
                    if first <= int(index) < stop
                }
                state["optimizer"] = own
            if server_state is not None and server_state.get("shards") == self.layout.shards:
                state["version"] = int(server_state["versions"][shard])
                server.statistics.load_tensor(server_state["statistics"][shard])
                if shard == 0 and server.budget is not None:
                    server.budget.run_remaining = server_state.get("run_remaining")
            elif server_state is not None:
                log.warning(
                    "checkpoint has %s parameter-server shards, this run %d: versions restart at 0",
                    server_state.get("shards"),
                    self.layout.shards,
                )
            with host._lock:
                server.load_state_dict(state)
        if server_state is not None and server_state.get("shards") == self.layout.shards:
            # every worker's model was loaded from the same checkpoint, which holds the shards'
            # weights at these versions: the server counts each worker as having read them,
            # so the worker's next gradient must say so (it said 0, and the server refused it)
            self.client.read_versions = [int(version) for version in server_state["versions"]]

    def set_run_batches(self, run_batches: int | None) -> None:
        """Change the run's batch limit (on the first shard's host)."""
        host = self.local_hosts.get(0)
        if host is not None and host.server.budget is not None:
            host.server.budget.run_remaining = run_batches

    # ------------------------------------------------------------------ shutdown

    def close(self, failed: bool = False) -> None:
        """Leave the server and stop this rank's threads (call on every rank at the end).

        After a failure (``failed``: the run raised; or a shard here saw one) nothing waits, not
        even the goodbye to a server that may be the peer that failed: the threads are daemons
        and are abandoned.
        """
        if self.closed:
            return
        self.closed = True
        failed = failed or self.failure is not None
        if not failed:
            try:
                self.client.leave()
            except Exception as error:  # a peer is gone; the run already ended
                log.warning("parameter server: could not say goodbye: %s", error)
                failed = True
        for shard, host in self.local_hosts.items():
            still = host.close(0.0 if failed else self.timeout)
            if still and not failed:
                log.warning(
                    "parameter-server shard %d: ranks %s did not leave within %.0f s",
                    shard,
                    still,
                    self.timeout,
                )
                failed = True
        if self._watchdog is not None:
            self._watchdog.stop(wait=not failed)
        if self._heartbeat is not None:
            self._heartbeat.stop(wait=not failed)
        if not failed:
            dist.destroy_process_group(self.group)
            dist.destroy_process_group(self.state_group)
