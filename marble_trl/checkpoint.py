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
import json
import logging
import os
import shutil
import signal
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from transformers import TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, rotate_checkpoints

from .artifacts import (
    BALANCER_FILE,
    EMA_FILE,
    LORA_FILE,
    LORA_KEY_PREFIX,
    MANIFEST_FILE,
    MANIFEST_FORMAT,
    MANIFEST_VERSION,
    OLD_POLICY_FILE,
    STAGING_PREFIX,
    lora_key,
)
from .data import GroupSampler
from .lora import OLD_ADAPTER, TRAIN_ADAPTER, lora_parameters
from .output_dir import OutputDirLock, check_not_overwriting
from .resume import DATASET_KEY, check_resume_config, dataset_fingerprint, resolve_resume

if TYPE_CHECKING:
    from .trainer import MarbleDiffusionNFTTrainer

logger = logging.getLogger(__name__)


# ---------------------------------------------------------------------------------------------- LoRA tensors <-> files
def adapter_state(transformer: torch.nn.Module, adapter: str) -> dict[str, torch.Tensor]:
    """One adapter's tensors under diffusers keys (contiguous CPU copies)."""
    return {
        lora_key(name, adapter): p.detach().to("cpu").contiguous().clone()
        for name, p in lora_parameters(transformer, adapter).items()
    }


def _check_keys(have: set[str], want: set[str], what: str, path: Path) -> None:
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
    _check_keys(set(state), set(params), f"'{adapter}' adapter", path)
    for key, param in params.items():
        if state[key].shape != param.shape:
            raise ValueError(f"{path}: {key} has shape {tuple(state[key].shape)}, the model {tuple(param.shape)}.")
        param.copy_(state[key].to(device=param.device, dtype=param.dtype))


def save_lora_file(trainer: MarbleDiffusionNFTTrainer, folder: str | os.PathLike, layers: dict, weight_name: str):
    """Write ``layers`` (diffusers keys, with the ``transformer.`` prefix) like the trainer's own LoRA file."""
    unprefixed = {k[len(LORA_KEY_PREFIX) :]: v for k, v in layers.items()}
    type(trainer.pipeline).save_lora_weights(
        str(folder),
        transformer_lora_layers=unprefixed,
        transformer_lora_adapter_metadata=trainer.peft_config.to_dict(),
        weight_name=weight_name,
    )


# ------------------------------------------------------------------------------------------ training state save/load
def base_model_name(trainer: MarbleDiffusionNFTTrainer) -> str | None:
    """The base model the LoRA applies to: the name the trainer was given, else the pipeline's ``_name_or_path``."""
    name = getattr(trainer, "model_name_or_path", None)
    if name is None:
        name = getattr(trainer.pipeline, "name_or_path", None) or trainer.pipeline.config.get("_name_or_path")
    return str(name) if name else None


def save_training_state(trainer: MarbleDiffusionNFTTrainer, folder: str | os.PathLike) -> None:
    """Write the old-policy adapter, the parameter EMA, the balancer state and the manifest into ``folder``.

    ``folder`` already holds the trained LoRA (``_save``) and the Trainer's files. Main process only.
    """
    if not trainer.args.should_save:
        return
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    files: dict[str, str | None] = {
        "lora": LORA_FILE,
        "old_policy": OLD_POLICY_FILE,
        "param_ema": None,
        "balancer": None,
    }
    old = adapter_state(trainer.transformer, OLD_ADAPTER)
    master = trainer.old_policy.master_state()  # DeepSpeed bf16: the float32 weights, not the rounded adapter
    if master is not None:
        old = {lora_key(n, OLD_ADAPTER): t.contiguous() for n, t in master.items()}
    save_lora_file(trainer, folder, old, OLD_POLICY_FILE)
    if trainer.param_ema is not None:
        ema = {lora_key(n, TRAIN_ADAPTER): t.contiguous() for n, t in trainer.param_ema.state_dict().items()}
        save_lora_file(trainer, folder, ema, EMA_FILE)
        files["param_ema"] = EMA_FILE
    if trainer.balancer is not None:
        _write_json(folder / BALANCER_FILE, trainer.balancer.state_dict())
        files["balancer"] = BALANCER_FILE
    from . import __version__

    manifest = {
        "format": MANIFEST_FORMAT,
        "version": MANIFEST_VERSION,
        "marble_trl_version": __version__,
        "global_step": trainer.state.global_step,
        "base_model": base_model_name(trainer),
        "reward_names": list(trainer.reward_names),
        "reward_weights": [float(w) for w in trainer.reward_weights],
        "aggregation": trainer.aggregation,
        DATASET_KEY: dataset_fingerprint(trainer.train_dataset),
        "files": files,
        "lora_config": json.loads(json.dumps(trainer.peft_config.to_dict(), default=_jsonable)),
        "training_args": json.loads(trainer.args.to_json_string()),
    }
    _write_json(folder / MANIFEST_FILE, manifest)  # last: its presence marks a complete marble_trl checkpoint


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


def load_training_state(trainer: MarbleDiffusionNFTTrainer, folder: str | os.PathLike) -> None:
    """Restore the trained and old-policy adapters, the parameter EMA and the balancer from a checkpoint folder.

    The Trainer restores the rest itself (optimizer, scheduler, RNG states, global step, data position).
    """
    folder = Path(folder)
    manifest = read_manifest(folder)
    if list(manifest["reward_names"]) != list(trainer.reward_names):
        raise ValueError(
            f"{folder} was trained with rewards {manifest['reward_names']}, this trainer has {trainer.reward_names}: "
            "resuming with other rewards is not an exact resume (start a new run from the exported LoRA instead)."
        )
    if manifest["aggregation"] != trainer.aggregation:
        raise ValueError(
            f"{folder} was trained with multi_objective_aggregation {manifest['aggregation']!r}, this trainer uses "
            f"{trainer.aggregation!r}."
        )
    check_resume_config(trainer, manifest, folder)
    files = manifest["files"]
    transformer = trainer.transformer
    load_adapter_state(transformer, TRAIN_ADAPTER, folder / files["lora"])
    load_adapter_state(transformer, OLD_ADAPTER, folder / files["old_policy"])
    trainer.old_policy.reset()  # the adapter (float32 outside DeepSpeed, where resuming is refused) is the truth
    if trainer.param_ema is not None:
        if not files.get("param_ema"):
            raise ValueError(f"{folder} has no parameter EMA (trained with param_ema=False); this trainer has one.")
        from safetensors.torch import load_file

        state = load_file(str(folder / files["param_ema"]))
        names = list(trainer.param_ema.state_dict())
        _check_keys(set(state), {lora_key(n, TRAIN_ADAPTER) for n in names}, "parameter EMA", folder)
        trainer.param_ema.load_state_dict({n: state[lora_key(n, TRAIN_ADAPTER)] for n in names})
    elif files.get("param_ema"):
        logger.warning("%s holds a parameter EMA but this trainer has param_ema=False: the EMA is dropped.", folder)
    if trainer.balancer is not None:
        trainer.balancer.load_state_dict(json.loads((folder / files["balancer"]).read_text(encoding="utf-8")))
    logger.info("Restored the LoRA adapters%s from %s.", ", EMA and MARBLE state" if trainer.balancer else "", folder)


# ------------------------------------------------------------------------------------------------ atomic checkpoints
def _write_json(path: Path, data: Any) -> None:
    path.write_text(json.dumps(data, indent=2, default=_jsonable) + "\n", encoding="utf-8")


def _jsonable(value: Any) -> Any:
    if isinstance(value, (set, tuple)):
        return list(value)
    return str(value)


def _fsync_tree(folder: Path) -> None:
    """Flush the files of ``folder`` to disk, so the rename cannot land before their contents (power loss)."""
    for path in folder.rglob("*"):
        if path.is_file():
            with open(path, "rb") as f:
                os.fsync(f.fileno())
    _fsync_dir(folder)


def _fsync_dir(folder: Path) -> None:
    with contextlib.suppress(OSError):  # not every platform can open a directory
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _replace_dir(src: Path, dst: Path) -> None:
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


def save_checkpoint_atomically(trainer: MarbleDiffusionNFTTrainer, save, model, trial) -> None:
    """Run the Trainer's ``_save_checkpoint`` (``save``) into a staging folder, add the training state, then rename.

    The trainer's ``_get_output_dir`` returns ``trainer._checkpoint_staging_root`` while it is set, so the Trainer
    writes everything (model, optimizer, scheduler, per-process RNG states, trainer state) under the staging folder;
    pushes to the Hub wait for the rename.
    """
    args = trainer.args
    run_dir = Path(trainer._get_output_dir(trial=trial))
    name = f"{PREFIX_CHECKPOINT_DIR}-{trainer.state.global_step}"
    staging_root = run_dir / f"{STAGING_PREFIX}{name}"
    final = run_dir / name
    if args.should_save:
        shutil.rmtree(staging_root, ignore_errors=True)  # left by a crash during an earlier save of this step
        staging_root.mkdir(parents=True)
    trainer.accelerator.wait_for_everyone()
    trainer._checkpoint_staging_root = str(staging_root)
    try:
        save(model, trial)
        save_training_state(trainer, staging_root / name)
    finally:
        trainer._checkpoint_staging_root = None
    trainer.accelerator.wait_for_everyone()
    if args.should_save:
        _fsync_tree(staging_root / name)
        _replace_dir(staging_root / name, final)
        staging_root.rmdir()
        _fsync_dir(run_dir)
        rotate_checkpoints(
            output_dir=str(run_dir),
            save_total_limit=args.save_total_limit,
            best_model_checkpoint=trainer.state.best_model_checkpoint,
            use_mtime=True,
        )
    trainer.accelerator.wait_for_everyone()
    if args.push_to_hub:
        trainer._push_from_checkpoint(str(final))


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


# ------------------------------------------------------------------------------------------------ SIGTERM / SIGINT
class SaveOnSignalCallback(TrainerCallback):
    """On SIGTERM or SIGINT, finish the current optimizer step, write a checkpoint and stop training cleanly.

    ``trainer.train()`` then returns normally and ``trainer.stopped_by_signal`` names the signal. A second signal
    restores the previous handlers and re-delivers itself (Ctrl-C twice aborts without saving). The checkpoint is
    written even with ``save_strategy="no"``. With several processes the flag is all-reduced at each step end, so
    all of them stop at the same step. Remove it with ``trainer.remove_callback(SaveOnSignalCallback)``.

    Handlers are installed by :func:`training_session` around ``trainer.train()`` (main thread only). A signal the
    process inherited as ignored stays ignored: a background job (``cmd &``) keeps ignoring SIGINT, SIGTERM still
    writes its checkpoint.
    """

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self, trainer: MarbleDiffusionNFTTrainer) -> None:
        self.trainer = trainer
        self.received: int | None = None
        trainer.stopped_by_signal = None

    def handle(self, signum: int, frame) -> None:
        if self.received is not None:
            # Second signal: give up on the clean stop and let the previous handler act (default: terminate).
            self.restore()
            signal.raise_signal(signum)
            return
        self.received = signum
        logger.warning(
            "Received %s: a checkpoint will be written at the end of the current optimizer step, then training "
            "stops. Send it again to abort without saving.",
            signal.Signals(signum).name,
        )

    def install(self) -> None:
        """Handle the signals this process does not ignore.

        A signal inherited as ignored stays ignored (the Unix convention: a non-interactive shell starts background
        jobs, ``cmd &``, with SIGINT ignored, so that an interrupt meant for the foreground job does not reach them;
        ``nohup`` does the same with SIGHUP). A handler installed outside Python (``signal.getsignal`` returns
        ``None``) is left alone too: it could not be restored afterwards.
        """
        self.received = None
        self.trainer.stopped_by_signal = None
        self._previous = {}
        for s in self.SIGNALS:
            previous = signal.getsignal(s)
            if previous is signal.SIG_IGN or previous is None:
                name = signal.Signals(s).name
                how = "ignored" if previous is signal.SIG_IGN else "handled outside Python"
                logger.info("%s is %s in this process: left as it is (no checkpoint on %s).", name, how, name)
                continue
            self._previous[s] = signal.signal(s, self.handle)

    def restore(self) -> None:
        for s, handler in getattr(self, "_previous", {}).items():
            signal.signal(s, handler)
        self._previous = {}

    def _any_process_received(self) -> bool:
        flag = self.received is not None
        accelerator = self.trainer.accelerator
        if accelerator.num_processes > 1:
            t = torch.tensor([float(flag)], device=accelerator.device)
            torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
            flag = bool(t.item())
        return flag

    def on_step_end(self, args, state, control, **kwargs):
        if self._any_process_received():
            control.should_save = True
            control.should_training_stop = True
            name = signal.Signals(self.received).name if self.received is not None else "a signal on another process"
            self.trainer.stopped_by_signal = name
            logger.warning("Stopping at step %d after %s; saving a checkpoint.", state.global_step, name)
        return control


@contextlib.contextmanager
def training_session(trainer: MarbleDiffusionNFTTrainer, resume_from_checkpoint=None) -> Iterator[str | None]:
    """Around ``trainer.train()``: refuse resumes this module cannot make exact, hold the ``output_dir`` lock, refuse to
    write over an earlier run, pick the checkpoint to resume from (yielded: the newest *valid* one for ``True``),
    install the :class:`SaveOnSignalCallback` handlers, and write an emergency checkpoint when training raises.
    Everything is undone on exit, also on errors."""
    if resume_from_checkpoint and (trainer.is_deepspeed_enabled or trainer.is_fsdp_enabled):
        raise NotImplementedError(
            "Resuming under DeepSpeed / FSDP is not supported yet: the Trainer loads those checkpoints through the "
            "engine and would skip the old-policy adapter, the parameter EMA and the MARBLE state. Resume with DDP "
            "or a single process (checkpoints are engine-independent), or start from the exported LoRA."
        )
    args = trainer.args
    lock = OutputDirLock(args.output_dir) if args.should_save else None
    if lock is not None:
        lock.acquire()
    callback = next((c for c in trainer.callback_handler.callbacks if isinstance(c, SaveOnSignalCallback)), None)
    active = callback is not None and threading.current_thread() is threading.main_thread()
    try:
        check_not_overwriting(args.output_dir, bool(resume_from_checkpoint), args.overwrite_output_dir)
        resume = resolve_resume(args.output_dir, resume_from_checkpoint)
        if active:
            callback.install()
        try:
            yield resume
        except Exception as error:
            save_emergency_checkpoint(trainer, error)
            raise
        finally:
            if active:
                callback.restore()
    finally:
        if lock is not None:
            lock.release()


def save_emergency_checkpoint(trainer: MarbleDiffusionNFTTrainer, error: BaseException) -> str | None:
    """After ``train()`` raised: write an atomic checkpoint of the last completed step (the state a step-end save
    would have written: a step interrupted midway changed no parameter), so the run resumes from there. Skipped
    before the first step, when that step's checkpoint exists, with non-finite weights (never saved), and with
    several processes (a save is collective and the other processes may be stuck). Returns the folder or None."""
    step = trainer.state.global_step
    folder = Path(trainer.args.output_dir) / f"{PREFIX_CHECKPOINT_DIR}-{step}"
    reason = None
    if step == 0:
        reason = "no optimizer step was completed"
    elif trainer.accelerator.num_processes > 1:
        reason = "a save needs every process, and with several processes the others may be stuck"
    elif folder.is_dir():
        reason = f"{folder} already exists"
    else:
        from .guards import non_finite_tensors

        tensors = {n: p.detach() for n, p in trainer.transformer.named_parameters() if "lora_" in n}
        if trainer.param_ema is not None:
            tensors.update({f"ema.{n}": t for n, t in trainer.param_ema.state_dict().items()})
        if non_finite_tensors(tensors):
            reason = "an adapter or the EMA is not finite"
    if reason is not None:
        logger.error(
            "Training failed at step %d (%s: %s); no emergency checkpoint: %s.",
            step,
            type(error).__name__,
            error,
            reason,
        )
        return None
    try:
        trainer._save_checkpoint(trainer.model, trial=None)
    except Exception as save_error:  # the original error matters more: report both, raise the original
        logger.error("Training failed (%r) and the emergency checkpoint failed too: %r", error, save_error)
        return None
    logger.error(
        "Training failed at step %d (%s: %s). Emergency checkpoint: %s (resume with --resume_from_checkpoint true).",
        step,
        type(error).__name__,
        error,
        folder,
    )
    trainer.emergency_checkpoint = str(folder)
    return str(folder)
