"""Hylo's calibration: measure the codecs and the link, then keep what pays, per layer.

:class:`Calibration` is the part of :class:`~lightning_parallel.compression.hook.HyloHook` that
runs the :class:`~lightning_parallel.compression.CostModel` (none without one):

1. on each of the first ``calibration_steps`` compressed steps (after the warm-up) the hook
   exchanges every layer alone, unpipelined, and times it on the device:

   - a layer with several candidate codecs (a fully-connected layer's low-rank factors and
     2-bit codes, a convolution's kernel top-k and low-rank factors) has each tried locally
     on its compensated gradient (:func:`~lightning_parallel.compression.trials.try_candidates`:
     seconds, bytes, one step's relative error);
   - every other compressed layer feeds its encode and decode seconds and its bytes;
   - the exchange as a whole feeds the link: its bytes over the seconds it waited;

2. at the end of the last calibration step the ranks agree on the measurements (their maximum,
   one all-reduce), and the cost model decides, identically on every rank, which candidate each
   layer keeps and which layers go back to the dense allreduce (whose residuals the hook then
   flushes into it).
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from lightning_parallel.comm.devices import to_group
from lightning_parallel.compression.cost_model import CostModel
from lightning_parallel.compression.error_feedback import ErrorFeedback
from lightning_parallel.compression.exchange import LayerGradient, LayerReport
from lightning_parallel.compression.policy import DENSE, HyloPolicy, LayerPlan
from lightning_parallel.compression.trials import try_candidates

__all__: list[str] = []

#: compressed steps the cost model measures before it decides (the hook's default)
CALIBRATION_STEPS = 2


class Calibration:
    """The calibration steps and the cost model's decision (see the module docstring).

    Args:
        policy: the hook's policy (its dense codec and error budget).
        plans: every layer's plan as the policy made it (by parameter name).
        cost_model: decides per layer; ``None``: no calibration, every layer as the policy says.
        warmup_steps: uncompressed steps before the calibration starts.
        calibration_steps: compressed steps measured (at least 1 with a cost model).
        memory: the residuals (a candidate's trial compensates the gradient with them).
    """

    def __init__(
        self,
        policy: HyloPolicy,
        plans: dict[str, LayerPlan],
        cost_model: CostModel | None,
        warmup_steps: int,
        calibration_steps: int,
        memory: ErrorFeedback,
    ) -> None:
        if cost_model is not None and calibration_steps < 1:
            raise ValueError(
                "the cost model measures on the first calibration_steps compressed steps: "
                f"calibration_steps must be >= 1, got {calibration_steps}; raise it or pass "
                "cost_model=None"
            )
        self.policy = policy
        self.policy_plans = dict(plans)
        self.candidates: dict[str, list[LayerPlan]] = {
            name: policy.candidates(name, plan.shape) for name, plan in plans.items()
        }
        self.cost_model = cost_model
        self.warmup_steps = warmup_steps
        self.calibration_steps = calibration_steps
        self.memory = memory

    @property
    def steps(self) -> int:
        """Steps that calibrate the cost model (none without one)."""
        return self.calibration_steps if self.cost_model is not None else 0

    def calibrating(self, step: int) -> bool:
        """Whether compressed step ``step`` is measured."""
        return self.warmup_steps <= step < self.warmup_steps + self.steps

    def decides_after(self, step: int) -> bool:
        """Whether the cost model decides once step ``step`` has ended (the last measured)."""
        return self.cost_model is not None and step == self.warmup_steps + self.calibration_steps

    def try_candidates(self, layers: list[LayerGradient], world: int) -> None:
        """Measure every candidate codec of the layers that have several."""
        assert self.cost_model is not None
        for layer in layers:
            candidates = self.candidates.get(layer.plan.name, [])
            if len(candidates) >= 2:
                try_candidates(layer, candidates, self.memory, self.cost_model, world)

    def observe(
        self, reports: dict[str, LayerReport], plans: dict[str, LayerPlan], waited_s: float
    ) -> None:
        """Feed one compressed exchange's timings to the cost model (a layer with several
        candidates was measured by :meth:`try_candidates` instead); ``waited_s``: the seconds
        the exchange waited for the link."""
        assert self.cost_model is not None
        sent = 0.0
        for name, report in reports.items():
            sent += report.bytes_sent
            plan = plans[name]
            if plan.compressed and len(self.candidates.get(name, [])) < 2:
                seconds = report.encode_s + report.decode_s
                self.cost_model.observe_codec(
                    name, seconds, report.dense_bytes, report.bytes_sent, plan.route
                )
        self.cost_model.observe_transfer(sent, waited_s)

    def decide(self, process_group: Any) -> dict[str, LayerPlan]:
        """Agree on the measurements (their maximum over the ranks) and return each layer's
        plan: unprofitable layers dense, the others with the candidate kept."""
        assert self.cost_model is not None
        names = sorted(name for name, plan in self.policy_plans.items() if plan.compressed)
        # host values built on the CPU; on the group's device for the (once per run) exchange
        agreed = to_group(self.cost_model.measurements(names), process_group)
        dist.all_reduce(agreed, op=dist.ReduceOp.MAX, group=process_group)
        return self.plans_for(self.cost_model.decide(names, agreed, self.policy.error_budget))

    def plans_for(self, decisions: dict[str, Any]) -> dict[str, LayerPlan]:
        """Each layer's plan from the cost model's decisions: dense, or the candidate kept."""
        plans = dict(self.policy_plans)
        for name, decision in decisions.items():
            plan = plans.get(name)
            if plan is None:
                continue
            if not decision.compress:
                plans[name] = LayerPlan(name, plan.shape, DENSE, self.policy.dense_codec)
                continue
            for candidate in self.candidates.get(name, []):
                if candidate.route == decision.route:
                    plans[name] = candidate
        return plans
