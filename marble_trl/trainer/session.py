"""One optimizer step as an object: :class:`StepSession`.

The trainer opens a session from the step's rollouts (:meth:`~marble_trl.trainer.rollouts.RolloutHooks.start_step`) and
closes it after the optimizer step. Everything the step decides lives here:

- its micro-batches, a tuple that is never edited: ``training_step`` asks the session for micro-batch ``i`` (the
  Trainer hands over the objects it was given, which serve as keys). A solved-first refresh, run at the step's first
  micro-batch, does not rewrite them: it returns re-planned ones and the session swaps them in (:meth:`replan`);
- the balancer's transaction: a refresh opens it (:meth:`begin_refresh`: solved first, a released pair, or the exact
  one at the step's end, after which the non-finite guard can still skip the step); the optimizer's verdict commits
  it, or rolls it back when the step is skipped (:meth:`end`). An emergency checkpoint rolls back an open one.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from transformers import TrainerCallback

from ..balance import MarbleBalancer
from .step import MicroBatch, StepPlan


class StepSession:
    """The state of one optimizer step (see the module docstring)."""

    def __init__(self, batches: Sequence[MicroBatch], balancer: Any | None) -> None:
        if [b.index for b in batches] != list(range(len(batches))):
            raise ValueError(f"A step's micro-batches are numbered 0..n-1, got {[b.index for b in batches]}.")
        self._batches = tuple(batches)
        self._planned = self._batches  # as the Trainer got them (it hands these back)
        self._balancer = balancer
        self._before: dict | None = None  # the balancer's state when the transaction opened
        self.closed = False

    @property
    def batches(self) -> tuple[MicroBatch, ...]:
        return self._batches

    @property
    def plan(self) -> StepPlan:
        """The plan the micro-batches are trained on now (a solved-first refresh replaces the planned one)."""
        return self._batches[0].plan

    def batch(self, index: int) -> MicroBatch:
        """Micro-batch ``index`` as it is to be trained."""
        self._check_open()
        return self._batches[index]

    def batch_for(self, inputs: MicroBatch) -> MicroBatch:
        """The micro-batch to train for what the Trainer handed over: one of this step's (as planned or re-planned);
        anything else (another step's, or an edited copy) is refused."""
        self._check_open()
        index = inputs.index
        known = 0 <= index < len(self._batches) and (inputs is self._planned[index] or inputs is self._batches[index])
        if not known:
            raise ValueError(
                f"training_step got micro-batch {index}, which is not this step's: open a step on the micro-batches to "
                "train with start_step(batches)."
            )
        return self._batches[index]

    def replan(self, batches: Sequence[MicroBatch]) -> None:
        """Swap in re-planned micro-batches (same count and order), e.g. a solved-first refresh's phase 2."""
        self._check_open()
        if [b.index for b in batches] != [b.index for b in self._batches]:
            raise ValueError("A re-planned step must keep its micro-batches and their order.")
        self._batches = tuple(batches)

    def begin_refresh(self) -> None:
        """Open the balancer's transaction (once per step): its state now is what a skipped step returns to."""
        self._check_open()
        if self._before is None and self._balancer is not None:
            self._before = self._balancer.state_dict()

    def end(self, skipped: bool) -> None:
        """The optimizer's verdict: a skipped step rolls the balancer back to where the transaction opened (nothing
        moved: neither may alpha_bar), a taken one commits it. The session is then closed."""
        self._check_open()
        if skipped and self._before is not None:
            self._balancer.load_state_dict(self._before)
        self._before = None
        self.closed = True

    def _check_open(self) -> None:
        if self.closed:
            raise RuntimeError("This optimizer step has ended: its session is closed.")


class StepHooks(TrainerCallback):
    """The trainer's hooks into transformers' loop: at the start, the balancer learns the run's length; right after
    each optimizer step, in this order, the non-finite guard's verdict on the new weights and the step's end (the
    session's commit or rollback, the old-policy soft update, the parameter EMA)."""

    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer

    def on_train_begin(self, args, state, control, **kwargs):
        balancer = self.trainer.balancer
        if isinstance(balancer, MarbleBalancer) and balancer.uniform_final_steps:
            balancer.max_steps = state.max_steps  # the final uniform stage counts back from the end

    def on_optimizer_step(self, args, state, control, **kwargs):
        self.trainer.nonfinite_guard.after_optimizer_step(state)
        self.trainer._after_optimizer_step()
