"""The trainer's saving, checkpoint and Hub hooks (a mixin of :class:`~marble_trl.trainer.MarbleDiffusionNFTTrainer`):
each ``transformers.Trainer`` hook it overrides delegates to :mod:`.checkpointing` or :mod:`.publishing`.

- ``_save`` / ``save_model``: the LoRA in diffusers format (``pytorch_lora_weights.safetensors`` with adapter metadata) instead of the
  whole transformer, the pickled config and ``marble_trl.json``;
- ``train``: SIGTERM / SIGINT write a checkpoint at the next step end and stop; an emergency checkpoint on a crash;
- ``_save_checkpoint`` / ``_get_output_dir``: atomic checkpoints (written under a staging folder, then renamed);
  ``_save_optimizer_and_scheduler``: under FSDP, no copy of the frozen transformer;
- ``_load_from_checkpoint`` / ``_load_optimizer_and_scheduler``: exact resume, with allowed hyperparameter changes;
- ``_load_best_model``: ``load_best_model_at_end`` restores the best checkpoint's LoRA adapters;
- ``create_model_card`` / ``init_hf_repo`` / ``push_to_hub`` / ``_push_from_checkpoint``: a diffusers LoRA card and
  Hub uploads.
"""

from __future__ import annotations

import json
import logging
import os

import torch
from transformers.trainer import TRAINER_STATE_NAME

from ..artifacts import TRAINING_ARGS_FILE
from ..persistence.full_weights import save_transformer
from ..publish.run_info import write_export_config
from .checkpointing import (
    apply_changed_hyperparameters,
    load_best_checkpoint,
    load_training_state,
    record_best_checkpoint,
    save_checkpoint_atomically,
    trained_lora_layers,
)
from .console import torch_threads
from .interruptions import training_session
from .publishing import card_info_from_trainer, init_repo, push_checkpoint, push_trainer, write_trainer_card

logger = logging.getLogger(__name__)


def finished_checkpoint_step(folder: str | None, max_steps: int) -> int | None:
    """The global step of the resumed checkpoint when it already reached ``max_steps`` (> 0), else None."""
    if folder is None or max_steps <= 0:
        return None
    path = os.path.join(folder, TRAINER_STATE_NAME)
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        step = int(json.load(f).get("global_step", 0))
    return step if step >= max_steps else None


class PersistenceHooks:
    """Saving, checkpoints and the Hub for the trainer (mixed in before TRL's trainer base)."""

    def _save(self, output_dir: str | None = None, state_dict=None) -> None:
        """Save the trained LoRA in diffusers format (``pytorch_lora_weights.safetensors`` with adapter metadata),
        loadable with ``StableDiffusion3Pipeline.load_lora_weights``; under full fine-tuning the trained transformer
        (``transformer/``, loadable with the family's transformer class ``from_pretrained``)."""
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        if self.full_policy is not None:  # use_peft=False: the whole transformer as a diffusers model folder
            # every process (FSDP2 and ZeRO-3 gather, DeepSpeed's master reads are collectives)
            state = self.full_policy.saved_state(self.transformer, keep=self.args.should_save)
            if self.args.should_save:
                os.makedirs(output_dir, exist_ok=True)
                save_transformer(self.transformer, output_dir, state)
        else:
            layers = trained_lora_layers(self.transformer, self.trainable_parameters())  # every process (ZeRO-3)
            if self.args.should_save:
                os.makedirs(output_dir, exist_ok=True)
                self.model_adapter.save_lora(output_dir, layers, self.peft_config.to_dict())
        if not self.args.should_save:
            return
        torch.save(self.args, os.path.join(output_dir, TRAINING_ARGS_FILE))
        # marble_trl.json: base model and sampler settings, the defaults of `marble-trl generate --lora <folder>`.
        write_export_config(output_dir, card_info_from_trainer(self))

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """The Trainer's, except under FSDP: there it writes only FSDP's own state dict (whole transformer, or none
        with ``SHARDED_STATE_DICT``); the LoRA file is ``_save``'s, gathered on every process."""
        if self.backend.checkpoint_owner != "fsdp":
            return super().save_model(output_dir, _internal_call)
        self._save(output_dir)
        if self.args.push_to_hub and not _internal_call:
            self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)

    def create_model_card(self, model_name=None, dataset_name=None, tags=None, **card_fields) -> None:
        """Write a diffusers LoRA model card (README.md) and ``marble_trl.json`` to ``output_dir`` (see
        :mod:`marble_trl.publish.card`); TRL's card is a language-model card."""
        tags = [tags] if isinstance(tags, str) else tags
        write_trainer_card(self, model_name=model_name, dataset_name=dataset_name, tags=tags, **card_fields)

    def train(self, resume_from_checkpoint=None, *args, **kwargs):
        """``transformers.Trainer.train``; SIGTERM / SIGINT write a checkpoint at the next step end and stop. Runs with
        ``torch_num_threads`` CPU threads when set (torch's count is restored afterwards)."""
        with torch_threads(self.args.torch_num_threads), training_session(self, resume_from_checkpoint) as resume:
            finished = finished_checkpoint_step(resume, self.args.max_steps)
            if finished is not None:
                return self._restore_finished(resume, finished)
            return super().train(resume, *args, **kwargs)

    def _restore_finished(self, folder: str, step: int):
        """The resumed checkpoint already reached ``max_steps`` (a run stopped after its last checkpoint, before its
        final files): restore it instead of training. ``transformers.Trainer.train`` would train one step past
        ``max_steps``. Under DeepSpeed / FSDP the restore needs the prepared engine: refused with the way out."""
        from transformers import TrainerState
        from transformers.trainer_utils import TrainOutput

        if self.backend.checkpoint_owner != "trainer":
            raise ValueError(
                f"{folder} is at step {step}, max_steps={self.args.max_steps}: nothing is left to train. Its trained "
                f"LoRA is {folder}/pytorch_lora_weights.safetensors (`marble-trl export {folder}` writes the "
                "diffusers folder); raise --max_steps to train on."
            )
        logger.warning("%s is at step %d = max_steps: nothing left to train; restoring it.", folder, step)
        self._load_from_checkpoint(folder)
        self.state = TrainerState.load_from_json(os.path.join(folder, TRAINER_STATE_NAME))
        # train_loss: the mean logged loss (the Trainer's is the mean over the steps, logged after the checkpoint)
        losses = [e["loss"] for e in self.state.log_history if "loss" in e]
        return TrainOutput(step, sum(losses) / len(losses) if losses else float("nan"), {})

    def _save_checkpoint(self, model, trial) -> None:
        base = super()

        def save(model, trial) -> None:
            base._save_checkpoint(model, trial)
            record_best_checkpoint(self, base._get_output_dir(trial))  # the real folder, not the staging one

        save_checkpoint_atomically(self, save, model, trial)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        """The Trainer's, except under FSDP: only the optimizer's sharded state and the scheduler, not FSDP's state
        dict of the whole transformer (its frozen base weights, 4.2 GiB for SD3.5 Medium, are the base model's, and
        the adapters are in the checkpoint's LoRA files, which the resume loads)."""
        if self.backend.checkpoint_owner != "fsdp":
            return super()._save_optimizer_and_scheduler(output_dir)
        from accelerate.utils import save_fsdp_optimizer
        from transformers.trainer import SCHEDULER_NAME

        save_fsdp_optimizer(
            self.accelerator.state.fsdp_plugin, self.accelerator, self.optimizer, self.model, output_dir
        )
        if self.args.should_save:
            torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_NAME))

    def _load_best_model(self) -> None:
        # load_best_model_at_end: the Trainer's version looks for a full model file; restore the LoRA adapters.
        load_best_checkpoint(self)

    def _get_output_dir(self, trial) -> str:
        # While a checkpoint is being written, the Trainer writes under the staging folder (see _save_checkpoint).
        return self._checkpoint_staging_root or super()._get_output_dir(trial)

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model=None) -> None:
        load_training_state(self, resume_from_checkpoint)

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        # The restored optimizer / scheduler states carry the old learning rate: apply an allowed new one.
        super()._load_optimizer_and_scheduler(checkpoint)
        if checkpoint is not None:
            if (
                self.backend.checkpoint_owner == "deepspeed"
            ):  # the engine has restored the trained adapter and the optimizer: the rest
                load_training_state(self, checkpoint, engine_restored=True)
            apply_changed_hyperparameters(self, checkpoint)

    def init_hf_repo(self, token: str | None = None, private: bool | None = None) -> None:
        init_repo(self, token=token, private=private)

    def push_to_hub(
        self,
        commit_message: str | None = "End of training",
        blocking: bool = True,
        token: str | None = None,
        revision: str | None = None,
        private: bool | None = None,
        **kwargs,
    ):
        """Save the LoRA to ``output_dir`` (``ema=True``: the parameter EMA), render ``num_samples`` sample images
        (or ``sample_prompts``), write the model card and upload ``output_dir`` without checkpoints."""
        return push_trainer(self, commit_message, blocking, token, revision, private, **kwargs)

    def _push_from_checkpoint(self, checkpoint_folder: str) -> None:
        if self._checkpoint_staging_root is None:  # pushed once the checkpoint is renamed
            push_checkpoint(self, checkpoint_folder)
