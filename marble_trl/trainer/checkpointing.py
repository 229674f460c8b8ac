"""The trainer's checkpoints: what a checkpoint holds beyond the Trainer's own files, written atomically, loaded for
an exact resume (with the checks of :mod:`marble_trl.persistence.resume`), and the best checkpoint of ``load_best_model_at_end``
(the checkpoints on SIGTERM / SIGINT and after a crash: :mod:`.interruptions`). The folder format is :mod:`marble_trl.persistence.checkpoint`'s
(file names in :mod:`marble_trl.artifacts`); these functions take the trainer whose state they save or restore.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path
from typing import Any

import torch
from transformers import Trainer
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, SaveStrategy, rotate_checkpoints

from .._version import __version__
from ..artifacts import (
    BALANCER_FILE,
    EMA_FILE,
    FULL_OLD_POLICY_FILE,
    LORA_FILE,
    MANIFEST_FILE,
    MANIFEST_FORMAT,
    MANIFEST_VERSION,
    OLD_POLICY_FILE,
    STAGING_PREFIX,
    TRAINER_STATE_FILE,
    TRANSFORMER_DIR,
    lora_key,
)
from ..distributed import full_tensor, gathered, reshard
from ..persistence.checkpoint import (
    adapter_state,
    add_checksums,
    base_model_name,
    check_free_space,
    check_keys,
    fsync_dir,
    fsync_tree,
    jsonable,
    latest_checkpoint,
    load_adapter_state,
    read_manifest,
    replace_dir,
    write_json,
)
from ..persistence.full_weights import load_trained_weights, save_named
from ..persistence.resume import APPLIED_FIELDS, DATASET_KEY, EXACT_FIELDS, FROZEN_FIELDS, dataset_fingerprint
from ..policy.lora import OLD_ADAPTER, TRAIN_ADAPTER, lora_parameters, master_weights

logger = logging.getLogger(__name__)


def save_lora_file(trainer: Trainer, folder: str | os.PathLike, layers: dict, weight_name: str):
    """Write ``layers`` (diffusers keys, with the ``transformer.`` prefix) like the trainer's own LoRA file."""
    trainer.model_adapter.save_lora(folder, layers, trainer.peft_config.to_dict(), weight_name)


def trained_args(trainer: Trainer) -> dict:
    """The training arguments as JSON, their LoRA fields set to the LoRA that was trained (a ``peft_config`` given to
    the trainer overrides ``lora_r`` and the rest: the manifest must not record the unused defaults)."""
    args = json.loads(trainer.args.to_json_string())
    config = trainer.peft_config
    if config is None:  # full fine-tuning: no LoRA
        return args
    targets = config.target_modules
    args.update(
        lora_r=config.r,
        lora_alpha=config.lora_alpha,
        lora_dropout=config.lora_dropout,
        lora_target_modules=sorted(targets) if isinstance(targets, (set, list, tuple)) else targets,
    )
    return args


def save_training_state(trainer: Trainer, folder: str | os.PathLike) -> None:
    """Write the old-policy adapter, the parameter EMA, the balancer state and the manifest into ``folder``.

    ``folder`` already holds the trained LoRA (``_save``) and the Trainer's files. Every process calls it (ZeRO-3 and
    FSDP2 gather here); only the main process writes.
    """
    full = trainer.full_policy is not None
    if full:
        if trainer.full_policy.sharded(trainer.transformer) or trainer.args.should_save:  # FSDP2 / ZeRO-3 gather
            keep = trainer.args.should_save  # the other processes take part in the gathers and keep nothing
            old_whole = trainer.full_policy.master_state(trainer.transformer, keep)
            ema = trainer.param_ema
            ema_whole = ema.state_dict(trainer.transformer, keep) if ema is not None else None
    else:
        with gathered(lora_parameters(trainer.transformer, OLD_ADAPTER).values()):  # ZeRO-3: every process gathers
            old = adapter_state(trainer.transformer, OLD_ADAPTER)
    if not trainer.args.should_save:
        return
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    files: dict[str, str | None] = {
        "lora": None if full else LORA_FILE,
        "old_policy": FULL_OLD_POLICY_FILE if full else OLD_POLICY_FILE,
        "param_ema": None,
        "balancer": None,
    }
    if full:  # the trained transformer is _save's transformer/ folder
        files["transformer"] = TRANSFORMER_DIR
        save_named(old_whole, folder / FULL_OLD_POLICY_FILE)
        if ema_whole is not None:
            save_named(ema_whole, folder / EMA_FILE)
            files["param_ema"] = EMA_FILE
    else:
        master = trainer.old_policy.master_state()  # DeepSpeed bf16: the float32 weights, not the rounded adapter
        if master is not None:
            old = {lora_key(n, OLD_ADAPTER): t.contiguous() for n, t in master.items()}
        save_lora_file(trainer, folder, old, OLD_POLICY_FILE)
        if trainer.param_ema is not None:
            ema = {lora_key(n, TRAIN_ADAPTER): t.contiguous() for n, t in trainer.param_ema.state_dict().items()}
            save_lora_file(trainer, folder, ema, EMA_FILE)
            files["param_ema"] = EMA_FILE
    if trainer.balancer is not None:
        write_json(folder / BALANCER_FILE, trainer.balancer.state_dict())
        files["balancer"] = BALANCER_FILE
    manifest = {
        "format": MANIFEST_FORMAT,
        "version": MANIFEST_VERSION,
        "marble_trl_version": __version__,
        "global_step": trainer.state.global_step,
        "base_model": base_model_name(trainer.pipeline, trainer.model_name_or_path),
        "pipeline_class": trainer.model_adapter.pipeline_class_name,
        "reward_names": list(trainer.reward_names),
        "reward_weights": [float(w) for w in trainer.reward_weights],
        "aggregation": trainer.aggregation,
        DATASET_KEY: dataset_fingerprint(trainer.train_dataset),
        "files": files,
        "policy": "full" if full else "lora",
        "lora_config": None if full else json.loads(json.dumps(trainer.peft_config.to_dict(), default=jsonable)),
        "training_args": trained_args(trainer),
    }
    write_json(folder / MANIFEST_FILE, manifest)  # last: its presence marks a complete marble_trl checkpoint


def load_training_state(trainer: Trainer, folder: str | os.PathLike, engine_restored: bool = False) -> None:
    """Restore the trained and old-policy adapters, the parameter EMA and the balancer from a checkpoint folder.

    The Trainer restores the rest itself (optimizer, scheduler, RNG states, global step, data position).
    ``engine_restored``: DeepSpeed's engine checkpoint has already restored the trained adapter with its optimizer
    partitions (writing it again would leave ZeRO's own float32 copy behind); only the rest is loaded, on every
    process (ZeRO-3 gathers the old adapter, and rank 0's copy is partitioned back).
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
    kind = manifest.get("policy", "lora")
    if kind != ("full" if trainer.full_policy is not None else "lora"):
        raise ValueError(
            f"{folder} holds a {kind} run and this trainer has use_peft={trainer.args.use_peft}: a checkpoint resumes "
            "the kind of training that wrote it (use_peft true for a LoRA, false for full fine-tuning)."
        )
    if trainer.param_ema is not None and not files.get("param_ema"):
        raise ValueError(f"{folder} has no parameter EMA (trained with param_ema=False); this trainer has one.")
    if trainer.full_policy is not None:
        load_full_state(trainer, folder, files, engine_restored)
    else:
        if not engine_restored:
            load_adapter_state(transformer, TRAIN_ADAPTER, folder / files["lora"])
        old = lora_parameters(transformer, OLD_ADAPTER)
        with gathered(old.values(), modifier_rank=0), torch.no_grad():
            load_adapter_state(transformer, OLD_ADAPTER, folder / files["old_policy"])
        # The old adapter is float32 but under DeepSpeed bf16 / fp16: then the file's float32 values become the master.
        trainer.old_policy.load_master(folder / files["old_policy"], old)
        if trainer.param_ema is not None:
            from safetensors.torch import load_file

            state = load_file(str(folder / files["param_ema"]))
            names = list(trainer.param_ema.shadow)
            check_keys(set(state), {lora_key(n, TRAIN_ADAPTER) for n in names}, "parameter EMA", folder)
            trainer.param_ema.load_state_dict({n: state[lora_key(n, TRAIN_ADAPTER)] for n in names})
    if trainer.param_ema is None and files.get("param_ema"):
        logger.warning("%s holds a parameter EMA but this trainer has param_ema=False: the EMA is dropped.", folder)
    if trainer.balancer is not None:
        trainer.balancer.load_state_dict(json.loads((folder / files["balancer"]).read_text(encoding="utf-8")))
    what = "LoRA adapters" if trainer.full_policy is None else "trained transformer weights, old policy"
    logger.info("Restored the %s%s from %s.", what, ", EMA and MARBLE state" if trainer.balancer else "", folder)


def save_checkpoint_atomically(trainer: Trainer, save, model, trial) -> None:
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
        params = trainer.trainable_parameters().values()
        check_free_space(run_dir, name, 6 * sum(p.numel() * p.element_size() for p in params) + (1 << 20))
        staging_root.mkdir(parents=True)
    trainer.accelerator.wait_for_everyone()
    trainer._checkpoint_staging_root = str(staging_root)
    try:
        save(model, trial)
        save_training_state(trainer, staging_root / name)
        trainer.accelerator.wait_for_everyone()
        if args.should_save:
            add_checksums(staging_root / name)  # every process's files are written: hash them into the manifest
            fsync_tree(staging_root / name)
    except Exception as error:
        if args.should_save:  # a partial staging folder would only take the space a next save needs
            shutil.rmtree(staging_root, ignore_errors=True)
        intact = latest_checkpoint(run_dir)
        raise OSError(
            getattr(error, "errno", None),
            f"Writing {run_dir / name} failed ({type(error).__name__}: {error}); its partial files were removed. "
            + (f"The last intact checkpoint is {intact}." if intact else "No earlier checkpoint exists."),
        ) from error
    finally:
        trainer._checkpoint_staging_root = None
    if args.should_save:
        replace_dir(staging_root / name, final)
        staging_root.rmdir()
        fsync_dir(run_dir)
        rotate_checkpoints(
            output_dir=str(run_dir),
            save_total_limit=args.save_total_limit,
            best_model_checkpoint=trainer.state.best_model_checkpoint,
            use_mtime=True,
        )
    trainer.accelerator.wait_for_everyone()
    if args.push_to_hub:
        trainer._push_from_checkpoint(str(final))


# ------------------------------------------------------------------------------------------ configuration changes
def check_resume_config(trainer: Trainer, manifest: dict[str, Any], folder: Path) -> None:
    """Refuse a resume whose new configuration changes what the resumed steps compute (see the module docstring)."""
    old, new = manifest.get("training_args", {}), trained_args(trainer)  # both with the LoRA actually trained
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


def apply_changed_hyperparameters(trainer: Trainer, folder: str | os.PathLike) -> None:
    """After the Trainer restored the optimizer and scheduler: apply an allowed new learning rate / weight decay."""
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


def record_best_checkpoint(trainer: Trainer, run_dir: str) -> None:
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
    staging = trainer._checkpoint_staging_root
    if args.should_save and staging:
        state.save_to_json(os.path.join(staging, f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}", TRAINER_STATE_FILE))


def load_best_checkpoint(trainer: Trainer) -> None:
    """``load_best_model_at_end``: copy the trained LoRA, the old-policy adapter and the parameter EMA (which the
    evaluation scored when ``eval_use_param_ema``) of ``state.best_model_checkpoint`` into the trainer."""
    folder = Path(trainer.state.best_model_checkpoint)
    if trainer.backend.checkpoint_owner == "deepspeed":
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
    if trainer.full_policy is not None:
        load_full_state(trainer, folder, files)
        return
    load_adapter_state(transformer, TRAIN_ADAPTER, folder / files["lora"])
    load_adapter_state(transformer, OLD_ADAPTER, folder / files["old_policy"])
    trainer.old_policy.reset()
    if trainer.param_ema is not None and files.get("param_ema"):
        from safetensors.torch import load_file

        state = load_file(str(folder / files["param_ema"]))
        names = list(trainer.param_ema.shadow)
        check_keys(set(state), {lora_key(n, TRAIN_ADAPTER) for n in names}, "parameter EMA", folder)
        trainer.param_ema.load_state_dict({n: state[lora_key(n, TRAIN_ADAPTER)] for n in names})
    logger.info(
        "Loaded the best checkpoint %s (%s = %s).",
        folder,
        trainer.args.metric_for_best_model,
        trainer.state.best_metric,
    )


def trained_lora_layers(
    transformer: torch.nn.Module, params: dict[str, torch.nn.Parameter]
) -> dict[str, torch.Tensor]:
    """The trained adapter's tensors under diffusers' keys without the prefix (``save_lora_weights``' input), as CPU
    copies. ZeRO-3 may partition the LoRA: every process must call this (it gathers); DeepSpeed bf16 keeps the float32
    weights in its optimizer, and those are saved, not the rounded module copy."""
    from peft.utils import get_peft_model_state_dict  # peft's utils import transformers' model zoo

    with gathered(params.values()):
        layers = get_peft_model_state_dict(transformer, adapter_name=TRAIN_ADAPTER)
        masters = {name.replace(f".{TRAIN_ADAPTER}.", "."): v for name, v in master_weights(params).items()}
        if set(masters) != set(layers):
            raise RuntimeError(
                f"peft's LoRA keys {sorted(layers)[:2]} do not match the parameters {sorted(masters)[:2]}."
            )
        return {name: full_tensor(value).cpu().clone() for name, value in masters.items()}  # FSDP2: gathered


def load_full_state(trainer: Trainer, folder: Path, files: dict[str, Any], engine_restored: bool = False) -> None:
    """Full fine-tuning: the trained weights (``transformer/``; not when DeepSpeed's engine checkpoint restored them
    with their float32 masters), the old policy and, when both have one, the EMA (the checks around it and the
    balancer: :func:`load_training_state`, which a best-checkpoint load skips)."""
    from safetensors.torch import load_file

    reshard(trainer.transformer)  # FSDP2: the sharded parameters, not a forward's gathered copies
    if not engine_restored:
        load_trained_weights(trainer.trainable_parameters(), folder)
    trainer.full_policy.load_old(load_file(str(folder / files["old_policy"])), trainer.transformer)
    if trainer.param_ema is not None and files.get("param_ema"):
        trainer.param_ema.load_state_dict(load_file(str(folder / files["param_ema"])), trainer.transformer)
