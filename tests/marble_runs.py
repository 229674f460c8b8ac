"""Shared pieces of the checkpoint / export / Hub tests: a small fast config, three rewards, one reference run.

The reference run (session fixture ``reference_run`` in conftest.py) is an uninterrupted 6-step MARBLE run with three
rewards, refresh interval 2, the parameter EMA and checkpoints at steps 3 and 6. The resume test compares against it;
the export and Hub tests publish its checkpoints.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from datasets import Dataset
from tiny import brightness, contrast, redness, small_args  # noqa: F401  (re-exported for the tests)

from marble_trl import MarbleDiffusionNFTTrainer
from marble_trl.policy.lora import OLD_ADAPTER, TRAIN_ADAPTER, lora_parameters

PROMPTS = ["a red apple", "a blue car", "a green frog", "a white cat"]  # 2 prompts per step: 2 steps per epoch
STEPS = 6
SAMPLE_PROMPTS = ["a red apple on a table", "a boat on a calm lake"]


REWARDS = [brightness, contrast, redness]


def recording(rewards, log: list):
    """The same rewards (same names); the first also appends each call's prompts to ``log`` (one entry per step)."""

    def first(prompts, images, **kwargs):
        log.append(list(prompts))
        return rewards[0](prompts, images, **kwargs)

    first.__name__ = rewards[0].__name__
    return [first, *rewards[1:]]


def make_trainer(output_dir, rewards=None, callbacks=None, peft_config=None, **overrides) -> MarbleDiffusionNFTTrainer:
    return MarbleDiffusionNFTTrainer(
        "tiny",
        list(rewards or REWARDS),
        args=small_args(output_dir, **overrides),
        train_dataset=Dataset.from_dict({"prompt": PROMPTS}),
        callbacks=callbacks,
        peft_config=peft_config,
    )


@dataclass
class ReferenceRun:
    """What the tests compare with: plain snapshots (the trainer itself is not kept: other tests reset accelerate's
    global state, which a kept trainer would depend on)."""

    output_dir: Path
    prompts: list  # the prompts scored at each step
    lora: dict  # trained adapter, by parameter name
    old_policy: dict
    ema: dict
    balancer: dict
    log_history: list
    images: torch.Tensor  # trainer.generate(SAMPLE_PROMPTS, seed=3) after step 6
    images_ema: torch.Tensor  # the same with the EMA swapped in

    def checkpoint(self, step: int) -> Path:
        return self.output_dir / f"checkpoint-{step}"

    def logged(self, key: str) -> list:
        return [h[key] for h in self.log_history if key in h]


def run_reference(output_dir: Path) -> ReferenceRun:
    prompts: list = []
    trainer = make_trainer(output_dir, rewards=recording(REWARDS, prompts), save_strategy="steps", save_steps=3)
    trainer.train()
    with trainer.param_ema.swapped_in(trainer.transformer):
        images_ema = trainer.generate(SAMPLE_PROMPTS, seed=3)
    return ReferenceRun(
        output_dir=output_dir,
        prompts=prompts,
        lora=snapshot(trainer, TRAIN_ADAPTER),
        old_policy=snapshot(trainer, OLD_ADAPTER),
        ema={n: t.clone() for n, t in trainer.param_ema.state_dict().items()},
        balancer=trainer.balancer.state_dict(),
        log_history=list(trainer.state.log_history),
        images=trainer.generate(SAMPLE_PROMPTS, seed=3),
        images_ema=images_ema,
    )


def snapshot(trainer, adapter: str) -> dict:
    return {n: p.detach().cpu().clone() for n, p in lora_parameters(trainer.transformer, adapter).items()}


def restored_trainer(run: ReferenceRun, output_dir, step: int = STEPS, **overrides) -> MarbleDiffusionNFTTrainer:
    """A fresh trainer holding the reference run's state after ``step`` (its checkpoint, as a resume loads it)."""
    from transformers import TrainerState

    from marble_trl.trainer.checkpointing import load_training_state

    trainer = make_trainer(output_dir, **overrides)
    load_training_state(trainer, run.checkpoint(step))
    trainer.state = TrainerState.load_from_json(str(run.checkpoint(step) / "trainer_state.json"))
    return trainer
