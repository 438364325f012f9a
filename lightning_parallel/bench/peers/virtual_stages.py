"""Pipeline peers with several stages per rank: torch's interleaved and zero-bubble schedules.

``torch_interleaved_1f1b`` (``ScheduleInterleaved1F1B``), ``torch_zb``
(``ScheduleInterleavedZeroBubble``), ``torch_zbv`` (``ScheduleZBVZeroBubble``) and
``torch_dualpipev`` (``ScheduleDualPipeV``), built as torch's documentation and torchtitan build
them:

1. the model's layers are cut into ``p·v`` *virtual* stages with the same number of layers
   each (``v = virtual_stages`` per rank; the V-shaped schedules need ``v = 2``);
2. a rank of the pipeline group holds the virtual stages torch's schedule assigns it:
   *looped* (interleaved 1F1B, interleaved zero bubble) rank ``r`` holds ``r, r + p, …``;
   *V-shaped* (ZBV, DualPipeV) rank ``r`` holds ``r`` and ``2p − 1 − r``, so that rank 0 runs
   both the first and the last virtual stage;
3. one ``PipelineStage`` per virtual stage, all of a rank's given to the schedule, which runs
   forward, input-gradient backward and (zero-bubble schedules) weight-gradient backward
   actions in its own order.

torch numbers a rank by its place in the pipeline group (global-rank order). This package's
pipelines put the last stage first (global rank 0 computes the loss,
:mod:`~lightning_parallel.pipeline.topology`). The V-shaped schedules fit that order as it
is: their rank 0 runs the first and the last virtual stage, so the rank that computes the loss
is also the one given the inputs. The looped schedules give the first virtual stage to rank 0
and the last to rank ``p − 1``: their pipelines are placed in natural order
(:class:`LoopedTopology`: stage ``k`` of group ``i`` is global rank ``i·p + k``), so the loss
is on stage ``p − 1`` as everywhere else, and global rank 0 feeds the inputs.

Every rank keeps the whole model (no stage is released to ``meta``): its optimizer steps the
parameters its virtual stages computed gradients for (the others have none). Before evaluation
and at the end of training every virtual stage's weights are copied from the rank that trains
them, and evaluation runs the package's pipelined forward over ``p`` stages. Like the one-stage
torch peers, the Lightning side is :class:`~lightning_parallel.strategies.gropipe.GroPipeStrategy`'s
and several groups average gradients after the step.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import Tensor, nn

from lightning_parallel.bench.peers.torch_pipelining import OneCut, TorchPipeliningStrategy
from lightning_parallel.bench.peers.whole_model import WholeModelPeer
from lightning_parallel.bench.specs import register_baseline
from lightning_parallel.comm.ledger import process_ledger
from lightning_parallel.pipeline.assembly import Pipeline
from lightning_parallel.pipeline.consolidate import broadcast_stage_state
from lightning_parallel.pipeline.ownership import stage_tensors
from lightning_parallel.pipeline.runtime import StepStatistics
from lightning_parallel.pipeline.stages import StageModule, even_boundaries, split_stages
from lightning_parallel.pipeline.summary import SummaryResult
from lightning_parallel.pipeline.topology import PipelineTopology

__all__: list[str] = []

#: peer name -> (torch's schedule class, V-shaped, splits backward into input and weight parts)
SCHEDULES: dict[str, tuple[str, bool, bool]] = {
    "interleaved_1f1b": ("ScheduleInterleaved1F1B", False, False),
    "zb": ("ScheduleInterleavedZeroBubble", False, True),
    "zbv": ("ScheduleZBVZeroBubble", True, True),
    "dualpipev": ("ScheduleDualPipeV", True, True),
}


@dataclass(frozen=True)
class LoopedTopology(PipelineTopology):
    """Pipelines in natural order: stage ``k`` of group ``i`` is global rank ``i·p + k``
    (``placement="stage"``: ``k·g + i``), so that torch's pipeline-group rank ``k`` is stage
    ``k``."""

    def rank(self, group: int, stage: int) -> int:
        if self.placement == "stage":
            return stage * self.groups + group
        return group * self.stages + stage

    def stage_of(self, rank: int) -> int:
        if self.placement == "stage":
            return rank // self.groups
        return rank % self.stages


def virtual_stages_of(role: int, stages: int, virtual: int, v_shaped: bool) -> list[int]:
    """The virtual stages torch's schedule gives pipeline-group rank ``role`` (of ``stages``
    ranks, ``virtual`` stages each)."""
    if v_shaped:
        return [role, 2 * stages - 1 - role]
    return [role + i * stages for i in range(virtual)]


class TorchVirtualStagesStrategy(WholeModelPeer, TorchPipeliningStrategy):
    """torch's schedules with several stages per rank (see the module docstring).

    Args:
        stages: ranks per pipeline, ``p``.
        micro_batches: micro-batches per batch.
        schedule: ``"interleaved_1f1b"``, ``"zb"``, ``"zbv"`` or ``"dualpipev"``.
        virtual_stages: stages per rank, ``v`` (2 for the V-shaped schedules).
        **kwargs: passed to :class:`TorchPipeliningStrategy`.
    """

    def __init__(
        self,
        stages: int = 2,
        micro_batches: int = 8,
        schedule: str = "interleaved_1f1b",
        virtual_stages: int = 2,
        **kwargs: Any,
    ) -> None:
        if schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {sorted(SCHEDULES)}, got {schedule!r}")
        _, self.v_shaped, self.splits_backward = SCHEDULES[schedule]
        if self.v_shaped and virtual_stages != 2:
            raise ValueError(
                f"torch_{schedule} runs exactly 2 virtual stages per rank (a V), got "
                f"virtual_stages={virtual_stages}"
            )
        if virtual_stages < 1:
            raise ValueError(f"virtual_stages must be at least 1, got {virtual_stages}")
        kwargs.setdefault("defer_weight_gradients", False)
        super().__init__(stages=stages, micro_batches=micro_batches, schedule="1f1b", **kwargs)
        self.torch_schedule = schedule
        self.virtual_stages = virtual_stages
        self._peer_name = f"torch_{schedule}"
        self._chunks: list[StageModule] = []
        self.topology_kind = PipelineTopology if self.v_shaped else LoopedTopology

    @property
    def role(self) -> int:
        """This rank's place in torch's pipeline group (the group is in global-rank order)."""
        return self._flip(self.stage_index)

    def _flip(self, index: int) -> int:
        """A stage index as a torch role and back: the V placement numbers them last stage
        first (``p−1−index``, its own inverse), the looped one in order."""
        return self.stages - 1 - index if self.v_shaped else index

    def _owner(self, chunk: int) -> int:
        """Global rank of group 0 that trains virtual stage ``chunk``."""
        p = self.stages
        role = chunk % p if not self.v_shaped else min(chunk, 2 * p - 1 - chunk)
        return self._placement.rank(0, self._flip(role))

    @property
    def _mine(self) -> list[int]:
        return virtual_stages_of(self.role, self.stages, self.virtual_stages, self.v_shaped)

    def holds_ends(self) -> tuple[bool, bool]:
        mine = self._mine
        return 0 in mine, self.stages * self.virtual_stages - 1 in mine

    def feeds_pipeline(self) -> bool:
        return self.holds_ends()[0]

    def _cut(self) -> list[StageModule]:
        if not self._chunks:
            assert self._layers is not None
            count = self.stages * self.virtual_stages
            if len(self._layers) < count:
                raise ValueError(
                    f"{self._peer_name} cuts the model into {count} virtual stages of at least "
                    f"one layer; this model has {len(self._layers)} layers: use fewer stages "
                    "or virtual_stages"
                )
            self._chunks = split_stages(self._layers, even_boundaries(len(self._layers), count))
        return self._chunks

    def held_modules(self, pipeline: Pipeline) -> list[nn.Module]:
        chunks = self._cut()
        return [chunks[k] for k in self._mine]

    def trained_parameters(self, pipeline: Pipeline) -> list[nn.Parameter]:
        return [p for m in self.held_modules(pipeline) for p in m.parameters() if p.requires_grad]

    def _stage_module(self, chunk: nn.Module, index: int, total: int) -> nn.Module:
        module = OneCut(chunk) if index > 0 else chunk
        if self.splits_backward and index < total - 1:
            return FreshOutput(module)
        return module

    def _build_schedule(
        self, pipeline: Pipeline, count: int, loss: Callable[[Tensor, Tensor], Tensor]
    ) -> Any:
        from torch.distributed.pipelining import PipelineStage, schedules

        assert self._groups is not None
        chunks = self._cut()
        total = len(chunks)
        held = [
            PipelineStage(
                self._stage_module(chunks[k], k, total),
                k,
                total,
                self.root_device,
                group=self._groups.pipeline,
            )
            for k in self._mine
        ]
        assert all(stage.group_rank == self.role for stage in held), "placement and torch disagree"
        kind = getattr(schedules, SCHEDULES[self.torch_schedule][0])
        return kind(held, n_microbatches=count, loss_fn=loss, scale_grads=False)

    def record(self, summary: SummaryResult, stats: StepStatistics, count: int) -> None:
        """Also gauge the virtual stages this rank ran and the weight-gradient actions (zero
        bubble's ``W``) of its part of torch's schedule."""
        super().record(summary, stats, count)
        schedule = self._torch_schedule
        actions = schedule.pipeline_order_with_comms[schedule.rank]
        weight = sum(_weight_actions(a) for a in actions if a is not None)
        ledger = process_ledger()
        ledger.set_gauge("virtual_stages_per_rank", float(len(schedule._stages)))
        ledger.set_gauge("weight_gradient_actions", float(weight))

    def consolidate(self) -> None:
        """Copy every virtual stage's weights from the rank of group 0 that trains it."""
        if not self._chunks or self.world_size == 1:
            return
        owners = [self._owner(k) for k in range(len(self._chunks))]
        broadcast_stage_state([stage_tensors(c) for c in self._chunks], owners, own_stage=-1)


class FreshOutput(nn.Module):
    """A virtual stage whose outputs are copies, for the schedules that split backward.

    torch's input-gradient backward detaches the stage's outputs in place once the input
    gradients are computed; when the stage's last operation saved its own output for its
    backward (a ReLU, a Tanh: every convolutional block), the weight-gradient backward that
    follows then fails ("a saved tensor that has been detached in-place"). A copy of the
    output, one activation-sized copy per micro-batch, is what may be detached.
    """

    def __init__(self, stage: nn.Module) -> None:
        super().__init__()
        self.stage = stage

    def forward(self, *inputs: Any) -> Any:
        output = self.stage(*inputs)
        if isinstance(output, Tensor):
            return output.clone()
        return tuple(t.clone() if isinstance(t, Tensor) else t for t in output)


def _weight_actions(action: Any) -> int:
    """Weight-gradient actions in one of torch's schedule actions (an overlapped forward and
    backward holds several)."""
    own = int(getattr(action.computation_type, "value", None) == "W")
    return own + sum(_weight_actions(a) for a in action.sub_actions or ())


def _peer(schedule: str) -> Callable[..., TorchVirtualStagesStrategy]:
    def build(**options: Any) -> TorchVirtualStagesStrategy:
        return TorchVirtualStagesStrategy(schedule=schedule, **options)

    return build


for _name, (_kind, _v, _) in SCHEDULES.items():
    register_baseline(
        f"torch_{_name}",
        _peer(_name),
        f"torch.distributed.pipelining {_kind}, "
        + ("2 virtual stages per rank in a V" if _v else "virtual_stages (2) per rank, looped")
        + ", even split by layers",
    )
