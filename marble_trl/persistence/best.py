"""Best-checkpoint selection and the reward-hacking guard (``docs/evaluation.md``).

- :func:`selection_metrics`: the metrics :meth:`MarbleDiffusionNFTTrainer.evaluate` adds to the eval rewards:
  ``{prefix}_composite`` (a scale-free summary of all evaluation rewards, usable as ``metric_for_best_model``),
  ``{prefix}_mean_reward`` (the plain mean of the rewards' means: MARBLE's release selects by it) and, from
  the second evaluation on, the hacking signal ``{prefix}_hacking/<name>`` (training reward up, held-out score down);
- :func:`~marble_trl.trainer.checkpointing.record_best_checkpoint`: points ``state.best_model_checkpoint`` at the real ``checkpoint-N`` folder (the
  Trainer computes it from the staging folder of an atomic save, see :mod:`marble_trl.persistence.checkpoint`);
- :func:`~marble_trl.trainer.checkpointing.load_best_checkpoint`: ``load_best_model_at_end`` for a LoRA trainer: restores the adapters of the best
  checkpoint (the Trainer's own ``_load_best_model`` looks for a full ``model.safetensors``);
- :class:`RewardHackingCallback`: stops training after ``patience`` consecutive evaluations flag hacking.

Everything is computed from ``state.log_history`` (restored on resume), so it needs no state of its own.
"""

from __future__ import annotations

import logging
import math
from typing import Any

from transformers import TrainerCallback

logger = logging.getLogger(__name__)
TRAINER_STATE_NAME = "trainer_state.json"


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value)


def composite(
    names: list[str], metrics: dict[str, float], reference: dict[str, float] | None, prefix: str
) -> float | None:
    """Mean over the evaluation rewards of their change since the reference (first) evaluation, each divided by the
    reference's std over the evaluation images (1 where that std is 0 or missing): a mean effect size, 0 at the first
    evaluation, rounded to 4 decimals. ``None`` when no reward has a mean in both."""
    reference = metrics if reference is None else reference
    terms = []
    for name in names:
        key = f"{prefix}_rewards/{name}"
        now, ref = metrics.get(f"{key}/mean"), reference.get(f"{key}/mean")
        if not (_finite(now) and _finite(ref)):
            continue
        std = reference.get(f"{key}/std")
        scale = std if _finite(std) and std > 0 else 1.0
        terms.append((now - ref) / scale)
    # Rounded to 1e-4 standard deviations: finer differences are float noise (say, of another eval batch size).
    return round(sum(terms) / len(terms), 4) if terms else None


def _evaluations(history: list[dict[str, Any]], prefix: str) -> list[dict[str, Any]]:
    return [entry for entry in history if f"{prefix}_composite" in entry]


def _train_mean(history: list[dict[str, Any]], name: str, after: int, upto: int) -> float | None:
    values = [
        e[f"rewards/{name}/mean"]
        for e in history
        if after < e.get("step", 0) <= upto and _finite(e.get(f"rewards/{name}/mean"))
    ]
    return sum(values) / len(values) if values else None


def selection_metrics(
    metrics: dict[str, float],
    prefix: str,
    history: list[dict[str, Any]],
    step: int,
    reward_names: list[str],
    eval_reward_names: list[str],
) -> dict[str, float]:
    """``{prefix}_composite`` and the hacking signal of this evaluation (see the module docstring and
    ``docs/evaluation.md``) at optimizer step ``step``, from the run's ``history`` (``state.log_history``). Call before
    the evaluation is logged."""
    evals = _evaluations(history, prefix)
    out: dict[str, float] = {}
    means = [metrics.get(f"{prefix}_rewards/{name}/mean") for name in eval_reward_names]
    means = [m for m in means if _finite(m)]
    if means:  # MARBLE's release selects its best checkpoint by this plain mean of the raw means (its "composite")
        out[f"{prefix}_mean_reward"] = sum(means) / len(means)
    value = composite(eval_reward_names, metrics, evals[0] if evals else None, prefix)
    if value is None:
        return out
    out[f"{prefix}_composite"] = value
    if not evals:
        return out  # the first evaluation: nothing to compare with
    prev = evals[-1]
    prev_step = int(prev.get("step", 0))
    before_prev = int(evals[-2].get("step", 0)) if len(evals) > 1 else -1
    flags = []
    for name in reward_names:
        train_now = _train_mean(history, name, prev_step, step)
        train_prev = _train_mean(history, name, before_prev, prev_step)
        if train_now is None or train_prev is None:
            continue  # no training log in a window (eval_steps shorter than logging_steps)
        key = f"{prefix}_rewards/{name}/mean"
        if name in eval_reward_names and _finite(metrics.get(key)) and _finite(prev.get(key)):
            held_delta = metrics[key] - prev[key]
        else:
            held_delta = value - prev[f"{prefix}_composite"]
        flag = float(train_now > train_prev and held_delta < 0)
        out[f"{prefix}_hacking/{name}"] = flag
        out[f"{prefix}_hacking/{name}/train_delta"] = train_now - train_prev
        out[f"{prefix}_hacking/{name}/eval_delta"] = held_delta
        flags.append(flag)
    if flags:
        out[f"{prefix}_hacking"] = max(flags)
    return out


class RewardHackingCallback(TrainerCallback):
    """Stop training after ``patience`` consecutive evaluations whose ``eval*_hacking`` flag is 1 (``hacking_patience``
    adds it). Evaluations without the flag (the first one) leave the count unchanged."""

    def __init__(self, patience: int = 1) -> None:
        if patience < 1:
            raise ValueError(f"patience must be >= 1, got {patience}.")
        self.patience = patience
        self.count = 0

    def on_evaluate(self, args, state, control, metrics=None, **kwargs):
        flags = [v for k, v in (metrics or {}).items() if k.endswith("_hacking")]
        if not flags:
            return
        self.count = self.count + 1 if max(flags) >= 1 else 0
        if self.count >= self.patience:
            hacked = sorted(k for k, v in metrics.items() if "_hacking/" in k and k.count("/") == 1 and v >= 1)
            logger.warning(
                "Reward hacking at step %d for %d evaluation(s) in a row (%s: the training reward rose while the "
                "held-out score fell); stopping (hacking_patience=%d).",
                state.global_step,
                self.count,
                ", ".join(hacked),
                self.patience,
            )
            control.should_training_stop = True
