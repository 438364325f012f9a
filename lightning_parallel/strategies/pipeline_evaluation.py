"""The evaluation half every pipeline engine shares: validation, test and predict as forwards.

:class:`PipelineEvaluation` is the part of
:class:`~lightning_parallel.strategies.pipeline_base.PipelineStrategyBase` that answers
Lightning's ``validation_step``, ``test_step`` and ``predict_step``:

1. the batch is split into ``m`` micro-batches; stage 0 captures each one's model input (the
   other stages capture one, only to build the pipeline when evaluation comes first);
2. the pipeline runs the ``m`` forwards alone (no backward, no weight update), in the
   precision plugin's context for the hook;
3. on the last stage the micro-batches' outputs are merged back into one batch's output and
   the user's step method runs once on it (``forward`` patched to return it), so a metric sees
   the batch as it would on one device;
4. what the last stage logged is replayed on every rank (``ModelCheckpoint`` and
   ``EarlyStopping`` find their monitored key wherever they run).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from typing_extensions import override

from lightning_parallel.pipeline.export_split import merge_outputs
from lightning_parallel.pipeline.microbatch import batch_size, split_microbatches
from lightning_parallel.pipeline.summary import LogRecorder
from lightning_parallel.strategies.pipeline_training import PipelineTraining

__all__: list[str] = []


class PipelineEvaluation(PipelineTraining):
    """Validation, test and predict as pipelined forwards (see the module docstring)."""

    def _evaluation_step(self, hook: str, context: Callable[[], Any], args: tuple[Any, ...]) -> Any:
        batch, hook_args = args[0], args[1:]
        micro = split_microbatches(batch, self.micro_batches)
        first = self.stage_index == 0
        inputs = None
        if first or self._pipeline is None:
            inputs = [
                self.capture(hook, part, hook_args) for part in (micro if first else micro[:1])
            ]
        pipeline = self.ensure_pipeline(inputs[0] if inputs else ())
        runtime = pipeline.runtime
        with context():
            stats = runtime.run_forward_only(len(micro), inputs if first else None)
        result = None
        recorder = LogRecorder()
        if runtime.is_last:
            outputs = [stats.outputs[j] for j in range(len(micro))]
            sizes = [batch_size(part) for part in micro]
            merged = merge_outputs(outputs, sizes, flat=self._call is not None)
            with context():
                result = self.user_step(hook, batch, hook_args, merged, recorder)
        summary = pipeline.summary.exchange(logged=recorder.combined() if runtime.is_last else ())
        self.replay(summary.logged)
        return result

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        self.set_activity("validation (pipelined forward)")
        return self._evaluation_step(
            "validation_step", self.precision_plugin.val_step_context, args
        )

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._evaluation_step("test_step", self.precision_plugin.test_step_context, args)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._evaluation_step(
            "predict_step", self.precision_plugin.predict_step_context, args
        )
