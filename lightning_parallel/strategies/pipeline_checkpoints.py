"""The pipeline strategies' checkpoints: one whole file from stages held on different ranks.

:class:`PipelineCheckpoints` is the checkpoint half of
:class:`~lightning_parallel.strategies.pipeline_base.PipelineStrategyBase`:

1. **saving**: every rank's checkpoint holds its own stage (its weights, and its optimizer
   state in the layout of the user's optimizer over the whole model:
   :mod:`~lightning_parallel.pipeline.checkpoint_layout`). The owners of group 0 send their
   stage's pieces to rank 0 one stage at a time; rank 0 memory-maps each from a spill folder
   beside the checkpoint, merges them with the split (boundaries, each stage's engine state)
   and writes one consolidated file that loads under any strategy
   (:mod:`~lightning_parallel.pipeline.consolidate`);
2. **resuming**: the file is loaded memory-mapped; the saved boundaries are kept (a resumed run
   builds the same stages) and each rank copies its own stage's weights, optimizer state and
   engine state, once its stage exists (at the first batch), by name;
3. **the end of fit**: :meth:`~PipelineCheckpoints.gather_model_on_rank_zero` gives rank 0
   every stage's weights, stage by stage, whatever the launcher (what ``spawn``/``fork`` hand
   back to the parent; ``trainer.model`` on rank 0 under ``popen``, ``torchrun`` or SLURM);
4. **after a run**: the ranks still hold that run's stages (rank 0 the whole model, the
   others their own stage), so a ``trainer.save_checkpoint`` after ``fit`` gathers them as one
   during ``fit`` does, from the run's pipeline (:attr:`~PipelineCheckpoints._ended`) and the
   engine state taken at the end of ``fit``;
5. **never partial**: a checkpoint whose ``state_dict`` would miss a tensor of the model is
   refused with :class:`~lightning_parallel.files.PartialCheckpointError` before
   anything is written; so is one asked for after the run raised (``OnExceptionCheckpoint``)
   when some rank does not reach it in time (lost, or still blocked inside the step that
   failed): :meth:`~lightning_parallel.strategies.base.ParallelStrategyBase.check_every_rank_saves`.

An engine keeps its own per-stage state (a weight predictor) with :meth:`stage_state` and
:meth:`load_stage_state`.
"""

from __future__ import annotations

import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import torch
import torch.distributed as dist
from typing_extensions import override

from lightning_parallel.compat.private import unwrapped_optimizer
from lightning_parallel.compat.types import StrPath
from lightning_parallel.files import PartialCheckpointError, save_atomically
from lightning_parallel.pipeline.assembly import Pipeline
from lightning_parallel.pipeline.checkpoint_layout import (
    load_whole_model_layout,
    merge_pipeline_checkpoint,
    stage_pieces,
    whole_model_layout,
)
from lightning_parallel.pipeline.consolidate import gather_to_root, local_folder, remove_spill
from lightning_parallel.pipeline.stages import is_deferred
from lightning_parallel.pipeline.topology import PipelineTopology
from lightning_parallel.strategies.base import ParallelStrategyBase

__all__: list[str] = []


class PipelineCheckpoints(ParallelStrategyBase):
    """Save every stage in one checkpoint; resume each rank's own stage from it."""

    #: pipeline stages per group, ``p``
    stages: int
    #: the rank keeps only its stage (an engine that needs the whole model says False)
    owns_stages: ClassVar[bool] = True
    #: this rank's part of the pipeline, once built
    _pipeline: Pipeline | None = None
    #: the pipeline of the run that ended last: the ranks hold its stages until the next run
    #: builds its own, and a checkpoint written meanwhile gathers them through it
    _ended: Pipeline | None = None
    #: :meth:`stage_state` at the end of the last ``fit`` (an engine drops its runtime then)
    _ended_stage_state: dict[str, Any] | None = None
    #: the placement, once the processes exist
    _topology: PipelineTopology | None = None
    #: a gloo group over the world for checkpoint bytes
    _cpu_group: dist.ProcessGroup | None = None
    #: the first layer of stages 1..p-1, once chosen (or read from a checkpoint)
    _boundaries: list[int] | None = None
    #: what a resumed checkpoint still has to give the stage: ``"checkpoint"``, ``"optimizers"``
    _resume: dict[str, Any] | None = None

    if TYPE_CHECKING:  # the placement's, defined by PipelineStrategyBase

        @property
        def group_index(self) -> int: ...

        @property
        def stage_index(self) -> int: ...

    @property
    def _held(self) -> Pipeline | None:
        """The pipeline whose stages the ranks hold now: the running one, else the last."""
        return self._pipeline if self._pipeline is not None else self._ended

    def _owners(self) -> list[int]:
        assert self._topology is not None
        return [self._topology.rank(0, stage) for stage in range(self.stages)]

    def stage_state(self) -> dict[str, Any]:
        """Per-stage state an engine keeps in checkpoints, beside weights and optimizer state
        (default: none). Every rank returns its own stage's; the checkpoint holds every
        stage's under ``"pipeline"``."""
        return {}

    def load_stage_state(self, state: dict[str, Any]) -> None:
        """Resume what :meth:`stage_state` returned for this rank's stage."""

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """This rank's own stage (the other stages arrive in :meth:`save_checkpoint`)."""
        module = self.lightning_module
        assert module is not None
        return {k: v for k, v in module.state_dict().items() if not v.is_meta}

    @override
    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        """This rank's part of the optimizer state, in the layout of the user's optimizer over
        the whole model (:mod:`~lightning_parallel.pipeline.checkpoint_layout`)."""
        inner = unwrapped_optimizer(optimizer)
        names = getattr(inner, "_lp_parameter_names", None)
        pipeline = self._held
        if names is None or pipeline is None:
            return inner.state_dict()
        return whole_model_layout(inner, names, pipeline.name_of)

    @override
    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: StrPath, storage_options: Any | None = None
    ) -> None:
        """Every stage's pieces to rank 0, one at a time; rank 0 writes one whole checkpoint.

        Raises:
            PartialCheckpointError: the file would miss some of the model's tensors (nothing is
                written).
        """
        module = self.lightning_module
        assert module is not None
        order = list(module.state_dict())  # every tensor's name, meta ones too
        pipeline = self._held
        if pipeline is None or self.world_size == 1 or not self.owns_stages:
            if self.is_global_zero:
                self._write(checkpoint, filepath, storage_options, order)
            return
        self.check_every_rank_saves("their stages", filepath)
        pieces = stage_pieces(checkpoint, self._stage_state_to_save())
        spill = None
        if self.is_global_zero:
            spill = Path(tempfile.mkdtemp(prefix=".lp-stages-", dir=local_folder(filepath)))
        try:
            gathered = gather_to_root(
                pieces if self.group_index == 0 else None,
                self._owners(),
                root=0,
                spill=spill,
                group=self._cpu_group,
            )
            if gathered is not None:  # rank 0
                merged = merge_pipeline_checkpoint(checkpoint, gathered, order, pipeline.boundaries)
                self._write(merged, filepath, storage_options, order)
        finally:
            remove_spill(spill)
        self.barrier("pipeline checkpoint written")

    def _stage_state_to_save(self) -> dict[str, Any]:
        state = self.stage_state()
        if not state and self._pipeline is None and self._ended_stage_state is not None:
            return self._ended_stage_state  # the engine's runtime ended with the last fit
        return state

    def _write(
        self,
        checkpoint: dict[str, Any],
        filepath: StrPath,
        storage_options: Any,
        order: list[str],
    ) -> None:
        check_whole(checkpoint.get("state_dict", {}), order, filepath)
        if "://" in str(filepath) or storage_options is not None:
            self.checkpoint_io.save_checkpoint(
                checkpoint, filepath, storage_options=storage_options
            )
        else:
            save_atomically(checkpoint, filepath)

    @override
    def load_checkpoint(
        self, checkpoint_path: StrPath, *args: Any, **kwargs: Any
    ) -> dict[str, Any]:
        if "://" in str(checkpoint_path):
            checkpoint = super().load_checkpoint(checkpoint_path, *args, **kwargs)
        else:
            # memory-mapped: a rank copies its own stage and touches nothing else
            checkpoint = torch.load(
                checkpoint_path, map_location="cpu", mmap=True, weights_only=False
            )
        pipeline = checkpoint.get("pipeline")
        if pipeline and self._boundaries is None and len(pipeline["boundaries"]) == self.stages - 1:
            self._boundaries = [int(b) for b in pipeline["boundaries"]]  # resume the same split
        self._resume = {"checkpoint": checkpoint}
        return checkpoint

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        module = self.lightning_module
        assert module is not None
        if self._pipeline is not None or not is_deferred(module):
            full = checkpoint["state_dict"]
            if self._pipeline is not None:  # keep the other stages on meta
                owned = set(self._pipeline.owned_names)
                full = {k: v for k, v in full.items() if k in owned}
            module.load_state_dict(full, strict=strict and self._pipeline is None)
        # else: applied to the owned tensors once the stage is materialized (_apply_resume)

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        # applied by name to the rebuilt optimizer (_apply_resume_optimizers)
        self._resume = {**(self._resume or {}), "optimizers": checkpoint["optimizer_states"]}
        if self._pipeline is not None:
            self._apply_resume_optimizers()

    def _apply_resume(self, pipeline: Pipeline) -> None:
        checkpoint = (self._resume or {}).get("checkpoint")
        if checkpoint is None:
            return
        module = self.lightning_module
        assert module is not None
        saved = checkpoint.get("state_dict", {})
        with torch.no_grad():
            for name, tensor in zip(pipeline.owned_names, pipeline.owned):
                if name in saved:
                    tensor.copy_(saved[name])
        split = checkpoint.get("pipeline") or {}
        if split.get("boundaries") == pipeline.boundaries and len(split["stages"]) == self.stages:
            self.load_stage_state(split["stages"][self.stage_index])
        self._resume = {k: v for k, v in (self._resume or {}).items() if k != "checkpoint"}

    def _apply_resume_optimizers(self) -> None:
        states = (self._resume or {}).get("optimizers")
        if states is None or self._pipeline is None:
            return
        for optimizer, saved in zip(self.optimizers, states):
            inner = unwrapped_optimizer(optimizer)
            names = getattr(inner, "_lp_parameter_names", None)
            if names is None:
                inner.load_state_dict(saved)
            else:
                load_whole_model_layout(inner, saved, names, self._pipeline.name_of)
        self._resume = {k: v for k, v in (self._resume or {}).items() if k != "optimizers"}

    # -- the end of a run -------------------------------------------------------------------

    @override
    def on_train_end(self) -> None:
        super().on_train_end()
        if self.owns_stages:
            self._ended_stage_state = self.stage_state()  # before the engine's runtime goes
            self.gather_model_on_rank_zero()

    @override
    def teardown(self) -> None:
        if self._pipeline is not None:  # its stages stay where they are until the next run
            self._ended, self._pipeline = self._pipeline, None
        super().teardown()

    def gather_model_on_rank_zero(self) -> None:
        """Give rank 0 every stage's weights, one stage at a time (collective). Rank 0 then
        holds the whole model (what the spawn/fork launchers hand back to the parent)."""
        if self._pipeline is None or self.world_size == 1:
            return
        module = self.lightning_module
        assert module is not None
        spill = Path(tempfile.mkdtemp(prefix=".lp-model-")) if self.is_global_zero else None
        try:
            gathered = gather_to_root(
                self.lightning_module_state_dict() if self.group_index == 0 else None,
                self._owners(),
                root=0,
                spill=spill,
                group=self._cpu_group,
            )
            if gathered is not None:
                whole = {k: v.clone() for part in gathered for k, v in part.items()}
                module.load_state_dict(whole, strict=False, assign=True)
        finally:
            remove_spill(spill)


def check_whole(state_dict: Mapping[str, Any], order: list[str], filepath: StrPath) -> None:
    """Raise :class:`PartialCheckpointError` unless ``state_dict`` holds every name in
    ``order`` as a real (not ``meta``) tensor."""
    missing = [
        name
        for name in order
        if name not in state_dict or getattr(state_dict[name], "is_meta", False)
    ]
    if missing:
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        shown = ", ".join(missing[:5]) + more
        raise PartialCheckpointError(
            f"refusing to write {filepath}: it would miss {len(missing)} of the model's "
            f"{len(order)} tensors ({shown}), held by other pipeline stages. Call "
            "trainer.save_checkpoint on every rank (it gathers the stages; a call on rank 0 "
            "alone cannot), in the processes that ran the pipeline"
        )
