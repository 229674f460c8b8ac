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
  (:func:`~marble_trl.trainer.checkpointing.apply_changed_hyperparameters`), never recorded but ignored. Optimizer and schedule *types*
  (:data:`FROZEN_FIELDS`) cannot change on resume. Every other field (``max_steps``, logging, saving, evaluation,
  output) is free.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from ..data.source_images import SOURCE_IMAGES_COLUMN, source_image_keys
from ..distributed import non_finite_tensors
from .checkpoint import checksum_mismatches, read_manifest

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
    "marble_amortised_update",
    "marble_silent_rewards",
    "marble_procedure",
    "marble_masked_solve",
    "marble_warmup_steps",
    "marble_alpha_floor",
    "marble_reward_groups",
    "marble_mgda_weights",
    "marble_normalize_gradients",
    "marble_reward_dropout_targets",
    "marble_reward_dropout_prob",
    "marble_reward_dropout_warmup_steps",
    "max_grad_norm",
    "lora_r",
    "lora_alpha",
    "lora_dropout",
    "lora_init",
    "lora_target_modules",
    "param_ema",
    "param_ema_max_decay",
    "param_ema_first_step",
)
APPLIED_FIELDS = ("learning_rate", "weight_decay")  # held by the optimizer state: applied to it when allowed
FROZEN_FIELDS = (
    "use_peft",  # LoRA vs full fine-tuning: the optimizer state is over other parameters
    "full_finetune_modules",
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
    """A hash of the training prompts (their sources, and an editing dataset's source images: each row's path or a
    digest of its bytes), in order; None for datasets without a prompt column."""
    if dataset is None or "prompt" not in getattr(dataset, "column_names", ()):
        return None
    digest = hashlib.sha256()
    digest.update(json.dumps(list(dataset["prompt"]), default=str).encode())
    if "source" in dataset.column_names:
        digest.update(json.dumps(list(dataset["source"]), default=str).encode())
    if SOURCE_IMAGES_COLUMN in dataset.column_names:
        digest.update(json.dumps(source_image_keys(dataset)).encode())
    return digest.hexdigest()[:16]


# ------------------------------------------------------------------------------------------- checkpoint validation
def validate_checkpoint(folder: str | os.PathLike) -> None:
    """Raise :class:`CorruptCheckpointError` naming the first file of ``folder`` that a resume could not use."""
    folder = Path(folder)
    try:
        manifest = read_manifest(folder)
    except (ValueError, KeyError) as e:  # JSONDecodeError is a ValueError
        raise CorruptCheckpointError(f"{folder / 'marble_checkpoint.json'} cannot be read: {e}") from e
    files = manifest.get("files", {})
    paths = [folder / files[key] for key in ("lora", "old_policy", "param_ema") if files.get(key)]
    if files.get("transformer"):  # full fine-tuning: the trained transformer's shards
        paths += sorted((folder / files["transformer"]).glob("*.safetensors"))
    for path in paths:
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
    # Last: a file that still reads (finite garbage, a changed byte) but is not what was saved
    mismatches = checksum_mismatches(folder, manifest)
    if mismatches:
        more = f" (and {len(mismatches) - 1} more)" if len(mismatches) > 1 else ""
        raise CorruptCheckpointError(mismatches[0] + more)


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
