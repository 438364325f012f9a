"""Assembly: the part of every pipeline strategy that turns the user's model into stages.

:class:`PipelineAssembly` is the part of
:class:`~lightning_parallel.strategies.pipeline_base.PipelineStrategyBase` that builds this
rank's part of the pipeline, once, before the first training batch (or at the first evaluation
batch), from one micro-batch's model input:

1. **the split module**: the stage-0 model input is captured by calling the user's step with
   ``forward`` patched (:mod:`~lightning_parallel.pipeline.patching`); which module is split
   is named, static, or discovered from that call
   (:mod:`~lightning_parallel.pipeline.discovery`);
2. **the layers**: the module becomes a layer chain
   (:mod:`~lightning_parallel.pipeline.export_split`), kept across runs (a traced body cannot
   be traced again once other stages' tensors are released) and repointed at the model's
   tensors of a later run;
3. **the boundaries**: explicit, from split points, or chosen by profiling or estimating the
   layers (:func:`~lightning_parallel.pipeline.assembly.choose_boundaries`), under the schedule,
   recomputation and flushing the engine runs;
4. **ownership** (:func:`~lightning_parallel.pipeline.assembly.assemble`): the other stages'
   tensors go to ``meta``, a deferred stage is materialized, a resumed checkpoint is applied to
   the owned tensors, and every optimizer is rebuilt over them with its hyperparameters and
   schedulers kept.

Extension points for an engine: :meth:`PipelineAssembly.gradient_sync`,
:meth:`PipelineAssembly.held_elsewhere` and :meth:`PipelineAssembly.put_back_layers`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from pytorch_lightning.trainer.states import TrainerFn
from torch import Tensor, nn
from typing_extensions import override

from lightning_parallel.compat.private import attached_trainer, unwrapped_optimizer
from lightning_parallel.pipeline.assembly import (
    Pipeline,
    assemble,
    check_forward_is_layers,
    choose_boundaries,
    normal_tensors,
)
from lightning_parallel.pipeline.discovery import (
    SplitTarget,
    discover,
    split_point_boundaries,
    static_target,
)
from lightning_parallel.pipeline.export_split import split_layers, stage_zero_inputs
from lightning_parallel.pipeline.grad_sync import PartitionGradientSync
from lightning_parallel.pipeline.ownership import (
    TensorNames,
    TensorSlot,
    repoint,
    restrict_optimizers,
    tensor_slots,
)
from lightning_parallel.pipeline.partition import PartitionPlan
from lightning_parallel.pipeline.patching import capture_call
from lightning_parallel.pipeline.schedule import Schedule
from lightning_parallel.pipeline.stages import is_deferred, put_back, split_stages
from lightning_parallel.pipeline.topology import ProcessGroups
from lightning_parallel.strategies.pipeline_evaluation import PipelineEvaluation

__all__: list[str] = []


class PipelineAssembly(PipelineEvaluation):
    """Build this rank's part of the pipeline from the user's model (see the module docstring).

    :class:`~lightning_parallel.strategies.pipeline_base.PipelineStrategyBase` sets the
    attributes below in its constructor and its placement.
    """

    flushes = True  # every step ends with the pipeline drained (SpecTrain's never is)
    #: the recomputation mode the runtime and the partitioner assume (GroPipe's ``recompute``)
    recompute: str = "never"
    #: the schedule the partitioner models (GroPipe's; ``None``: 1F1B)
    schedule: Schedule | None = None

    #: ``"auto"``, ``"estimate"``, ``"even"`` or the boundaries
    partition: str | list[int]
    memory_limit_bytes: float | None
    profile_repeats: int
    #: the module to split by name (``None``: static or discovered)
    split_module: str | None
    split_points: list[str] | None
    #: the partitioner's projection of the chosen split, once chosen
    partition_plan: PartitionPlan | None
    #: the pipeline and data-parallel process groups, once the processes exist
    _groups: ProcessGroups | None
    #: the split module's layers, kept across runs, and their slots of the model's tensors
    _layers: list[nn.Module] | None
    _layer_slots: list[TensorSlot]
    _target: SplitTarget | None
    #: every tensor's name before any was replaced (the user's optimizer refers to these)
    _names: dict[int, str]
    #: the tensors ownership replaced, by the id of the original
    _replaced: dict[int, Tensor]

    @property
    def boundaries(self) -> list[int] | None:
        """The layer index where each stage after the first starts, once chosen (setup)."""
        return None if self._boundaries is None else list(self._boundaries)

    def put_back_layers(self, originals: Mapping[nn.Module, nn.Module]) -> None:
        """Refer to ``originals[m]`` wherever the layers kept for the next run refer to a
        replacement ``m`` (one walk over them): an engine calls it when it puts back layers it
        replaced for one run (GroPipe's deferred BatchNorm). The layers are kept across runs
        (a traced body cannot be traced again once other stages' tensors are released), so
        without this the next run (``validate`` after ``fit``) would build its stages from the
        replacements, whose tensors a device move (CUDA to the CPU and back) has left behind."""
        if self._layers is None or not originals:
            return
        self._layers = put_back(self._layers, originals)

    def held_elsewhere(self) -> list[nn.Module]:
        """Modules outside the model that refer to its tensors (layers an engine replaced and
        will put back); ownership moves their tensors too (an engine's hook; default: none)."""
        return []

    @property
    def _body(self) -> nn.Module:
        """The module the pipeline splits (:mod:`~lightning_parallel.pipeline.discovery`):
        before the step has run, the ``LightningModule`` where only the step can tell."""
        module = self.lightning_module
        assert module is not None
        target = self._target or static_target(module, self.split_module)
        return module if target is None else target.module

    @override
    def capture(self, hook: str, micro_batch: Any, hook_args: Sequence[Any]) -> tuple[Any, ...]:
        """The positional arguments the user's ``hook`` passes to the split module's
        ``forward`` (which module that is, decided on the first call)."""
        module = self.lightning_module
        assert module is not None
        if self._target is None:
            target = static_target(module, self.split_module)
            self._target = target or discover(module, hook, micro_batch, hook_args)
        args, kwargs = capture_call(module, self._target.module, hook, micro_batch, hook_args)
        self._call, inputs = stage_zero_inputs(self._call, self._layers is not None, args, kwargs)
        return inputs

    @override
    def ensure_pipeline(self, example_args: tuple[Any, ...]) -> Pipeline:
        """Build this rank's part of the pipeline (once) from one micro-batch's model input."""
        if self._pipeline is not None:
            return self._pipeline
        module = self.lightning_module
        assert module is not None and self._topology is not None and self._groups is not None
        body = self._body
        with torch.inference_mode(False), torch.enable_grad():
            example = normal_tensors(example_args)
            assert self._target is not None
            if self._target.how == "layers" and not is_deferred(module):
                check_forward_is_layers(module, body, example)
            if self._layers is None:
                self._layers, self._call, example = split_layers(body, example, self._call)
                self._layer_slots = tensor_slots(self._layers, module)
            else:  # a later run: the model's tensors may be new ones (gathered, moved)
                repoint(self._layer_slots, module)
            layers = self._layers
            boundaries, plan = self._choose_boundaries(layers, example)
        stages = split_stages(layers, boundaries)
        # every tensor's name before any is replaced: the user's optimizer refers to these
        self._names = TensorNames.of(module).name_of()
        self._pipeline, self._replaced = assemble(
            module,
            stages,
            boundaries,
            plan,
            self._names,
            release=self.owns_stages,
            held_elsewhere=self.held_elsewhere,
            topology=self._topology,
            groups=self._groups,
            rank=self.global_rank,
            device=self.root_device,
            recompute=self.recompute,
            gradient_sync=self.gradient_sync,
        )
        self._boundaries, self.partition_plan = boundaries, plan
        self._ended = None  # the ranks now hold this run's stages
        self._apply_resume(self._pipeline)
        trainer = attached_trainer(module)
        fitting = trainer is not None and trainer.state.fn == TrainerFn.FITTING
        if fitting and self.optimizers and self.owns_stages:
            # every optimizer rebuilt over this stage's parameters, its schedulers repointed
            schedulers = [config.scheduler for config in self.lr_scheduler_configs]
            self.optimizers = restrict_optimizers(
                [unwrapped_optimizer(o) for o in self.optimizers],
                self._pipeline.owned,
                self._replaced,
                self._names,
                schedulers,
            )
            self._apply_resume_optimizers()
        return self._pipeline

    def gradient_sync(self, parameters: list[nn.Parameter]) -> PartitionGradientSync | None:
        """The stage's gradient averaging across groups (an engine's hook; default: GroPipe's
        per-partition delayed allreduce)."""
        assert self._groups is not None and self._topology is not None
        return PartitionGradientSync(parameters, self._groups.data_parallel, self._topology.groups)

    def _choose_boundaries(
        self, layers: Sequence[nn.Module], example: tuple[Any, ...]
    ) -> tuple[list[int], PartitionPlan | None]:
        if self._boundaries is not None:
            return self._boundaries, self.partition_plan
        how = self.partition
        if self.split_points is not None:
            how = split_point_boundaries(layers, self._body, self.split_points)
        return choose_boundaries(
            layers,
            example,
            how=how,
            stages=self.stages,
            micro_batches=self.micro_batches,
            profile_repeats=self.profile_repeats,
            memory_limit_bytes=self.memory_limit_bytes,
            schedule=self.schedule.name if self.schedule is not None else "1f1b",
            recompute=self.recompute,
            topology=self._topology,
            rank=self.global_rank,
            world_size=self.world_size,
            device=lambda: self.root_device,
            flushing=self.flushes,
        )
