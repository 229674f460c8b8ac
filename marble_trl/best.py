"""Best-checkpoint selection and the reward-hacking guard (``docs/evaluation.md``).

- :func:`selection_metrics`: the metrics :meth:`MarbleDiffusionNFTTrainer.evaluate` adds to the eval rewards:
  ``{prefix}_composite`` (a scale-free summary of all evaluation rewards, usable as ``metric_for_best_model``) and, from
  the second evaluation on, the hacking signal ``{prefix}_hacking/<name>`` (training reward up, held-out score down);
- :func:`record_best_checkpoint`: points ``state.best_model_checkpoint`` at the real ``checkpoint-N`` folder (the
  Trainer computes it from the staging folder of an atomic save, see :mod:`marble_trl.checkpoint`);
- :func:`load_best_checkpoint`: ``load_best_model_at_end`` for a LoRA trainer: restores the adapters of the best
  checkpoint (the Trainer's own ``_load_best_model`` looks for a full ``model.safetensors``);
- :class:`RewardHackingCallback`: stops training after ``patience`` consecutive evaluations flag hacking.

Everything is computed from ``state.log_history`` (restored on resume), so it needs no state of its own.
"""

from __future__ import annotations

import logging
import math
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from transformers import TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, SaveStrategy

if TYPE_CHECKING:
    from .trainer import MarbleDiffusionNFTTrainer

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


def selection_metrics(trainer: MarbleDiffusionNFTTrainer, metrics: dict[str, float], prefix: str) -> dict[str, float]:
    """``{prefix}_composite`` and the hacking signal of this evaluation (see the module docstring and
    ``docs/evaluation.md``). Call before the evaluation is logged."""
    history = trainer.state.log_history
    evals = _evaluations(history, prefix)
    out: dict[str, float] = {}
    value = composite(trainer.eval_reward_names, metrics, evals[0] if evals else None, prefix)
    if value is None:
        return out
    out[f"{prefix}_composite"] = value
    if not evals:
        return out  # the first evaluation: nothing to compare with
    step = trainer.state.global_step
    prev = evals[-1]
    prev_step = int(prev.get("step", 0))
    before_prev = int(evals[-2].get("step", 0)) if len(evals) > 1 else -1
    flags = []
    for name in trainer.reward_names:
        train_now = _train_mean(history, name, prev_step, step)
        train_prev = _train_mean(history, name, before_prev, prev_step)
        if train_now is None or train_prev is None:
            continue  # no training log in a window (eval_steps shorter than logging_steps)
        key = f"{prefix}_rewards/{name}/mean"
        if name in trainer.eval_reward_names and _finite(metrics.get(key)) and _finite(prev.get(key)):
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


def record_best_checkpoint(trainer: MarbleDiffusionNFTTrainer, run_dir: str) -> None:
    """After the Trainer's ``_save_checkpoint`` ran into the staging folder: set ``state.best_model_checkpoint`` to
    ``run_dir/checkpoint-{best_global_step}`` (the folder this save is renamed to, or an earlier one) and rewrite the
    staged ``trainer_state.json`` with it, so rotation keeps the best checkpoint and a resume finds it."""
    state, args = trainer.state, trainer.args
    step = state.best_global_step
    if not step or args.save_strategy not in (SaveStrategy.STEPS, SaveStrategy.EPOCH, SaveStrategy.BEST):
        return
    path = os.path.join(run_dir, f"{PREFIX_CHECKPOINT_DIR}-{step}")
    if step != state.global_step and not os.path.isdir(path):
        return
    state.best_model_checkpoint = path
    staging = getattr(trainer, "_checkpoint_staging_root", None)
    if args.should_save and staging:
        state.save_to_json(os.path.join(staging, f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}", TRAINER_STATE_NAME))


def load_best_checkpoint(trainer: MarbleDiffusionNFTTrainer) -> None:
    """``load_best_model_at_end``: copy the trained LoRA, the old-policy adapter and the parameter EMA (which the
    evaluation scored when ``eval_use_param_ema``) of ``state.best_model_checkpoint`` into the trainer."""
    from .checkpoint import _check_keys, load_adapter_state, lora_key, read_manifest
    from .lora import OLD_ADAPTER, TRAIN_ADAPTER

    folder = Path(trainer.state.best_model_checkpoint)
    if trainer.is_deepspeed_enabled:
        logger.warning(
            "load_best_model_at_end is not supported with DeepSpeed here: the final weights are kept. The best "
            "checkpoint (%s, %s = %s) exports with `marble-trl export --checkpoint %s`.",
            folder,
            trainer.args.metric_for_best_model,
            trainer.state.best_metric,
            folder,
        )
        return
    files = read_manifest(folder)["files"]
    transformer = trainer.transformer
    load_adapter_state(transformer, TRAIN_ADAPTER, folder / files["lora"])
    load_adapter_state(transformer, OLD_ADAPTER, folder / files["old_policy"])
    trainer.old_policy.reset()
    if trainer.param_ema is not None and files.get("param_ema"):
        from safetensors.torch import load_file

        state = load_file(str(folder / files["param_ema"]))
        names = list(trainer.param_ema.state_dict())
        _check_keys(set(state), {lora_key(n, TRAIN_ADAPTER) for n in names}, "parameter EMA", folder)
        trainer.param_ema.load_state_dict({n: state[lora_key(n, TRAIN_ADAPTER)] for n in names})
    logger.info(
        "Loaded the best checkpoint %s (%s = %s).",
        folder,
        trainer.args.metric_for_best_model,
        trainer.state.best_metric,
    )
