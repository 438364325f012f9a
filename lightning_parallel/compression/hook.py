"""A DDP communication hook that compresses each layer's gradient by its type (Hylo).

DDP calls the hook once per gradient bucket, in bucket order on every rank, during the
backward pass. The hook:

1. hands the bucket to a background thread (on CPU: :mod:`.background`), so that the exchange
   overlaps with the rest of the backward pass; buckets start one at a time in bucket order,
   and a bucket's last round waits until the next one has started (``overlap_buckets``);
2. maps the bucket's flat buffer to parameters and from parameters to names: error-feedback
   state is keyed by name, so it survives DDP's bucket rebuild after the first iteration;
3. during the first ``warmup_steps`` optimizer steps averages the buffer with a plain allreduce
   (exactly DDP); afterwards with :class:`~lightning_parallel.compression.HyloExchange`
   (dense, kernel-selection, low-rank, two-phase 2-bit or allgather routes);
4. on the first ``calibration_steps`` compressed steps times each layer's codec (a local trial
   of each candidate where a layer has several: :mod:`.trials`) and the link (bytes sent over
   seconds waited; on CUDA the device is synchronised around each timed part), from which the
   :class:`~lightning_parallel.compression.CostModel` decides, identically on every rank,
   which candidate each layer keeps and which layers go back to the dense allreduce (their
   residuals are flushed into it); see :mod:`.calibration`.

Without the background thread (CUDA, or ``overlap=False``) the exchange runs inside the hook
call, and a bucket whose layers are all uncompressed takes torch's asynchronous allreduce,
exactly as in DDP.
"""

import os
import time
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_parallel.comm.accounting import ring_allreduce_bytes
from lightning_parallel.comm.agreement import check_same_settings, plain_attributes
from lightning_parallel.comm.devices import to_group
from lightning_parallel.compression.background import BackgroundThread
from lightning_parallel.compression.calibration import Calibration
from lightning_parallel.compression.cost_model import CostModel
from lightning_parallel.compression.error_feedback import ErrorFeedback
from lightning_parallel.compression.exchange import (
    HyloExchange,
    LayerGradient,
    LayerReport,
    check_piece_numel,
    resolve_piece_numel,
)
from lightning_parallel.compression.exchange_step import no_sync
from lightning_parallel.compression.policy import HyloPolicy, LayerPlan
from lightning_parallel.compression.telemetry import StepAverages, exchange_gauges

__all__: list[str] = []


#: a started bucket: what finishes it, its future, its buffer
_Deferred = tuple[Callable[[], None], torch.futures.Future[Tensor], Tensor]


class HyloHook:
    """State and entry point of the Hylo DDP communication hook.

    Args:
        named_parameters: the wrapped module's parameters with their names
            (``ddp.module.named_parameters()``); names key the residuals in checkpoints.
        policy: which codec compresses which parameter (default :class:`HyloPolicy`).
        warmup_steps: optimizer steps averaged uncompressed first (plain allreduce).
        two_bit_exchange: ``"auto"`` (default), ``"two_phase"`` or ``"allgather"`` (see
            :class:`~lightning_parallel.compression.HyloExchange`).
        cost_model: per-layer fallback to uncompressed when the codec costs more than it saves;
            ``None`` compresses every layer the policy names.
        calibration_steps: first compressed steps on which bandwidth and codec time are
            measured (the cost model decides at the end of the last one).
        process_group: the DDP process group (``None``: the default group).
        seed: seed of the stochastic codecs' noise (rank ``r`` uses ``seed + r``).
        overlap: run the exchange on a background thread so that it overlaps with the rest of
            the backward pass (buckets still run one at a time, in order, so the collectives
            match across ranks). ``None``: on for CPU tensors, off for CUDA ones (NCCL
            already runs on its own stream); ``True`` with CUDA tensors raises.
        piece_numel: values per pipelined piece of a large 2-bit layer (encoded, sent and
            decoded piece by piece, on the allgather and the two-phase routes); ``None``: one
            message per bucket; ``"auto"`` (default): 524288 for CPU gradients, ``None`` for
            CUDA ones, where pieces lost more than they gained in two measurements (see
            :class:`~lightning_parallel.compression.HyloExchange`).
        overlap_buckets: on the background thread, finish a bucket (its last wait, decoding)
            once the next bucket has issued its collectives: the same gradients, bit for bit.

    Example::

        ddp = DistributedDataParallel(model)
        hook = HyloHook(ddp.module.named_parameters(), HyloPolicy(conv_rate=0.05))
        hook.register(ddp)
    """

    def __init__(
        self,
        named_parameters: Iterable[tuple[str, nn.Parameter]],
        policy: HyloPolicy | None = None,
        warmup_steps: int = 0,
        two_bit_exchange: str = "auto",
        cost_model: CostModel | None = None,
        calibration_steps: int = 2,
        process_group: Any = None,
        seed: int = 0,
        overlap: bool | None = None,
        piece_numel: int | str | None = "auto",
        overlap_buckets: bool = True,
    ) -> None:
        self.piece_numel = check_piece_numel(piece_numel)
        if warmup_steps < 0:
            raise ValueError(f"warmup_steps must be >= 0, got {warmup_steps}")
        named = list(named_parameters)
        self.policy = policy if policy is not None else HyloPolicy()
        self.names = {id(param): name for name, param in named}
        policy_plans = self.policy.plan(named)
        self.plans: dict[str, LayerPlan] = dict(policy_plans)
        self.warmup_steps = warmup_steps
        self.process_group = process_group
        self.memory = ErrorFeedback()
        self.calibration = Calibration(
            self.policy, policy_plans, cost_model, warmup_steps, calibration_steps, self.memory
        )
        self.server_memory = ErrorFeedback()
        self.exchange = HyloExchange(
            self.memory,
            self.server_memory,
            two_bit_exchange,
            group=process_group,
            piece_numel=None,  # set at the first exchange, from the gradients' device
        )
        self.step = 0
        self.calls = 0
        self.reports: dict[str, LayerReport] = {}
        self.overlap = overlap
        self._seed = seed
        self._seeded = False
        self._thread: BackgroundThread | None = None
        self.overlap_buckets = overlap_buckets
        self.overlapped = 0  # buckets finished after the next one had started
        self.averages = StepAverages()  # the background thread's time per steady step
        # a bucket whose last round waits for the next bucket's start (background thread)
        self._deferred: _Deferred | None = None
        self._agreed = False  # the ranks' settings were compared (at the first exchange)
        self._disagreement: Exception | None = None

    # -- registration ---------------------------------------------------------------------

    def register(self, ddp: nn.parallel.DistributedDataParallel) -> None:
        """Register this hook on ``ddp`` (before its first backward)."""
        if getattr(ddp, "_comm_hooks", None):
            raise RuntimeError(
                "this DistributedDataParallel module already has a communication hook (DDP "
                "allows one): remove the other hook (for example the strategy's "
                "ddp_comm_hook) or do not add Hylo"
            )
        ddp.register_comm_hook(self, HyloHook.communicate)

    # No ``from __future__ import annotations`` in this module: DDP checks these two annotations
    # by identity (``dist.GradBucket``, ``Future[Tensor]``) and rejects strings.
    @staticmethod
    def communicate(state: "HyloHook", bucket: dist.GradBucket) -> torch.futures.Future[Tensor]:
        """The function DDP calls per bucket (``state`` is the :class:`HyloHook`)."""
        return state.run(bucket)

    # -- the hook -------------------------------------------------------------------------

    @property
    def compressing(self) -> bool:
        """Whether the warm-up is over (gradients are now compressed)."""
        return self.step >= self.warmup_steps

    def run(self, bucket: dist.GradBucket) -> torch.futures.Future[Tensor]:
        """Average one bucket; return a future that will hold the averaged buffer."""
        self._seed_codecs()
        self.calls += 1
        buffer = bucket.buffer()
        params = list(bucket.parameters())
        is_last = bucket.is_last()
        overlap = self.overlap if self.overlap is not None else buffer.device.type == "cpu"
        if overlap and buffer.device.type != "cpu":
            raise ValueError(
                "overlap=True runs the exchange on a host thread, for CPU gradients; CUDA "
                "gradients already overlap (NCCL runs on its own stream): use overlap=None"
            )
        if not overlap:
            return self._average(buffer, params, is_last, blocking=False)
        future: torch.futures.Future[Tensor] = torch.futures.Future()
        thread, handed = self._background(), time.perf_counter()
        if bucket.index() == 0 and self.step >= self.warmup_steps + self.calibration.steps:
            self.averages.step_begins(thread, self.step)  # a steady step: counted from here
        thread.submit(lambda: self._complete(future, buffer, params, is_last, handed))
        return future

    def average_flat(self, buffer: Tensor, params: list[Tensor]) -> None:
        """Average ``buffer`` across ranks in place, as one bucket holding ``params``' values.

        ``buffer`` is flat, the values of ``params`` one after the other (as in a DDP bucket);
        it is averaged with the same routes, residuals and warm-up as the gradients, blocking.
        This is how model averaging exchanges a round's model delta through Hylo.
        """
        self._seed_codecs()
        self.calls += 1
        self._average(buffer, params, is_last=True, blocking=True).wait()

    def _complete(
        self,
        future: torch.futures.Future[Tensor],
        buffer: Tensor,
        params: list[Tensor],
        is_last: bool,
        handed: float,
    ) -> None:
        """Run one bucket on the background thread and settle ``future`` (errors included).
        With ``overlap_buckets`` its last round runs once the next bucket's collectives are
        issued (at once for the step's last bucket): the next one's encoding overlaps with it.
        ``handed``: when DDP handed the bucket over; for the step's last bucket, the time from
        then until it is settled is the exchange left exposed after the backward pass.
        """
        try:
            finish, _ = self._begin(buffer, params, is_last, blocking=True)
        except BaseException as error:  # DDP re-raises it in the training loop
            self._settle_deferred()
            future.set_exception(error)  # type: ignore[arg-type]
            return
        if self._deferred is not None:
            self.overlapped += 1
        self._settle_deferred()
        self._deferred = (finish, future, buffer)
        if is_last or not self.overlap_buckets:
            self._settle_deferred()
        if is_last:
            self.averages.add_tail(time.perf_counter() - handed)

    def _settle_deferred(self) -> None:
        """Finish the deferred bucket, if any, and settle its future."""
        if self._deferred is None:
            return
        (finish, future, buffer), self._deferred = self._deferred, None
        try:
            finish()
            future.set_result(buffer)
        except BaseException as error:
            future.set_exception(error)  # type: ignore[arg-type]

    def _background(self) -> "BackgroundThread":  # a thread does not survive fork
        if self._thread is None or self._thread.pid != os.getpid():
            self._thread = BackgroundThread()
        return self._thread

    def _average(
        self, buffer: Tensor, params: list[Tensor], is_last: bool, blocking: bool
    ) -> torch.futures.Future[Tensor]:
        finish, future = self._begin(buffer, params, is_last, blocking)
        finish()
        return future

    def _begin(
        self, buffer: Tensor, params: list[Tensor], is_last: bool, blocking: bool
    ) -> tuple[Callable[[], None], torch.futures.Future[Tensor]]:
        """Start averaging one bucket: every collective is issued when this returns. Returns
        what finishes it (round 3 of a compressed exchange; nothing for a dense one) and the
        future of the averaged buffer (settled once it is finished)."""
        self._agree(buffer.device)
        layers = self._layers(params, buffer)
        world = dist.get_world_size(self.process_group)
        compressed = any(layer.plan.compressed for layer in layers)
        finish: Callable[[], None] = no_sync  # nothing to finish
        if self.compressing and compressed:
            calibrating = self.calibration.calibrating(self.step)
            # the cost model needs the device's times, not the launches' (CUDA synchronises
            # then), and the link's alone (layers travel unpipelined then)
            self.exchange.calibrating = calibrating
            if calibrating:
                self.calibration.try_candidates(layers, world)
            pending = self.exchange.start(layers)

            def finish() -> None:
                reports = self.exchange.finish(pending)
                self.reports.update(reports)
                if calibrating:
                    self.calibration.observe(reports, self.plans, self.exchange.last_wait_seconds)

            if calibrating:  # measured alone, before the cost model decides
                finish()
                finish = no_sync
            future: torch.futures.Future[Tensor] = torch.futures.Future()
            future.set_result(buffer)
        else:
            future = self._allreduce(buffer, layers, world, blocking)
        if is_last:
            self.step += 1
            if self.calibration.decides_after(self.step):
                self.plans = self.calibration.decide(self.process_group)
        return finish, future

    def _layers(self, params: list[Tensor], buffer: Tensor) -> list[LayerGradient]:
        layers = []
        offset = 0
        for param in params:
            numel = param.numel()
            name = self.names.get(id(param))
            if name is None:
                raise RuntimeError(
                    "a DDP bucket holds a parameter the Hylo hook was not built with: build "
                    "HyloHook from ddp.module.named_parameters() of the same module"
                )
            layers.append(LayerGradient(self.plans[name], buffer[offset : offset + numel]))
            offset += numel
        if offset != buffer.numel():
            raise RuntimeError(
                f"DDP bucket layout not understood: parameters hold {offset} values, the buffer "
                f"{buffer.numel()}"
            )
        return layers

    def _agree(self, device: torch.device) -> None:
        """Before the first exchange, resolve ``piece_numel`` for the gradients' device and
        check that every rank has the settings that decide the routes and the messages' sizes
        (one collective; see :mod:`lightning_parallel.comm.agreement`). A disagreement, or a
        failed check, raises on every rank, at this bucket and at every later one, with no
        further communication (with ``overlap``, DDP has queued the later buckets already)."""
        if self._disagreement is not None:
            error = self._disagreement  # a new exception: one raised again gathers frames
            if isinstance(error, ValueError):
                raise ValueError(*error.args)
            raise RuntimeError(f"HyloHook could not compare the ranks' settings: {error}")
        if self._agreed:
            return
        self.exchange.piece_numel = resolve_piece_numel(self.piece_numel, device)
        try:
            check_same_settings(self._settings(), self.process_group, owner="HyloHook")
        except Exception as error:
            self._disagreement = error
            raise
        self._agreed = True

    def _settings(self) -> dict[str, object]:
        """What every rank must share: the pieces, the exchange, the warm-up and calibration,
        the cost model's settings, the step reached, each layer's route and codec settings."""
        plans = tuple(
            (plan.name, plan.shape, plan.route, plain_attributes(plan.codec))
            for _, plan in sorted(self.plans.items())
        )
        cost_model = self.calibration.cost_model
        return {
            "piece_numel": self.exchange.piece_numel,
            "two_bit_exchange": self.exchange.two_bit_exchange,
            "warmup_steps": self.warmup_steps,
            "calibration_steps": self.calibration.calibration_steps,
            "cost_model": None if cost_model is None else plain_attributes(cost_model),
            "step": self.step,
            "plans": plans,
        }

    def _allreduce(
        self, buffer: Tensor, layers: list[LayerGradient], world: int, blocking: bool
    ) -> torch.futures.Future[Tensor]:
        """Plain DDP averaging: divide, then allreduce (torch's allreduce hook)."""
        rank = dist.get_rank(self.process_group)
        for layer in layers:  # residuals of layers the cost model turned back to dense
            self.exchange.flush(layer, world, rank)
        self._report_dense(layers, world)
        buffer = to_group(buffer.div_(world), self.process_group)  # DDP's: no copy
        if blocking:
            dist.all_reduce(buffer, group=self.process_group)
            done: torch.futures.Future[Tensor] = torch.futures.Future()
            done.set_result(buffer)
            return done
        work = dist.all_reduce(buffer, group=self.process_group, async_op=True)
        return work.get_future().then(lambda future: future.value()[0])

    def _report_dense(self, layers: list[LayerGradient], world: int) -> None:
        for layer in layers:
            nbytes = layer.gradient.numel() * layer.gradient.element_size()
            dense = ring_allreduce_bytes(nbytes, world)
            self.reports[layer.plan.name] = LayerReport(bytes_sent=dense, dense_bytes=dense)

    # -- stochastic codecs ----------------------------------------------------------------

    def _seed_codecs(self) -> None:
        if self._seeded:
            return
        self._seeded = True
        rank = dist.get_rank(self.process_group) if dist.is_initialized() else 0
        for codec in self.policy.codecs().values():
            random = getattr(codec, "random", None)
            if random is not None and not random.state_dict()["generators"]:
                random.reseed(self._seed + rank)

    # -- telemetry ------------------------------------------------------------------------

    def gauges(self, per_layer: bool = True) -> dict[str, float]:
        """Latest per-layer and total costs, as ledger gauges (``CommStats`` logs them; see
        :func:`~lightning_parallel.compression.telemetry.exchange_gauges`); on the background
        thread also its means per step since the calibration
        (:class:`~lightning_parallel.compression.telemetry.StepAverages`)."""
        gauges = exchange_gauges(
            self.reports, self.plans, self.memory, self.server_memory, per_layer
        )
        gauges["hylo/hook_calls"] = float(self.calls)
        gauges["hylo/compressed_layers"] = float(sum(p.compressed for p in self.plans.values()))
        return {**gauges, **self.averages.gauges(self.step)}

    # -- checkpointing --------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """This rank's state: step, residuals, codec generators, cost-model decisions."""
        cost_model = self.calibration.cost_model
        return {
            "step": self.step,
            "calls": self.calls,
            "memory": self.memory.state_dict(),
            "server_memory": self.server_memory.state_dict(),
            "codecs": {name: codec.state_dict() for name, codec in self.policy.codecs().items()},
            "cost_model": None if cost_model is None else cost_model.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any], device: torch.device | None = None) -> None:
        """Restore what :meth:`state_dict` returned (residuals moved to ``device``)."""
        self.step = int(state["step"])
        self.calls = int(state["calls"])
        self.memory.load_state_dict(state["memory"], device)
        self.server_memory.load_state_dict(state["server_memory"], device)
        codecs = self.policy.codecs()
        for name, codec_state in state["codecs"].items():
            if name in codecs:
                codecs[name].load_state_dict(codec_state)
        cost_model = self.calibration.cost_model
        if cost_model is not None and state.get("cost_model") is not None:
            cost_model.load_state_dict(state["cost_model"])
            self.plans = self.calibration.plans_for(cost_model.decisions)
