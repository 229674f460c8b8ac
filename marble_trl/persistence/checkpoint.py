"""Checkpoints that resume exactly, written atomically, and a checkpoint on SIGTERM / SIGINT.

``transformers.Trainer._save_checkpoint`` already writes the optimizer, the LR scheduler, the RNG states and
``trainer_state.json`` (global step, log history); the trainer's ``_save`` writes the trained LoRA in diffusers format
(``pytorch_lora_weights.safetensors``). This module adds what DiffusionNFT / MARBLE need on top:

- ``old_policy_lora.safetensors``: the old-policy adapter (rollouts and ``v_old`` use it);
- ``param_ema.safetensors``: the parameter EMA (with ``param_ema=True``);
- ``marble_balancer.json``: the MARBLE coefficients and counters (with several rewards and ``marble``);
- ``marble_checkpoint.json``: a manifest (format version, step, rewards, base model, training arguments), written
  last.

The three ``.safetensors`` files share one key format, diffusers' (``transformer.<module>.lora_A.weight``, adapter
metadata included), so each of them loads with ``StableDiffusion3Pipeline.load_lora_weights(dir, weight_name=...)``.

The data position: ``GroupSampler`` is a pure function of ``(seed, epoch)``; the Trainer restores the epoch and skips
the epoch's finished steps, and :class:`SamplerEpochCallback` makes sure the sampler sees the epoch (accelerate's
wrappers hide it on a multi-process resume). Every random draw of a step comes from a generator keyed by the global
step (``MarbleDiffusionNFTTrainer._generator``), so nothing else needs restoring.

Atomicity: the Trainer writes the checkpoint into ``<output_dir>/tmp-checkpoint-N/checkpoint-N``; the folder is renamed
to ``<output_dir>/checkpoint-N`` only once complete (``os.rename`` within one directory is atomic on POSIX). A crash
mid-save leaves a ``tmp-checkpoint-N`` folder, which ``get_last_checkpoint`` and ``save_total_limit`` ignore.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import logging
import os
import shutil
from pathlib import Path
from typing import Any

import torch
from transformers import TrainerCallback

from ..artifacts import (
    MANIFEST_FILE,
    MANIFEST_FORMAT,
    MANIFEST_VERSION,
    STAGING_PREFIX,
    lora_key,
)
from ..data.prompts import GroupSampler
from ..distributed import copy_full_, full_tensor
from ..policy.lora import lora_parameters

logger = logging.getLogger(__name__)


# ---------------------------------------------------------------------------------------------- LoRA tensors <-> files
def adapter_state(transformer: torch.nn.Module, adapter: str) -> dict[str, torch.Tensor]:
    """One adapter's tensors under diffusers keys (contiguous CPU copies; FSDP2 gathers them: every process)."""
    return {
        lora_key(name, adapter): full_tensor(p.detach()).to("cpu").contiguous().clone()
        for name, p in lora_parameters(transformer, adapter).items()
    }


def check_keys(have: set[str], want: set[str], what: str, path: Path) -> None:
    missing, unexpected = sorted(want - have), sorted(have - want)
    if missing or unexpected:
        raise ValueError(
            f"{path} does not match this trainer's {what} (LoRA rank/targets or the model changed?): "
            f"{len(missing)} missing keys (e.g. {missing[:2]}), {len(unexpected)} unexpected (e.g. {unexpected[:2]})."
        )


@torch.no_grad()
def load_adapter_state(transformer: torch.nn.Module, adapter: str, path: str | os.PathLike) -> None:
    """Copy a diffusers-format LoRA file into ``adapter`` exactly (strict: same keys and shapes)."""
    from safetensors.torch import load_file

    path = Path(path)
    state = load_file(str(path))
    params = {lora_key(name, adapter): p for name, p in lora_parameters(transformer, adapter).items()}
    check_keys(set(state), set(params), f"'{adapter}' adapter", path)
    for key, param in params.items():
        if state[key].shape != param.shape:
            raise ValueError(f"{path}: {key} has shape {tuple(state[key].shape)}, the model {tuple(param.shape)}.")
        copy_full_(param, state[key])  # FSDP2: this process's shard


# ------------------------------------------------------------------------------------------ training state save/load
def base_model_name(pipeline, model_name_or_path: str | None = None) -> str | None:
    """The base model the LoRA applies to: the name the trainer was given, else the pipeline's ``_name_or_path``."""
    name = model_name_or_path
    if name is None:
        name = getattr(pipeline, "name_or_path", None) or pipeline.config.get("_name_or_path")
    return str(name) if name else None


def read_manifest(folder: str | os.PathLike) -> dict[str, Any]:
    """The checkpoint's manifest; a clear error for folders that are not complete marble_trl checkpoints."""
    folder = Path(folder)
    path = folder / MANIFEST_FILE
    if not folder.is_dir():
        raise FileNotFoundError(f"Checkpoint folder {str(folder)!r} does not exist.")
    if not path.is_file():
        raise ValueError(
            f"{folder} is not a complete marble_trl checkpoint: it has no {MANIFEST_FILE} (written last by every "
            "checkpoint save). Folders named tmp-checkpoint-N are interrupted saves; use a checkpoint-N folder."
        )
    manifest = json.loads(path.read_text(encoding="utf-8"))
    if manifest.get("format") != MANIFEST_FORMAT or int(manifest.get("version", 0)) > MANIFEST_VERSION:
        raise ValueError(
            f"{path}: unsupported checkpoint format {manifest.get('format')!r} v{manifest.get('version')}."
        )
    return manifest


# ------------------------------------------------------------------------------------------------ checksums
CHECKSUMS_KEY = "sha256"


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def checksums(folder: str | os.PathLike) -> dict[str, str]:
    """SHA-256 of every file of a checkpoint folder (recursively, relative POSIX paths), the manifest excluded."""
    folder = Path(folder)
    return {
        path.relative_to(folder).as_posix(): file_sha256(path)
        for path in sorted(folder.rglob("*"))
        if path.is_file() and path.name != MANIFEST_FILE
    }


def add_checksums(folder: str | os.PathLike) -> None:
    """Record every file's SHA-256 in the manifest of a complete checkpoint (rewritten in place: still the last file
    written, after every process has written its own)."""
    folder = Path(folder)
    manifest = json.loads((folder / MANIFEST_FILE).read_text(encoding="utf-8"))
    manifest[CHECKSUMS_KEY] = checksums(folder)
    write_json(folder / MANIFEST_FILE, manifest)


def checksum_mismatches(folder: str | os.PathLike, manifest: dict[str, Any]) -> list[str]:
    """The files of ``folder`` whose SHA-256 differs from the manifest's (or that are missing), as messages; empty for
    a checkpoint written before checksums existed."""
    folder = Path(folder)
    problems = []
    for name, expected in (manifest.get(CHECKSUMS_KEY) or {}).items():
        path = folder / name
        if not path.is_file():
            problems.append(f"{path} is missing")
        elif file_sha256(path) != expected:
            problems.append(f"{path} does not match its SHA-256 in {MANIFEST_FILE} (changed or corrupted on disk)")
    return problems


def latest_checkpoint(run_dir: Path) -> Path | None:
    """The newest complete ``checkpoint-N`` folder of ``run_dir`` (with its manifest), or None."""
    from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

    done = [p for p in Path(run_dir).glob(f"{PREFIX_CHECKPOINT_DIR}-*") if (p / MANIFEST_FILE).is_file()]
    steps = {p: int(p.name.rsplit("-", 1)[1]) for p in done if p.name.rsplit("-", 1)[1].isdigit()}
    return max(steps, key=steps.get) if steps else None


def check_free_space(run_dir: Path, name: str, first_bytes: int) -> None:
    """Refuse a checkpoint the disk cannot hold before writing any of it (a full disk mid-save leaves a partial
    staging folder taking the space), naming the folder and the bytes needed: the newest checkpoint's size + 10%, or
    ``first_bytes`` before the first one."""
    last = latest_checkpoint(run_dir)
    size = sum(p.stat().st_size for p in last.rglob("*") if p.is_file()) if last is not None else first_bytes
    needed = int(size * 1.1)
    free = shutil.disk_usage(run_dir if run_dir.exists() else run_dir.parent).free
    if free < needed:
        raise OSError(
            errno.ENOSPC,
            f"Not enough free space to write {run_dir / name}: it needs about {needed:,} bytes (the last checkpoint's "
            f"size + 10%), {free:,} are free. Free space, lower save_total_limit, or move output_dir. "
            + (f"The last intact checkpoint is {last}." if last else "No checkpoint was written yet."),
        )


# ------------------------------------------------------------------------------------------------ atomic checkpoints
def write_json(path: Path, data: Any) -> None:
    path.write_text(json.dumps(data, indent=2, default=jsonable) + "\n", encoding="utf-8")


def jsonable(value: Any) -> Any:
    if isinstance(value, (set, tuple)):
        return list(value)
    return str(value)


def fsync_tree(folder: Path) -> None:
    """Flush the files of ``folder`` to disk, so the rename cannot land before their contents (power loss)."""
    for path in folder.rglob("*"):
        if path.is_file():
            with open(path, "rb") as f:
                os.fsync(f.fileno())
    fsync_dir(folder)


def fsync_dir(folder: Path) -> None:
    with contextlib.suppress(OSError):  # not every platform can open a directory
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def replace_dir(src: Path, dst: Path) -> None:
    """Move the complete folder ``src`` to ``dst`` (same parent). An existing ``dst`` (say, a stale folder of an
    earlier run at the same step) is renamed away first and deleted after."""
    if not dst.exists():
        os.rename(src, dst)
        return
    old = dst.parent / f"{STAGING_PREFIX}replaced-{dst.name}"
    shutil.rmtree(old, ignore_errors=True)
    os.rename(dst, old)
    os.rename(src, dst)
    shutil.rmtree(old, ignore_errors=True)


# ------------------------------------------------------------------------------------------------ data position
def find_group_sampler(dataloader) -> GroupSampler | None:
    """The :class:`GroupSampler` under a (possibly accelerate-wrapped) dataloader."""
    stack, seen = [dataloader], set()
    while stack:
        obj = stack.pop()
        if obj is None or id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, GroupSampler):
            return obj
        stack += [getattr(obj, name, None) for name in ("batch_sampler", "sampler", "base_dataloader")]
    return None


class SamplerEpochCallback(TrainerCallback):
    """Sets the :class:`GroupSampler`'s epoch at each epoch start from the global step.

    ``transformers.Trainer`` calls ``set_epoch`` on the dataloader, but when it resumes mid-epoch under several
    processes, accelerate's wrappers (``SkipBatchSampler`` -> ``BatchSamplerShard`` -> ``BatchSampler``) hide the
    sampler from that call, and the resumed epoch would replay epoch 0's prompt order. Epochs hold whole optimizer
    steps, so the epoch is ``global_step // steps_per_epoch``.
    """

    def on_epoch_begin(self, args, state, control, train_dataloader=None, **kwargs):
        sampler = find_group_sampler(train_dataloader)
        if sampler is None:
            return
        steps_per_epoch = len(train_dataloader) // max(1, args.gradient_accumulation_steps)
        sampler.set_epoch(state.global_step // steps_per_epoch if steps_per_epoch else int(state.epoch or 0))
