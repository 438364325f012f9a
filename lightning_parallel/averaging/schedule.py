"""When rounds happen: after a synchronous warm-up of ``W`` optimizer steps, every ``H`` steps."""

from __future__ import annotations

from typing import Any

__all__: list[str] = []


class AveragingSchedule:
    """Count optimizer steps and say which ones end a round of averaging.

    Step ``s`` (1-based count of optimizer steps) ends a round when ``s > W`` and ``H`` steps
    have passed since the last round (or since the warm-up ended): rounds fall on
    ``W + H, W + 2H, …`` unless an extra round (before a validation) moved the phase. Steps
    ``1 … W`` are the post-local warm-up, run as synchronous data parallelism (gradients
    averaged every step); :meth:`open_synchronous_window` moves ``W`` later, for a window of
    synchronous steps in the middle of training. ``period=None`` never averages during
    training (one-shot averaging).

    The caller counts one step per training batch that stepped, however many optimizers
    stepped in it and however many batches were accumulated into it; the counter and the number
    of rounds go in the checkpoint, which is what makes a resumed run average at the same steps.

    Args:
        period: local steps per round ``H`` (positive), or ``None`` for never.
        warmup_steps: synchronous steps ``W`` before local training starts.
    """

    def __init__(self, period: int | None, warmup_steps: int = 0) -> None:
        if period is not None and (isinstance(period, bool) or int(period) != period or period < 1):
            raise ValueError(f"period must be a positive integer (optimizer steps), got {period!r}")
        if isinstance(warmup_steps, bool) or int(warmup_steps) != warmup_steps or warmup_steps < 0:
            raise ValueError(f"warmup_steps must be a non-negative integer, got {warmup_steps!r}")
        self.period = None if period is None else int(period)
        self.warmup_steps = int(warmup_steps)
        self.optimizer_steps = 0
        self.synchronous_steps = 0  # warm-up and synchronous-window steps taken
        self.rounds = 0
        self.last_round_step = 0
        # streaming rounds count their fragments' phases from here: the end of the warm-up,
        # or the last round of every fragment at once (before a validation)
        self.phase_origin = 0

    @property
    def in_warmup(self) -> bool:
        """Whether the next optimizer step is a synchronous warm-up step."""
        return self.optimizer_steps < self.warmup_steps

    @property
    def local_steps(self) -> int:
        """Local (non-warm-up) steps taken since the last round."""
        return self.optimizer_steps - max(self.warmup_steps, self.last_round_step)

    def ends_round(self, step: int) -> bool:
        """Whether optimizer step number ``step`` (1-based, the latest counted) ends a round."""
        if self.period is None or step <= self.warmup_steps:
            return False
        return step - max(self.warmup_steps, self.last_round_step) >= self.period

    @property
    def phase_step(self) -> int:
        """Steps since the fragments' phases started (the warm-up's end or a full round)."""
        return self.optimizer_steps - max(self.warmup_steps, self.phase_origin)

    def mark_round(self) -> None:
        """Record that a round starts now: the next one is due ``H`` steps later."""
        self.rounds += 1
        self.last_round_step = self.optimizer_steps

    def open_synchronous_window(self, steps: int) -> None:
        """Make the next ``steps`` optimizer steps synchronous, as the warm-up's; local training
        (and the rounds' phase) starts again after them."""
        if isinstance(steps, bool) or int(steps) != steps or steps < 1:
            raise ValueError(f"a synchronous window needs a positive step count, got {steps!r}")
        self.warmup_steps = self.optimizer_steps + int(steps)

    def count_step(self) -> bool:
        """Count one optimizer step; return whether it ends a round."""
        if self.in_warmup:
            self.synchronous_steps += 1
        self.optimizer_steps += 1
        return self.ends_round(self.optimizer_steps)

    def state_dict(self) -> dict[str, Any]:
        """Counters to save in the checkpoint."""
        return {
            "optimizer_steps": self.optimizer_steps,
            "warmup_steps": self.warmup_steps,
            "synchronous_steps": self.synchronous_steps,
            "rounds": self.rounds,
            "last_round_step": self.last_round_step,
            "phase_origin": self.phase_origin,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the counters of :meth:`state_dict`."""
        self.optimizer_steps = int(state["optimizer_steps"])
        # a synchronous window moves the warm-up's end; older checkpoints keep the argument's
        self.warmup_steps = int(state.get("warmup_steps", self.warmup_steps))
        self.synchronous_steps = int(
            state.get("synchronous_steps", min(self.optimizer_steps, self.warmup_steps))
        )
        self.rounds = int(state["rounds"])
        self.last_round_step = int(state.get("last_round_step", 0))
        self.phase_origin = int(state.get("phase_origin", 0))
