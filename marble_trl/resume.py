"""Safe resume: which checkpoint to resume from, and what the new run may change about the old one.

- **Which checkpoint.** :func:`validate_checkpoint` opens every file a resume reads (the manifest, the three LoRA
  files, the balancer state, ``trainer_state.json``, the optimizer, scheduler and RNG states) and checks the LoRA
  tensors are finite; an error names the file. ``resume_from_checkpoint=True`` resumes from the newest checkpoint that
  passes (:func:`resolve_resume`), saying which newer ones it skipped and why.
- **What may change.** The checkpoint's manifest records the training arguments. A field that changes what the
  resumed steps compute (:data:`EXACT_FIELDS`: the seed, the groups, the sampler, the loss, the LoRA, ...) or the
  prompts (a fingerprint of the dataset) must be the same, unless ``resume_allow_changes`` names it: the run then
  continues with the new value (no longer identical to an uninterrupted run) and says so. ``learning_rate`` and
  ``weight_decay`` live in the restored optimizer state: when allowed, they are applied to it
  (:func:`apply_changed_hyperparameters`), never recorded but ignored. Optimizer and schedule *types*
  (:data:`FROZEN_FIELDS`) cannot change on resume. Every other field (``max_steps``, logging, saving, evaluation,
  output) is free.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

if TYPE_CHECKING:
    from .trainer import MarbleDiffusionNFTTrainer

logger = logging.getLogger(__name__)

EXACT_FIELDS = (
    "seed",
    "num_generations",
    "prompts_per_step",
    "per_device_train_batch_size",
    "source_ratios",
    "resolution",
    "num_sample_steps",
    "sample_scheduler",
    "guidance_scale",
    "negative_prompt",
    "max_sequence_length",
    "reward_weights",
    "scale_rewards",
    "nft_beta",
    "beta",
    "adv_clip_max",
    "timestep_fraction",
    "old_policy_decay",
    "old_policy_update_interval",
    "marble_rho",
    "marble_refresh_interval",
    "marble_uniform_final_steps",
    "marble_refresh_update",
    "max_grad_norm",
    "lora_r",
    "lora_alpha",
    "lora_dropout",
    "lora_init",
    "lora_target_modules",
    "param_ema",
    "param_ema_max_decay",
)
APPLIED_FIELDS = ("learning_rate", "weight_decay")  # held by the optimizer state: applied to it when allowed
FROZEN_FIELDS = (
    "optim",
    "lr_scheduler_type",
    "warmup_steps",
    "warmup_ratio",
    "adam_beta1",
    "adam_beta2",
    "adam_epsilon",
)
DATASET_KEY = "dataset_fingerprint"


class CorruptCheckpointError(ValueError):
    """A checkpoint file cannot be read, or holds non-finite weights."""


def dataset_fingerprint(dataset: Any) -> str | None:
    """A hash of the training prompts (and their sources), in order; None for datasets without a prompt column."""
    if dataset is None or "prompt" not in getattr(dataset, "column_names", ()):
        return None
    digest = hashlib.sha256()
    digest.update(json.dumps(list(dataset["prompt"]), default=str).encode())
    if "source" in dataset.column_names:
        digest.update(json.dumps(list(dataset["source"]), default=str).encode())
    return digest.hexdigest()[:16]


# ------------------------------------------------------------------------------------------- checkpoint validation
def validate_checkpoint(folder: str | os.PathLike) -> None:
    """Raise :class:`CorruptCheckpointError` naming the first file of ``folder`` that a resume could not use."""
    from safetensors.torch import load_file

    from .checkpoint import read_manifest
    from .guards import non_finite_tensors

    folder = Path(folder)
    try:
        manifest = read_manifest(folder)
    except (ValueError, KeyError) as e:  # JSONDecodeError is a ValueError
        raise CorruptCheckpointError(f"{folder / 'marble_checkpoint.json'} cannot be read: {e}") from e
    files = manifest.get("files", {})
    for key in ("lora", "old_policy", "param_ema"):
        if not files.get(key):
            continue
        path = folder / files[key]
        try:
            tensors = load_file(str(path))
        except Exception as e:  # safetensors raises its own error types for truncated files
            raise CorruptCheckpointError(f"{path} cannot be read ({type(e).__name__}: {e}).") from e
        bad = non_finite_tensors(tensors)
        if bad:
            raise CorruptCheckpointError(
                f"{path} holds non-finite weights ({len(bad)} tensors, e.g. {bad[0]}): resuming would train NaN."
            )
    for name in [files.get("balancer"), "trainer_state.json"]:
        if name:
            _read_json(folder / name)
    from transformers.trainer_pt_utils import safe_globals  # what the Trainer itself loads them with

    for path in sorted(folder.glob("*.pt")) + sorted(folder.glob("*.pth")):
        try:
            with safe_globals():
                torch.load(path, map_location="cpu", weights_only=True)
        except Exception as e:
            raise CorruptCheckpointError(f"{path} cannot be read ({type(e).__name__}: {e}).") from e


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise CorruptCheckpointError(f"{path} cannot be read ({type(e).__name__}: {e}).") from e


def _step(folder: Path) -> int:
    try:
        return int(folder.name.rsplit("-", 1)[1])
    except (IndexError, ValueError):
        return -1


def resolve_resume(output_dir: str | os.PathLike, resume: str | bool | None) -> str | None:
    """The checkpoint folder to resume from: the newest valid one of ``output_dir`` for ``True``, the given folder
    (validated) for a path, ``None`` for no resume."""
    if resume is None or resume is False:
        return None
    if resume is not True:
        validate_checkpoint(resume)
        return str(resume)
    folder = Path(output_dir)
    candidates = sorted(
        (p for p in folder.glob(f"{PREFIX_CHECKPOINT_DIR}-*") if p.is_dir() and _step(p) >= 0), key=_step, reverse=True
    )
    problems = []
    for candidate in candidates:
        try:
            validate_checkpoint(candidate)
        except CorruptCheckpointError as e:
            problems.append(str(e))
            logger.warning("Skipping %s for the resume: %s", candidate, e)
            continue
        if problems:
            logger.warning("Resuming from %s, the newest valid checkpoint.", candidate)
        return str(candidate)
    if problems:
        raise CorruptCheckpointError(
            f"resume_from_checkpoint=True but no checkpoint of {folder} is valid:\n  " + "\n  ".join(problems)
        )
    raise FileNotFoundError(
        f"resume_from_checkpoint=True but {folder} holds no checkpoint-N folder; start without it, or give a path."
    )


# ------------------------------------------------------------------------------------------ configuration changes
def _jsonable_args(args: Any) -> dict[str, Any]:
    return json.loads(args.to_json_string())


def check_resume_config(trainer: MarbleDiffusionNFTTrainer, manifest: dict[str, Any], folder: Path) -> None:
    """Refuse a resume whose new configuration changes what the resumed steps compute (see the module docstring)."""
    old, new = manifest.get("training_args", {}), _jsonable_args(trainer.args)
    allowed = set(trainer.args.resume_allow_changes or [])
    changed = {f: (old[f], new.get(f)) for f in (*EXACT_FIELDS, *APPLIED_FIELDS, *FROZEN_FIELDS) if f in old}
    changed = {f: v for f, v in changed.items() if v[0] != v[1]}
    old_data, new_data = manifest.get(DATASET_KEY), dataset_fingerprint(trainer.train_dataset)
    if old_data is not None and new_data is not None and old_data != new_data:
        changed["train_dataset"] = (f"fingerprint {old_data}", f"fingerprint {new_data}")
    frozen = {f: v for f, v in changed.items() if f in FROZEN_FIELDS}
    if frozen:
        raise ValueError(
            f"Resuming {folder}: {_describe(frozen)} cannot change on resume (the restored optimizer and scheduler "
            "states are of the old kind). Keep the old values, or start a new run from the exported LoRA."
        )
    refused = {f: v for f, v in changed.items() if f not in allowed}
    if refused:
        raise ValueError(
            f"Resuming {folder} with a changed configuration: {_describe(refused)}. The resumed run would not be "
            "the one the checkpoint belongs to. Restore the old values, or allow the change with "
            f"resume_allow_changes={sorted(refused)} (--resume_allow_changes {' '.join(sorted(refused))})."
        )
    for field, (before, after) in changed.items():
        logger.warning(
            "Resuming %s with %s changed from %r to %r (resume_allow_changes).", folder, field, before, after
        )


def _describe(changes: dict[str, tuple[Any, Any]]) -> str:
    return ", ".join(f"{f} {a!r} -> {b!r}" for f, (a, b) in changes.items())


def apply_changed_hyperparameters(trainer: MarbleDiffusionNFTTrainer, folder: str | os.PathLike) -> None:
    """After the Trainer restored the optimizer and scheduler: apply an allowed new learning rate / weight decay."""
    from .checkpoint import read_manifest

    old = read_manifest(folder).get("training_args", {})
    args = trainer.args
    optimizer = getattr(trainer.optimizer, "optimizer", trainer.optimizer)
    if "learning_rate" in old and old["learning_rate"] != args.learning_rate and old["learning_rate"] > 0:
        ratio = args.learning_rate / old["learning_rate"]
        for group in optimizer.param_groups:
            group["lr"] *= ratio
            if "initial_lr" in group:
                group["initial_lr"] *= ratio
        scheduler = trainer.lr_scheduler
        if scheduler is not None and hasattr(scheduler, "base_lrs"):
            scheduler.base_lrs = [base * ratio for base in scheduler.base_lrs]
            scheduler._last_lr = [group["lr"] for group in optimizer.param_groups]  # what get_last_lr() reports
        logger.warning("Resumed optimizer: learning_rate %r -> %r applied.", old["learning_rate"], args.learning_rate)
    if "weight_decay" in old and old["weight_decay"] != args.weight_decay:
        for group in optimizer.param_groups:
            if group.get("weight_decay") == old["weight_decay"]:  # the no-decay group (if any) keeps its 0
                group["weight_decay"] = args.weight_decay
        logger.warning("Resumed optimizer: weight_decay %r -> %r applied.", old["weight_decay"], args.weight_decay)
