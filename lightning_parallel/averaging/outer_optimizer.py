"""Outer optimizers (SlowMo, DiLoCo, Lookahead): torch.optim on the pseudo-gradient."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import Tensor
from torch.optim import Optimizer

from lightning_parallel.averaging.averager import Averager, clone_all, move_all

__all__: list[str] = []

#: Builds the outer optimizer over the global model's tensors.
OuterOptimizerFactory = Callable[[list[Tensor]], Optimizer]

#: The ``diloco`` defaults: DiLoCo's outer learning rate, and an outer Nesterov momentum of 0.5
#: rather than the paper's 0.9 (see :func:`diloco_outer_optimizer` for why).
DILOCO_OUTER_LR = 0.7
DILOCO_OUTER_MOMENTUM = 0.5
#: The strategy's default cap on the outer step: no longer than the workers' mean moved.
OUTER_STEP_CAP = 1.0
#: How far past the cap a step may be before it is shortened (float rounding of the norms).
_ROUNDING = 1e-6


class OuterOptimizerAverager(Averager):
    """Step an outer optimizer on the global model with the round's pseudo-gradient.

    Algorithm (global model ``x_g``, outer optimizer ``O``, ``M`` workers):

    1. the workers take ``H`` inner steps from ``x_g`` with their own optimizer; mean ``x̄``;
    2. the pseudo-gradient is ``g = x_g − x̄`` (the direction the workers moved, negated);
    3. ``O`` takes one step on ``x_g`` with gradient ``g``; with a ``step_cap`` ``c``, a step
       ``s`` longer than ``c·‖g‖`` is shortened to that length, its direction kept:
       ``x_g ← x_g_old + s·min(1, c·‖g‖/‖s‖)`` (norms over the whole list of tensors);
    4. every worker restarts from ``x_g``.

    The cap bounds what the outer optimizer adds to the workers' own progress: at ``c = 1``
    the global model never moves further in a round than the workers' mean did (the step of
    plain averaging), so outer momentum can turn the step but not lengthen it. The momentum
    buffer itself is left as the optimizer made it. The cap holds its own copy of ``g`` while
    the optimizer steps (one more copy of the parameters for that moment), as an optimizer may
    write into ``.grad``. Uncapped, DiLoCo's outer step (lr 0.7,
    Nesterov momentum 0.5) was 1.05 to 2.1 times the workers' on ``vgg_mini``, where the
    inner SGD already runs near its stability limit; capped at 1, ``diloco`` and streaming
    DiLoCo no longer collapse on two hosts over seeds 0-9 (one 3-host run without a fault
    ends on the plateau, where ``ddp`` on the same hosts collapses too; docs/averaging_defaults.md,
    "The outer step is capped").

    Instances of the family:

    - DiLoCo (Douillard et al., "DiLoCo: Distributed Low-Communication Training of Language
      Models", 2023): ``O`` = SGD with Nesterov momentum, lr 0.7, momentum 0.9 in the paper,
      inner AdamW; :func:`diloco_outer_optimizer` defaults to momentum 0.5 (its docstring says
      why);
    - SlowMo (Wang, Tantia, Ballas, Rabbat, "SlowMo: Improving Communication-Efficient
      Distributed SGD with Slow Momentum", ICLR 2020): ``O`` = SGD with momentum ``β`` and
      slow learning rate ``α`` (:func:`slowmo_outer_optimizer`);
    - Lookahead (Zhang, Lucas, Hinton, Ba, "Lookahead Optimizer: k steps forward, 1 step back",
      NeurIPS 2019), with ``M`` workers: ``O`` = SGD with lr ``α``, no momentum
      (:func:`lookahead_outer_optimizer`).

    Plain SGD with lr 1 and no momentum gives ``x_g ← x̄``: periodic averaging.

    Args:
        optimizer: builds the outer optimizer from a list of tensors shaped like the model's
            trainable parameters, e.g. ``lambda params: torch.optim.SGD(params, lr=0.7)``.
        step_cap: the longest outer step as a multiple of the pseudo-gradient's norm (default
            ``math.inf``: the optimizer's step as it is; the strategies default to 1.0).

    Attributes:
        capped_rounds: rounds whose step the cap shortened since this averager was built (not
            saved in a checkpoint: a resumed run counts again from 0).

    Example::

        averager = OuterOptimizerAverager(
            lambda params: torch.optim.Adam(params, lr=0.1, betas=(0.9, 0.95))
        )
    """

    def __init__(self, optimizer: OuterOptimizerFactory, step_cap: float = math.inf) -> None:
        super().__init__()
        if not callable(optimizer):
            raise TypeError(
                "optimizer must build a torch.optim.Optimizer from a list of tensors, e.g. "
                "lambda params: torch.optim.SGD(params, lr=0.7, momentum=0.9, nesterov=True)"
            )
        if isinstance(step_cap, bool) or not step_cap > 0:
            raise ValueError(
                f"step_cap must be a positive number (math.inf: no cap), got {step_cap!r}"
            )
        self.optimizer_factory = optimizer
        self.step_cap = float(step_cap)
        self.capped_rounds = 0
        self.global_model: list[Tensor] = []
        self.optimizer: Optimizer | None = None

    def reset(self, start: Sequence[Tensor], world_size: int) -> None:
        super().reset(start, world_size)
        self.global_model = clone_all(start)
        self.optimizer = self._build_optimizer()

    def _build_optimizer(self) -> Optimizer:
        optimizer = self.optimizer_factory(self.global_model)
        if not isinstance(optimizer, Optimizer):
            raise TypeError(
                f"the outer optimizer factory returned {type(optimizer).__name__}; "
                "it must return a torch.optim.Optimizer over the tensors it is given"
            )
        return optimizer

    def update(self, local: Sequence[Tensor], mean: Sequence[Tensor]) -> list[Tensor]:
        if self.optimizer is None:
            raise RuntimeError("OuterOptimizerAverager.reset() must run before its first round")
        capped = math.isfinite(self.step_cap)
        pseudo_gradients = []
        for global_model, average in zip(self.global_model, mean, strict=True):
            pseudo_gradient = global_model - average
            # an optimizer may write into .grad (torch's foreach Nesterov SGD, the default on
            # CUDA, leaves g + μ·buf there): the cap keeps its own g
            global_model.grad = pseudo_gradient.clone() if capped else pseudo_gradient
            pseudo_gradients.append(pseudo_gradient)
        self.optimizer.step()
        if capped:
            self._cap_step(mean, pseudo_gradients)
        del pseudo_gradients
        self.optimizer.zero_grad(set_to_none=True)
        return clone_all(self.global_model)

    @torch.no_grad()
    def _cap_step(self, mean: Sequence[Tensor], pseudo_gradients: Sequence[Tensor]) -> None:
        """Shorten the step the optimizer just took to ``step_cap·‖g‖``, in place (the
        optimizer holds the global model's tensors). The point before the step is ``x̄ + g``;
        the norms are taken one tensor at a time."""
        triples = list(zip(self.global_model, mean, pseudo_gradients, strict=True))
        pseudo_gradient = _norm(pseudo_gradients)
        step = _norm(after - average - gradient for after, average, gradient in triples)
        limit = self.step_cap * pseudo_gradient
        if not step > limit * (1 + _ROUNDING):  # a step of exactly the cap is left as it is
            return
        scale = limit / step
        for after, average, gradient in triples:  # x_g ← (x̄ + g) + scale·(x_g − x̄ − g)
            start = average + gradient
            after.sub_(start).mul_(scale).add_(start)
        self.capped_rounds += 1

    def gauges(self) -> dict[str, float]:
        """``outer_steps_capped``: the rounds the cap shortened, once there is one."""
        return {"outer_steps_capped": float(self.capped_rounds)} if self.capped_rounds else {}

    def state_dict(self) -> dict[str, Any]:
        return {
            **super().state_dict(),
            "global_model": clone_all(self.global_model),
            "outer_optimizer": self.optimizer.state_dict() if self.optimizer is not None else None,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.global_model = clone_all(state["global_model"])
        self.optimizer = self._build_optimizer()
        if state.get("outer_optimizer") is not None:
            self.optimizer.load_state_dict(state["outer_optimizer"])

    def to(self, device: torch.device) -> None:
        """Move the global model and rebuild the outer optimizer over it; the optimizer's state
        follows its parameters' device (``Optimizer.load_state_dict`` casts it)."""
        if all(tensor.device == device for tensor in self.global_model):
            return
        saved = self.optimizer.state_dict() if self.optimizer is not None else None
        self.global_model = move_all(self.global_model, device)
        if saved is not None:
            self.optimizer = self._build_optimizer()
            self.optimizer.load_state_dict(saved)


def _norm(tensors: Iterable[Tensor]) -> float:
    """The 2-norm of tensors taken as one vector (accumulated in float64)."""
    return math.sqrt(
        sum(float(torch.linalg.vector_norm(tensor, dtype=torch.float64)) ** 2 for tensor in tensors)
    )


def diloco_outer_optimizer(
    lr: float = DILOCO_OUTER_LR, momentum: float = DILOCO_OUTER_MOMENTUM
) -> OuterOptimizerFactory:
    """DiLoCo's outer optimizer, SGD with Nesterov momentum: lr 0.7 and momentum 0.5 by default.

    If the workers' mean moves by ``d`` every round, Nesterov SGD on the pseudo-gradient moves
    the global model by ``lr·(1 + μ)·d`` in the first round and by ``lr/(1 − μ)·d`` once the
    momentum has built up. The paper's ``μ = 0.9`` (with lr 0.7) makes that 7 times the workers'
    progress; it was chosen for an inner AdamW, ``H`` = 500 inner steps and a model pretrained
    before DiLoCo starts (torchft's example uses the same values with ``H`` = 100). On top of an
    inner SGD with momentum at a learning rate tuned for DDP, the steady step is 7 times the one
    the inner optimizer was tuned for: on the bundled ``vgg_mini`` it averaged 0.45 validation
    accuracy after 3 epochs over 5 seeds (periodic averaging 0.59) and ended 6 epochs at 0.08 to
    0.26 on 3 of them (docs/averaging_defaults.md, "The presets' outer steps"). ``μ = 0.5``
    moves ``1.05·d`` in the first round and ``1.4·d`` at most; the strategies'
    ``outer_step_cap`` (default 1, see :class:`OuterOptimizerAverager`) shortens that to ``d``.
    Pass ``momentum=0.9`` for the paper's recipe (with AdamW inside and ``H`` in the hundreds).
    """
    return lambda params: torch.optim.SGD(params, lr=lr, momentum=momentum, nesterov=True)


def slowmo_outer_optimizer(
    slow_learning_rate: float = 1.0, slow_momentum: float = 0.5
) -> OuterOptimizerFactory:
    """SlowMo's outer optimizer: SGD with heavy-ball momentum ``β`` and slow learning rate ``α``."""
    return lambda params: torch.optim.SGD(params, lr=slow_learning_rate, momentum=slow_momentum)


def lookahead_outer_optimizer(alpha: float = 0.5) -> OuterOptimizerFactory:
    """Lookahead's outer step: ``x_g ← x_g + α·(x̄ − x_g)``, SGD with lr ``α`` and no momentum."""
    return lambda params: torch.optim.SGD(params, lr=alpha)
