"""The training half every pipeline engine shares: the micro-batch step, backward and clipping.

:class:`PipelineTraining` is the part of
:class:`~lightning_parallel.strategies.pipeline_base.PipelineStrategyBase` that answers
Lightning's automatic-optimization closure (``training_step``, then ``zero_grad``, then
``backward``, then the optimizer step with its gradient clipping). In a pipeline the engine
runs every micro-batch's forward and backward itself, inside ``training_step``, so:

1. **the step** (:meth:`~PipelineTraining.training_step`, a template; the pipeline is built
   before the first one, at :meth:`~PipelineTraining.on_train_batch_start`, so that the
   optimizer Lightning steps is already the rebuilt one): the batch is split into
   micro-batches (:class:`~lightning_parallel.pipeline.microbatch.MicroBatchStep`); the rank
   that feeds the pipeline (:meth:`~PipelineTraining.feeds_pipeline`) captures every
   micro-batch's model input, the others capture one at the first step only, to build the
   pipeline; the engine's :meth:`~PipelineTraining.train_micro_batches` runs them (the last
   stage's loss of each is the user's ``training_step`` on the pipeline's output) and returns
   the step's loss, which Lightning gets back with the other keys of the last micro-batch's
   result;
2. **backward** runs no autograd (the engine did): the precision plugin's ``pre_backward`` and
   ``post_backward`` around the engine's :meth:`~PipelineTraining.hand_back_gradients`;
3. **clipping by norm** uses the whole model's norm, not the stage's: from setup to teardown
   the precision plugin's ``clip_grad_by_norm`` is replaced by one that multiplies the stage's
   gradients by ``clip / (norm + 1e-6)`` when that is below 1, the norm given by the engine's
   :meth:`~PipelineTraining.gradient_norm` (clipping by value is per element: Lightning's own);
4. **the user's code**: :meth:`~PipelineTraining.user_step` runs a step method with the split
   network's ``forward`` returning the pipeline's output, and
   :meth:`~PipelineTraining.replay` logs on every rank what the last stage logged.
"""

from __future__ import annotations

import inspect
from abc import abstractmethod
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

import pytorch_lightning as pl
import torch
from pytorch_lightning.plugins.precision import MixedPrecision, Precision
from torch import Tensor, nn
from typing_extensions import override

from lightning_parallel.pipeline.assembly import Pipeline
from lightning_parallel.pipeline.export_split import FlatCall
from lightning_parallel.pipeline.microbatch import MicroBatchStep, split_microbatches
from lightning_parallel.pipeline.patching import patched
from lightning_parallel.pipeline.summary import LoggedValue, LogRecorder
from lightning_parallel.strategies.pipeline_checkpoints import PipelineCheckpoints

__all__: list[str] = []


def check_trainable(owner: str, module: pl.LightningModule, precision: Precision) -> None:
    """Refuse what a pipeline cannot train: manual optimization (the pipeline runs forward and
    backward itself) and gradient scaling (``precision="16-mixed"`` on CUDA)."""
    if not module.automatic_optimization:
        raise ValueError(
            f"{owner} needs automatic optimization: the pipeline runs forward and backward "
            "itself. Remove `self.automatic_optimization = False`"
        )
    if isinstance(precision, MixedPrecision) and precision.scaler is not None:
        raise ValueError(
            f"{owner} does not support gradient scaling (precision='16-mixed' on CUDA); use "
            "precision='bf16-mixed' or '32-true'"
        )


class PipelineTraining(PipelineCheckpoints):
    """The shared training step, backward and clipping by norm (see the module docstring)."""

    #: micro-batches per batch, ``m``
    micro_batches: int
    #: what a stage does during a training step (the activity a failure reports)
    step_activity: ClassVar[str] = "pipeline schedule"
    #: how the split module's exported layers are called (``None``: positional, traced)
    _call: FlatCall | None = None

    if TYPE_CHECKING:  # what this half calls of the assembly (PipelineAssembly's)

        def capture(
            self, hook: str, micro_batch: Any, hook_args: Sequence[Any]
        ) -> tuple[Any, ...]: ...

        def ensure_pipeline(self, example_args: tuple[Any, ...]) -> Pipeline: ...

        @property
        def _body(self) -> nn.Module: ...

    # -- the user's code ---------------------------------------------------------------------

    def user_step(
        self,
        hook: str,
        micro_batch: Any,
        hook_args: Sequence[Any],
        output: Any,
        recorder: LogRecorder | None,
    ) -> Any:
        """Call the user's step method with ``forward`` returning the pipeline's ``output``."""
        module = self.lightning_module
        assert module is not None
        log = recorder.log if recorder is not None else (lambda *a, **k: None)
        output = output if self._call is None else self._call.output(output)
        with patched(self._body, "forward", lambda *a, **k: output), patched(module, "log", log):
            return getattr(module, hook)(micro_batch, *hook_args)

    def stage_forward(self, run: Callable[..., Any]) -> Callable[..., Any]:
        """A ``forward`` for the split module that calls ``run`` (the stage) with the
        pipeline's inputs for the user's call and gives its output the module's structure."""
        call = self._call
        if call is None:
            return lambda *args, **kwargs: run(*args)
        return lambda *args, **kwargs: call.output(run(*call.inputs(args, kwargs)))

    def replay(self, logged: Sequence[LoggedValue]) -> None:
        """Log on this rank what the last stage logged (its own metric objects there)."""
        module = self.lightning_module
        assert module is not None
        for value in logged:
            options = dict(value.options)
            if value.metric is not None:
                module.log(value.name, value.metric, **options)
            else:
                options.pop("metric_attribute", None)
                module.log(
                    value.name, torch.tensor(value.value, device=self.root_device), **options
                )

    # -- the training step -------------------------------------------------------------------

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        # build (and take ownership) before Lightning's closure runs, so that the optimizer it
        # steps is the one rebuilt over this stage's parameters
        super().on_train_batch_start(batch, batch_idx)
        if self._pipeline is None:
            module = self.lightning_module
            assert module is not None
            first = split_microbatches(batch, self.micro_batches)[0]
            # what Lightning passes: batch_idx only if training_step takes it
            takes_index = len(inspect.signature(module.training_step).parameters) > 1
            arguments = (batch_idx,) if takes_index else ()
            self.ensure_pipeline(self.capture("training_step", first, arguments))

    def feeds_pipeline(self) -> bool:
        """Whether this rank gives the pipeline its model inputs (default: stage 0)."""
        return self.stage_index == 0

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        """Capture the model inputs, run the engine's :meth:`train_micro_batches`, return the
        step's loss (with the other keys of the last micro-batch's result)."""
        batch, hook_args = args[0], args[1:]
        self.set_activity(f"{self.step_activity} (stage {self.stage_index} of {self.stages})")
        step = MicroBatchStep.split(batch, hook_args, self.micro_batches)
        feeds = self.feeds_pipeline()
        inputs = None
        if feeds or self._pipeline is None:  # others capture once, to build the pipeline
            parts = step.micro if feeds else step.micro[:1]
            inputs = [self.capture("training_step", part, hook_args) for part in parts]
        pipeline = self.ensure_pipeline(inputs[0] if inputs else ())
        loss = self.train_micro_batches(pipeline, step, inputs)
        return step.output(torch.tensor(loss, device=self.root_device))

    @abstractmethod
    def train_micro_batches(
        self, pipeline: Pipeline, step: MicroBatchStep, inputs: list[tuple[Any, ...]] | None
    ) -> float:
        """Run the step's micro-batches through the engine; return the step's loss as this
        rank reports it (an engine's hook).

        Args:
            pipeline: this rank's part of the pipeline.
            step: the micro-batches; the last stage keeps each one's result of the user's
                ``training_step`` with :meth:`MicroBatchStep.loss_of`.
            inputs: the captured model arguments: every micro-batch's where
                :meth:`feeds_pipeline`, the first one's at another rank's first step, else
                ``None``.
        """

    # -- backward ----------------------------------------------------------------------------

    @override
    def backward(self, closure_loss: Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> Tensor:
        """No autograd: the pipeline back-propagated inside ``training_step``."""
        module = self.lightning_module
        assert module is not None
        closure_loss = self.precision_plugin.pre_backward(closure_loss, module)
        self.hand_back_gradients()
        return self.precision_plugin.post_backward(closure_loss, module)

    def hand_back_gradients(self) -> None:
        """Give the parameters the gradients the step computed, for the optimizer step that
        follows ``backward`` (an engine's hook; default: nothing, they are in place)."""

    # -- gradient clipping by norm -----------------------------------------------------------

    def install_gradient_clipping(self) -> None:
        """Make the precision plugin clip by :meth:`gradient_norm` (at setup)."""
        setattr(self.precision_plugin, "clip_grad_by_norm", self._clip_grad_by_norm)  # noqa: B010

    def remove_gradient_clipping(self) -> None:
        """Give the precision plugin back its own clipping by norm (at teardown)."""
        if "clip_grad_by_norm" in vars(self.precision_plugin):
            delattr(self.precision_plugin, "clip_grad_by_norm")

    def _clip_grad_by_norm(self, optimizer: Any, clip_val: float) -> None:
        """``clip_grad_norm_`` with the norm of :meth:`gradient_norm`."""
        norm, parameters = self.gradient_norm(optimizer)
        coefficient = float(clip_val) / (norm + 1e-6)
        if coefficient < 1.0:
            for parameter in parameters:
                if parameter.grad is not None:
                    parameter.grad.mul_(coefficient)

    @abstractmethod
    def gradient_norm(self, optimizer: Any) -> tuple[float, list[nn.Parameter]]:
        """The norm to clip by (the whole model's gradient) and the parameters whose gradients
        clipping scales (an engine's hook)."""
