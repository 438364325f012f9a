"""Place ``g`` groups of ``p`` stages on ``g·p`` ranks and build their process groups.

GroPipe's mesh has two axes: *pipeline* (the ``p`` stages of one group, one model replica)
and *data parallel* (the ``g`` replicas of one stage). Rank of stage ``k`` in group ``i``:

``placement="pipeline"`` (default)::

    rank(i, k) = i·p + (p − 1 − k)

  the ranks of a group are consecutive: on a multi-host cluster with ``p`` processes per host a
  pipeline stays on one host, and only the data-parallel allreduce crosses hosts (best when the
  activations at the cuts outweigh the gradients);

``placement="stage"``::

    rank(i, k) = (p − 1 − k)·g + i

  the replicas of a stage are consecutive: with ``g`` processes per host a stage's
  data-parallel allreduce stays on one host, and only the activations and their gradients
  cross hosts (best when the gradients outweigh the activations, as in VGG-like models whose
  parameters sit in the classifier; DeepSpeed's default placement).

Either way the *last* stage comes first, so global rank 0 holds the last stage of group 0:
the stage that computes the loss, where Lightning's loggers and progress bar live.

For 2 groups of 3 stages::

    rank:   0  1  2  3  4  5
    group:  0  0  0  1  1  1
    stage:  2  1  0  2  1  0
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

from lightning_parallel.comm.devices import group_device, side_group
from lightning_parallel.comm.groups import new_group

__all__: list[str] = []

PLACEMENTS: tuple[str, ...] = ("pipeline", "stage")


@dataclass(frozen=True)
class PipelineTopology:
    """The (group, stage) coordinates of every rank of ``world_size = groups · stages``."""

    world_size: int
    stages: int
    placement: str = "pipeline"

    def __post_init__(self) -> None:
        if self.placement not in PLACEMENTS:
            raise ValueError(f"placement must be one of {PLACEMENTS}, got {self.placement!r}")
        if self.stages < 1:
            raise ValueError(f"stages must be at least 1, got {self.stages}")
        if self.world_size % self.stages:
            raise ValueError(
                f"world size {self.world_size} is not a multiple of stages={self.stages}; "
                f"launch a multiple of {self.stages} processes (devices x nodes), or change stages"
            )

    @property
    def groups(self) -> int:
        return self.world_size // self.stages

    def rank(self, group: int, stage: int) -> int:
        if self.placement == "stage":
            return (self.stages - 1 - stage) * self.groups + group
        return group * self.stages + (self.stages - 1 - stage)

    def group_of(self, rank: int) -> int:
        if self.placement == "stage":
            return rank % self.groups
        return rank // self.stages

    def stage_of(self, rank: int) -> int:
        if self.placement == "stage":
            return self.stages - 1 - rank // self.groups
        return self.stages - 1 - rank % self.stages

    def pipeline_ranks(self, group: int) -> list[int]:
        """Global ranks of ``group``'s stages, by stage index."""
        return [self.rank(group, stage) for stage in range(self.stages)]

    def data_parallel_ranks(self, stage: int) -> list[int]:
        """Global ranks holding ``stage``, by group index."""
        return [self.rank(group, stage) for group in range(self.groups)]


@dataclass
class ProcessGroups:
    """This rank's process groups (:mod:`lightning_parallel.comm.devices` gives the device rule).

    Attributes:
        pipeline: the stages of this rank's pipeline: activations travel on it, forward.
        data_parallel: this stage in every pipeline: gradient averaging.
        pipeline_backward: the same ranks as ``pipeline``, for the gradients travelling
            backward (``None``: ``pipeline``). On NCCL the two directions between a pair of
            stages then have their own communicators and streams, so that a send forward never
            waits behind a receive backward queued on the same stream.
        bookkeeping: a gloo group over the same ranks as ``pipeline``, for the host's values
            (the end-of-step summary, gradient norms); ``None``: ``pipeline``.
    """

    pipeline: dist.ProcessGroup | None
    data_parallel: dist.ProcessGroup | None
    pipeline_backward: dist.ProcessGroup | None = None
    bookkeeping: dist.ProcessGroup | None = None


def build_process_groups(topology: PipelineTopology, rank: int) -> ProcessGroups:
    """Create every pipeline and data-parallel group (collectively, on every rank, in the same
    order) and return those that contain ``rank``; with more than one stage on CUDA also each
    pipeline's backward group and gloo bookkeeping group."""
    pipeline = data_parallel = backward = bookkeeping = None
    for group in range(topology.groups):
        ranks = topology.pipeline_ranks(group)
        created = new_group(ranks)
        if rank in ranks:
            pipeline = created
    for stage in range(topology.stages):
        ranks = topology.data_parallel_ranks(stage)
        created = new_group(ranks)
        if rank in ranks:
            data_parallel = created
    # on CUDA (NCCL), gradients get a group of their own and host values a gloo group; on
    # gloo one group carries everything, matched by tags
    if topology.stages > 1 and group_device(None).type == "cuda":
        for group in range(topology.groups):
            ranks = topology.pipeline_ranks(group)
            created, side = new_group(ranks), side_group(ranks)
            if rank in ranks:
                backward, bookkeeping = created, side
    return ProcessGroups(pipeline, data_parallel, backward, bookkeeping)
