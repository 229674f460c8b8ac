"""The non-finite guard: a step whose loss, gradients or update is not finite changes nothing, and is counted.

Checked on every optimizer step (see ``docs/checkpoints.md``, "Faults and what survives them"):

1. before the optimizer step: the step's loss and per-reward gradient buffers (flagged by the trainer while it
   computes them, :meth:`NonFiniteGuard.flag`) and every trainable gradient. A bad step is **skipped**: the gradients
   are dropped (``grad = None``, which torch optimizers skip), so parameters and optimizer state stay as they were;
   the old policy and the parameter EMA are not updated either, and non-finite per-reward gradients refresh no
   MARBLE coefficients;
2. after the optimizer step: the trainable adapter. If it is not finite (finite gradients, but an update that
   overflowed, e.g. a huge learning rate), parameters and optimizer state are restored from the copy taken before
   the step, and the step counts as skipped.

``max_nonfinite_skips`` consecutive skips stop the run with a :class:`FloatingPointError` that says what was not
finite; the parameters are then the last finite ones (the emergency checkpoint saves those). With
``max_nonfinite_skips=0`` the first non-finite step is that error. The skipped step still counts as an optimizer step
(``global_step`` advances and the learning-rate schedule moves on; transformers does not step the schedule after a
``GradScaler`` skip).

A finite loss that grows ``DIVERGENCE_FACTOR`` (1e4) times over the first step's is not skipped, but warned about once
(a far too large learning rate: the loss reached 1.5e14 at ``learning_rate=1e4``).

With fp16 (a ``GradScaler``) non-finite gradients are the scaler's business: it skips those steps and lowers its
scale, and the guard then only keeps the old policy and the EMA in place for them (they are not counted as skips).

Under DeepSpeed the optimizer step runs inside the engine's backward, so a step cannot be skipped from here: a
non-finite loss or gradient buffer is an immediate error.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from transformers import TrainerCallback

from ..distributed import non_finite_tensors

logger = logging.getLogger(__name__)

DIVERGENCE_FACTOR = 1e4  # a finite loss this many times the first step's is reported as divergence


class NonFiniteGuard(TrainerCallback):
    """Skips optimizer steps that would make the trainable adapter non-finite (see the module docstring)."""

    def __init__(self, trainer: Any, max_skips: int) -> None:
        self.trainer = trainer
        self.max_skips = max_skips
        self.reset()

    def reset(self) -> None:
        self.reasons: list[str] = []  # why the current step is bad (empty: fine so far)
        self.skipped = False  # the step just taken was skipped (read by the trainer's after-step update)
        self.stepped = False  # the optimizer moved the weights and the step has not ended yet (global_step behind)
        self.consecutive = 0
        self.total = 0
        self._snapshot: tuple[dict, dict] | None = None
        self._first_loss: float | None = None
        self._warned_divergence = False

    def observe_loss(self, loss: float) -> None:
        """A finite micro-batch loss: warn once when it has grown ``DIVERGENCE_FACTOR``-fold over the run's first one
        (finite, so not skipped, but almost certainly a diverging run: far too large a learning rate)."""
        if self._first_loss is None:
            self._first_loss = abs(loss)
            return
        if not self._warned_divergence and abs(loss) > DIVERGENCE_FACTOR * max(self._first_loss, 1e-6):
            self._warned_divergence = True
            logger.warning(
                "Step %d: the NFT loss is %.3g, %.0e times the first step's (%.3g): training is diverging. Lower the "
                "learning rate (or check the rewards' scale).",
                self.trainer.state.global_step,
                loss,
                DIVERGENCE_FACTOR,
                self._first_loss,
            )

    def flag(self, reason: str) -> None:
        """Mark the current step as non-finite (called while the step's gradients are formed)."""
        if not self.trainer.backend.can_skip_step:
            raise FloatingPointError(
                f"Step {self.trainer.state.global_step}: {reason}. Under DeepSpeed the engine steps inside the "
                "backward, so the step cannot be skipped; lower the learning rate or check the rewards and inputs."
            )
        self.reasons.append(reason)

    def _params(self) -> dict[str, torch.nn.Parameter]:
        return self.trainer.trainable_parameters()

    def on_step_begin(self, args, state, control, **kwargs):
        self.reasons = []
        self.skipped = False
        self.stepped = False

    def on_step_end(self, args, state, control, **kwargs):
        self.stepped = False  # global_step counts the step now: the weights are its

    def _scaler(self):
        return getattr(self.trainer.accelerator, "scaler", None)

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        if not self.trainer.backend.can_skip_step:
            return
        if self._scaler() is not None:
            return  # fp16: the GradScaler skips steps with inf/NaN gradients itself (and needs them to see it)
        params = self._params()
        bad = non_finite_tensors({n: p.grad for n, p in params.items() if p.grad is not None})
        if bad:
            self.reasons.append(f"the gradients of {len(bad)} trained weights are not finite (e.g. {bad[0]})")
        if self.reasons:
            for p in params.values():
                p.grad = None  # torch optimizers leave parameters without a gradient (and their state) untouched
            self._skip(state)
            return
        if self.max_skips > 0:
            optimizer = self.trainer.optimizer
            inner = getattr(optimizer, "optimizer", optimizer)  # accelerate's AcceleratedOptimizer wraps it
            # full fine-tuning keeps it in host memory: a copy of the transformer and its optimizer state on the
            # accelerator would cost 12 B per weight (25 GiB for SD3.5 Medium); a LoRA's stays where it is
            # (FSDP2's shards stay: 12 B per weight / processes)
            full = getattr(self.trainer, "full_policy", None) is not None
            where = "cpu" if full and not self.trainer.backend.shards_transformer else None

            def keep(v: torch.Tensor) -> torch.Tensor:
                return v.detach().to(where, copy=True) if where else v.detach().clone()

            self._snapshot = (
                {n: keep(p) for n, p in params.items()},
                {p: {k: (keep(v), v.device) if torch.is_tensor(v) else v for k, v in s.items()}
                 for p, s in inner.state.items()},
            )  # fmt: skip

    def after_optimizer_step(self, state) -> None:
        """The verdict on the weights the optimizer just wrote (called by the trainer's step-end hook, before the
        step's own end: the old policy and the EMA read :attr:`skipped`)."""
        self.stepped = not self.skipped
        if not self.trainer.backend.can_skip_step or self.skipped:
            return
        if self._scaler() is not None:
            # the GradScaler's skip is the guard's: nothing moved, so neither may the old policy nor the EMA
            self.skipped = bool(self.trainer.accelerator.optimizer_step_was_skipped)
            return
        params = self._params()
        bad = non_finite_tensors({n: p.detach() for n, p in params.items()})
        if not bad:
            self.consecutive = 0
            return
        self.reasons.append(f"the optimizer step made {len(bad)} trained weights non-finite (e.g. {bad[0]})")
        if self._snapshot is None:
            raise FloatingPointError(
                f"Step {state.global_step}: {self.reasons[-1]}, and max_nonfinite_skips=0 keeps no copy to restore. "
                "Lower the learning rate."
            )
        values, optimizer_state = self._snapshot
        inner = getattr(self.trainer.optimizer, "optimizer", self.trainer.optimizer)
        with torch.no_grad():
            for n, p in params.items():
                p.copy_(values[n])
        inner.state.clear()
        inner.state.update(
            {p: {k: v[0].to(v[1]) if isinstance(v, tuple) else v for k, v in s.items()}
             for p, s in optimizer_state.items()}
        )  # fmt: skip
        self._skip(state)

    def _skip(self, state) -> None:
        self.skipped = True
        self.consecutive += 1
        self.total += 1
        reason = "; ".join(self.reasons)
        if self.consecutive > self.max_skips:
            raise FloatingPointError(
                f"Step {state.global_step}: {reason}. {self.consecutive} consecutive non-finite step(s) "
                f"(max_nonfinite_skips={self.max_skips}); the LoRA is left at its last finite value. Lower the "
                "learning rate, check the rewards and the inputs, or resume from an earlier checkpoint."
            )
        logger.warning(
            "Step %d skipped (%s): parameters, optimizer state, old policy and EMA left unchanged (%d consecutive, "
            "%d in all; the run stops after %d consecutive).",
            state.global_step,
            reason,
            self.consecutive,
            self.total,
            self.max_skips,
        )
