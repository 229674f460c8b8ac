"""The trainer's publishing: its model card and ``marble_trl.json`` (:mod:`marble_trl.publish.card` and
:mod:`marble_trl.publish.run_info` render and write them), sample images for the card, and uploads to the Hub
(``push_to_hub``, ``hub_strategy`` pushes of checkpoints)."""

from __future__ import annotations

import contextlib
import json
import shutil
from pathlib import Path

from transformers import Trainer

from ..artifacts import LORA_FILE, PUSH_IGNORE, SAMPLES_DIR, TRANSFORMER_DIR
from ..evaluation.samples import save_samples
from ..models import tiny_seed_of
from ..models.tiny import is_tiny
from ..persistence.checkpoint import base_model_name
from ..publish.card import CardInfo, override_card, write_model_card
from ..publish.hub import hub_api, recorded_prompts
from ..publish.run_info import write_export_config


# ------------------------------------------------------------------------------------------------- building CardInfo
def card_info_from_trainer(trainer: Trainer, **overrides) -> CardInfo:
    info = CardInfo(
        base_model=base_model_name(trainer.pipeline, trainer.model_name_or_path),
        reward_names=list(trainer.reward_names),
        reward_weights=[float(w) for w in trainer.reward_weights],
        aggregation=trainer.aggregation,
        global_step=trainer.state.global_step,
        training_args=json.loads(trainer.args.to_json_string()),
        log_history=list(trainer.state.log_history),
        balancer_state=trainer.balancer.state_dict() if trainer.balancer is not None else None,
        repo_id=trainer.hub_model_id or trainer.args.hub_model_id,
        pipeline_class=trainer.model_adapter.pipeline_class_name,
        lora_format="diffusers" if trainer.full_policy is None else "full",
    )
    if is_tiny(info.base_model):
        info.tiny_seed = tiny_seed_of(trainer.pipeline)
    return override_card(info, overrides)


def init_repo(trainer: Trainer, token: str | None = None, private: bool | None = None) -> None:
    """The trainer's ``init_hf_repo``: create ``hub_model_id`` (default: the output folder's name)."""
    if not trainer.is_world_process_zero():
        return
    args = trainer.args
    repo_name = args.hub_model_id or Path(args.output_dir).absolute().name
    token = token if token is not None else args.hub_token
    private = private if private is not None else args.hub_private_repo
    url = hub_api(token=token).create_repo(repo_name, private=private, exist_ok=True)
    trainer.hub_model_id = url.repo_id
    trainer.push_in_progress = None


def default_sample_prompts(trainer: Trainer, n: int) -> list[str]:
    return list(dict.fromkeys(trainer.train_dataset["prompt"]))[:n] if n > 0 else []


def sample_sources(trainer: Trainer, prompts: list[str]) -> list | None:
    """An editing model's source image for each sample prompt: that of the first train row with the prompt (``None``
    for a text-to-image model)."""
    if getattr(trainer, "source_images", None) is None:
        return None
    from ..data.source_images import SOURCE_IMAGES_COLUMN

    first: dict[str, int] = {}
    for k, prompt in enumerate(trainer.train_dataset["prompt"]):
        first.setdefault(prompt, k)
    missing = [p for p in prompts if p not in first]
    if missing:
        raise ValueError(
            f"sample_prompts {missing} are not in the train dataset: an editing model's samples edit the source image "
            "of the train row with that prompt."
        )
    return [trainer.train_dataset[first[p]][SOURCE_IMAGES_COLUMN] for p in prompts]


def write_trainer_card(trainer: Trainer, folder: str | None = None, **overrides) -> Path | None:
    """The trainer's ``create_model_card``: README.md (and marble_trl.json) in ``folder`` (default ``output_dir``).

    Sample images already in ``<folder>/samples`` are shown unless ``samples`` is given.
    """
    if not trainer.is_world_process_zero():
        return None
    folder = Path(folder or trainer.args.output_dir)
    if "samples" not in overrides:
        found = sorted((folder / SAMPLES_DIR).glob("*.png")) if (folder / SAMPLES_DIR).is_dir() else []
        prompts = recorded_prompts(folder)
        overrides["samples"] = [(f"{SAMPLES_DIR}/{p.name}", prompts.get(p.name, p.stem)) for p in found]
    info = card_info_from_trainer(trainer, **overrides)
    write_export_config(folder, info)
    return write_model_card(info, folder)


def render_trainer_samples(trainer: Trainer, folder: Path, prompts: list[str], seed: int = 0) -> list[tuple[str, str]]:
    """Generate ``prompts`` with the trainer's current LoRA into ``<folder>/samples`` (replacing older samples)."""
    shutil.rmtree(folder / SAMPLES_DIR, ignore_errors=True)
    if not prompts:
        return []
    images = trainer.generate(prompts, seed=seed, source_images=sample_sources(trainer, prompts))
    pairs = save_samples(images, prompts, folder)
    (folder / SAMPLES_DIR / "prompts.json").write_text(
        json.dumps({Path(p).name: prompt for p, prompt in pairs}, indent=2) + "\n", encoding="utf-8"
    )
    return pairs


def push_trainer(
    trainer: Trainer,
    commit_message: str | None = "End of training",
    blocking: bool = True,
    token: str | None = None,
    revision: str | None = None,
    private: bool | None = None,
    *,
    ema: bool = False,
    num_samples: int = 4,
    sample_prompts: list[str] | None = None,
    **card_overrides,
):
    """The trainer's ``push_to_hub``: save the LoRA (raw or EMA) to ``output_dir``, render samples, write the card,
    upload ``output_dir`` without checkpoints. Returns the ``CommitInfo`` (a ``Future`` with ``blocking=False``)."""
    args = trainer.args
    trainer.callback_handler.on_push_begin(args, trainer.state, trainer.control)
    token = token if token is not None else args.hub_token
    if trainer.hub_model_id is None:
        trainer.init_hf_repo(token=token, private=private)
    if ema and trainer.param_ema is None:
        raise ValueError("push_to_hub(ema=True) needs a trainer with param_ema=True.")
    folder = Path(args.output_dir)
    prompts = sample_prompts if sample_prompts is not None else default_sample_prompts(trainer, num_samples)
    context = trainer.param_ema.swapped_in(trainer.transformer) if ema else contextlib.nullcontext()
    with context:
        trainer.save_model(_internal_call=True)
        if not trainer.is_world_process_zero():
            if trainer.shards_transformer and prompts:  # the main process's forwards need this one's shards
                trainer.generate(prompts, seed=0, source_images=sample_sources(trainer, prompts))
            return None
        samples = render_trainer_samples(trainer, folder, prompts)
    trainer.create_model_card(samples=samples, weights="ema" if ema else "raw", **card_overrides)
    trainer._finish_current_push()
    return hub_api(token=token).upload_folder(
        repo_id=trainer.hub_model_id,
        folder_path=str(folder),
        commit_message=commit_message or "End of training",
        revision=revision if revision is not None else args.hub_revision,
        run_as_future=not blocking,
        ignore_patterns=PUSH_IGNORE,
    )


def push_checkpoint(trainer: Trainer, checkpoint_folder: str) -> None:
    """The trainer's ``_push_from_checkpoint`` (``push_to_hub=True`` with saves during training): copy the
    checkpoint's LoRA into ``output_dir``, refresh the card, upload it in the background; with ``hub_strategy``
    ``checkpoint`` / ``all_checkpoints`` also upload the checkpoint folder (``last-checkpoint`` / its name)."""
    from transformers.trainer_utils import HubStrategy
    from transformers.utils.hub import PushInProgress

    args = trainer.args
    if not trainer.is_world_process_zero() or args.hub_strategy == HubStrategy.END:
        return
    if not args.hub_always_push and trainer.push_in_progress is not None and not trainer.push_in_progress.is_done():
        return
    trainer.callback_handler.on_push_begin(args, trainer.state, trainer.control)
    output_dir = Path(args.output_dir)
    if trainer.full_policy is not None:  # full fine-tuning: the checkpoint's transformer/ folder
        shutil.copytree(Path(checkpoint_folder) / TRANSFORMER_DIR, output_dir / TRANSFORMER_DIR, dirs_exist_ok=True)
    else:
        shutil.copy(Path(checkpoint_folder) / LORA_FILE, output_dir / LORA_FILE)
    trainer.create_model_card()
    api = hub_api(token=args.hub_token)
    message = f"Training in progress, step {trainer.state.global_step}"
    jobs = [
        api.upload_folder(
            repo_id=trainer.hub_model_id,
            folder_path=str(output_dir),
            commit_message=message,
            run_as_future=True,
            ignore_patterns=PUSH_IGNORE,
            revision=args.hub_revision,
        )
    ]
    if args.hub_strategy in (HubStrategy.CHECKPOINT, HubStrategy.ALL_CHECKPOINTS):
        path_in_repo = (
            "last-checkpoint" if args.hub_strategy == HubStrategy.CHECKPOINT else Path(checkpoint_folder).name
        )
        jobs.append(
            api.upload_folder(
                repo_id=trainer.hub_model_id,
                folder_path=checkpoint_folder,
                path_in_repo=path_in_repo,
                commit_message=message + ", checkpoint",
                run_as_future=True,
                revision=args.hub_revision,
            )
        )
    if trainer.push_in_progress is None or trainer.push_in_progress.is_done():
        trainer.push_in_progress = PushInProgress(jobs)
    else:
        trainer.push_in_progress.jobs.extend(jobs)
