"""Pipeline model parallelism in plain torch: stages, partitioner, schedules, stage runtimes.

Lightning-free: the GroPipe strategy (``lightning_parallel.strategies.gropipe``) and the
SpecTrain strategy (``lightning_parallel.strategies.spectrain``) drive these pieces from
Lightning's training loop. Two techniques share the room:

- ``pipeline/``: the pieces both share (stages, partitioning and profiling, micro-batches,
  schedule tables, transport between stages, topology, gradient sync across groups, the
  end-of-step summary, timeline, stage ownership, a rank's assembly, the user's step patched,
  device moves of a model partly on ``meta``, checkpoint layout and consolidation) and the
  flush pipeline, GroPipe: its stage runtime (``runtime``), recomputation, deferred weight
  gradients and batch norm, the hybrid learning-rate decay.
- ``pipeline/noflush/``: the pipeline that never flushes (SpecTrain, PipeDream), its runtime and
  the weight predictors that correct its staleness (:mod:`lightning_parallel.pipeline.noflush`
  lists its modules).

The public names of both are re-exported here.
"""

from lightning_parallel.pipeline.batchnorm import (
    BatchNormCommit,
    DeferredBatchNorm,
    commit_deferred_batch_norm,
    convert_deferred_batch_norm,
    restore_batch_norm,
)
from lightning_parallel.pipeline.grad_sync import PartitionGradientSync, SyncTiming
from lightning_parallel.pipeline.hybrid_lr import HybridCosineLinearLR
from lightning_parallel.pipeline.microbatch import (
    merge_microbatches,
    microbatch_sizes,
    split_microbatches,
)
from lightning_parallel.pipeline.noflush import (
    PREDICTION_MODES,
    AdamDirection,
    DoubleBufferedWeights,
    LearningRateForecast,
    MomentumBuffer,
    NoFlushPipeline,
    PredictionErrorMeter,
    ScheduledLearningRate,
    SmoothedGradient,
    SpecTrainPrediction,
    StageTelemetry,
    WeightPredictor,
    WeightStashing,
    make_weight_predictor,
    staleness_learning_rate_scale,
)
from lightning_parallel.pipeline.partition import (
    PartitionError,
    PartitionPlan,
    partition,
    plan_for,
    projected_step,
)
from lightning_parallel.pipeline.profile import LayerCost, ModelProfile, profile_layers
from lightning_parallel.pipeline.recompute import RECOMPUTE_MODES, is_recomputing
from lightning_parallel.pipeline.runtime import StageRuntime, StepStatistics
from lightning_parallel.pipeline.schedule import (
    Action,
    GPipeSchedule,
    OneFOneBSchedule,
    Schedule,
    ScheduleTable,
    get_schedule,
    render,
    simulate,
    validate_table,
)
from lightning_parallel.pipeline.stages import (
    PipelineSplitError,
    StageModule,
    even_boundaries,
    layer_sequence,
    pipeline_body,
    split_stages,
)
from lightning_parallel.pipeline.timeline import TimelineEvent, plot_timeline
from lightning_parallel.pipeline.topology import PipelineTopology, build_process_groups
from lightning_parallel.pipeline.transport import StageTransport
from lightning_parallel.pipeline.weight_grad import (
    DeferredGradLinear,
    convert_deferred_weight_gradients,
    deferring_weight_gradients,
    flush_weight_gradients,
    restore_linear,
)

__all__ = [
    "NoFlushPipeline",
    "StageTelemetry",
    "PREDICTION_MODES",
    "AdamDirection",
    "DoubleBufferedWeights",
    "LearningRateForecast",
    "MomentumBuffer",
    "PredictionErrorMeter",
    "ScheduledLearningRate",
    "SmoothedGradient",
    "SpecTrainPrediction",
    "WeightPredictor",
    "WeightStashing",
    "make_weight_predictor",
    "staleness_learning_rate_scale",
    "RECOMPUTE_MODES",
    "Action",
    "BatchNormCommit",
    "DeferredBatchNorm",
    "DeferredGradLinear",
    "GPipeSchedule",
    "HybridCosineLinearLR",
    "LayerCost",
    "ModelProfile",
    "OneFOneBSchedule",
    "PartitionError",
    "PartitionGradientSync",
    "PartitionPlan",
    "PipelineSplitError",
    "PipelineTopology",
    "Schedule",
    "ScheduleTable",
    "StageModule",
    "StageRuntime",
    "StageTransport",
    "StepStatistics",
    "SyncTiming",
    "TimelineEvent",
    "build_process_groups",
    "commit_deferred_batch_norm",
    "convert_deferred_batch_norm",
    "convert_deferred_weight_gradients",
    "deferring_weight_gradients",
    "even_boundaries",
    "flush_weight_gradients",
    "get_schedule",
    "is_recomputing",
    "layer_sequence",
    "merge_microbatches",
    "microbatch_sizes",
    "partition",
    "pipeline_body",
    "plan_for",
    "plot_timeline",
    "profile_layers",
    "projected_step",
    "render",
    "restore_batch_norm",
    "restore_linear",
    "simulate",
    "split_microbatches",
    "split_stages",
    "validate_table",
]
