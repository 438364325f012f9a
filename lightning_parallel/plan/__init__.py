"""Predict each strategy's step time, bytes per step and memory for a model on a cluster.

Plain torch, no Lightning: a :class:`~lightning_parallel.plan.profile.StepProfile` measured in
one process (:mod:`~lightning_parallel.plan.measure`), a
:class:`~lightning_parallel.plan.network.Cluster` and the collective laws
(:mod:`~lightning_parallel.plan.network`), and one predictor per strategy family
(:mod:`~lightning_parallel.plan.data_parallel`, :mod:`~lightning_parallel.plan.hylo`,
:mod:`~lightning_parallel.plan.averaging`,
:mod:`~lightning_parallel.plan.parameter_server`, :mod:`~lightning_parallel.plan.pipelines`),
dispatched by :mod:`~lightning_parallel.plan.planner`. ``lightning-parallel plan``
(:mod:`lightning_parallel.bench.plan`) takes the profile of a ``LightningModule``.
"""

__all__: list[str] = []
