"""Best-checkpoint selection and the reward-hacking guard (marble_trl.persistence.best): load_best_model_at_end restores the LoRA of
the best evaluation, EarlyStoppingCallback stops on this trainer's evaluation metrics, the hacking signal is logged and
stops training with hacking_patience; eval_composite's definition."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from datasets import Dataset
from safetensors.torch import load_file
from tiny import brightness
from transformers import EarlyStoppingCallback

from marble_trl import MarbleDiffusionNFTConfig, MarbleDiffusionNFTTrainer
from marble_trl.artifacts import LORA_FILE, lora_key
from marble_trl.persistence.best import composite
from marble_trl.policy.lora import TRAIN_ADAPTER, lora_parameters

TRAIN = Dataset.from_dict({"prompt": ["a red apple", "a blue car", "a green frog", "a white cat"]})
EVAL = Dataset.from_dict({"prompt": ["a boat", "a tree"]})


def scripted(name: str, values: list[float]):
    """A held-out reward whose k-th call scores every image values[k] (one call per evaluation: one eval batch)."""
    calls = []

    def reward(prompts, images, **_):
        calls.append(1)
        return [values[min(len(calls), len(values)) - 1]] * len(prompts)

    reward.__name__ = name
    return reward


def rising(prompts, images, **_):
    """A training reward that rises every step (the k-th call scores k, plus a spread for the advantages)."""
    rising.calls += 1
    return [rising.calls + 0.01 * i for i in range(len(prompts))]


def args_for(output_dir, **overrides) -> MarbleDiffusionNFTConfig:
    kwargs = dict(
        output_dir=str(output_dir), report_to="none", disable_tqdm=True, logging_steps=1, max_steps=3,
        learning_rate=3e-2, per_device_train_batch_size=4, num_generations=2, prompts_per_step=2, resolution=16,
        num_sample_steps=2, sample_scheduler="euler", max_sequence_length=8, lora_r=2, lora_alpha=4, use_cpu=True,
        seed=0, eval_num_sample_steps=2, per_device_eval_batch_size=8, eval_grid_prompts=0, eval_strategy="steps",
        eval_steps=1, save_strategy="no",
    )  # fmt: skip
    kwargs.update(overrides)
    return MarbleDiffusionNFTConfig(**kwargs)


def lora_state(trainer) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in lora_parameters(trainer.transformer, TRAIN_ADAPTER).items()}


def lora_file(folder: Path, trainer) -> dict[str, torch.Tensor]:
    state = load_file(str(folder / LORA_FILE))
    return {n: state[lora_key(n, TRAIN_ADAPTER)] for n in lora_parameters(trainer.transformer, TRAIN_ADAPTER)}


@pytest.mark.slow
def test_load_best_model_at_end_restores_the_lora_of_the_best_evaluation(tmp_path):
    args = args_for(
        tmp_path, save_strategy="steps", save_steps=1, load_best_model_at_end=True,
        metric_for_best_model="rewards/held/mean",  # transformers prefixes "eval_"
    )  # fmt: skip
    held = scripted("held", [0.1, 0.9, 0.3])  # best at the 2nd evaluation (step 2)
    trainer = MarbleDiffusionNFTTrainer(
        "tiny", brightness, args=args, train_dataset=TRAIN, eval_dataset=EVAL, eval_reward_funcs=[held]
    )
    trainer.train()
    best = tmp_path / "checkpoint-2"
    assert trainer.state.best_model_checkpoint == str(best)  # the real folder, not the atomic save's staging one
    assert trainer.state.best_metric == pytest.approx(0.9)
    final, restored = lora_file(tmp_path / "checkpoint-3", trainer), lora_state(trainer)
    expected = lora_file(best, trainer)
    assert any(not torch.equal(final[n], expected[n]) for n in expected)  # step 3 moved the LoRA
    for name, value in expected.items():
        assert torch.equal(restored[name], value), name


@pytest.mark.slow
def test_load_best_model_at_end_defaults_to_eval_composite_and_keeps_the_best_with_save_total_limit(tmp_path):
    args = args_for(tmp_path, save_strategy="steps", save_steps=1, load_best_model_at_end=True, save_total_limit=1)
    assert args.metric_for_best_model == "eval_composite" and args.greater_is_better
    held = scripted("held", [0.5, 0.9, 0.1])
    trainer = MarbleDiffusionNFTTrainer(
        "tiny", brightness, args=args, train_dataset=TRAIN, eval_dataset=EVAL, eval_reward_funcs=[held]
    )
    trainer.train()
    assert trainer.state.best_model_checkpoint == str(tmp_path / "checkpoint-2")
    assert (tmp_path / "checkpoint-2" / LORA_FILE).is_file()  # rotation kept the best checkpoint
    assert not (tmp_path / "checkpoint-1").exists()
    composites = [e["eval_composite"] for e in trainer.state.log_history if "eval_composite" in e]
    assert composites[0] == 0.0 and composites[1] > 0 > composites[2]


@pytest.mark.slow
def test_early_stopping_callback_stops_on_an_eval_reward(tmp_path):
    args = args_for(
        tmp_path, max_steps=6, save_strategy="steps", save_steps=1, load_best_model_at_end=True,
        metric_for_best_model="eval_rewards/held/mean",
    )  # fmt: skip
    held = scripted("held", [0.9, 0.5, 0.3, 0.2, 0.1, 0.0])
    trainer = MarbleDiffusionNFTTrainer(
        "tiny", brightness, args=args, train_dataset=TRAIN, eval_dataset=EVAL, eval_reward_funcs=[held],
        callbacks=[EarlyStoppingCallback(early_stopping_patience=1)],
    )  # fmt: skip
    trainer.train()
    assert trainer.state.global_step == 2
    assert trainer.state.best_model_checkpoint == str(tmp_path / "checkpoint-1")


@pytest.mark.slow
def test_hacking_signal_is_logged_and_stops_training(tmp_path):
    rising.calls = 0
    args = args_for(tmp_path, max_steps=5, hacking_patience=1)
    held = scripted("held", [0.5, 0.4, 0.3, 0.2, 0.1])  # held-out score falls while the training reward rises
    trainer = MarbleDiffusionNFTTrainer(
        "tiny", rising, args=args, train_dataset=TRAIN, eval_dataset=EVAL, eval_reward_funcs=[held]
    )
    trainer.train()
    evals = [e for e in trainer.state.log_history if "eval_composite" in e]
    assert "eval_hacking" not in evals[0]  # the first evaluation has nothing to compare with
    assert evals[1]["eval_hacking"] == 1.0 and evals[1]["eval_hacking/rising"] == 1.0
    assert evals[1]["eval_hacking/rising/train_delta"] == pytest.approx(1.0)
    assert evals[1]["eval_hacking/rising/eval_delta"] < 0  # "rising" is not an eval reward: eval_composite's change
    assert trainer.state.global_step == 2  # hacking_patience=1 stopped at the first flag


@pytest.mark.slow
def test_hacking_logged_without_stopping_when_patience_is_0(tmp_path):
    args = args_for(tmp_path, max_steps=3)
    held = scripted("brightness", [0.9, 0.8, 0.7])  # the training reward's own held-out score, falling
    trainer = MarbleDiffusionNFTTrainer(
        "tiny", brightness, args=args, train_dataset=TRAIN, eval_dataset=EVAL, eval_reward_funcs=[held]
    )
    trainer.train()
    assert trainer.state.global_step == 3
    evals = [e for e in trainer.state.log_history if "eval_composite" in e]
    for e in evals[1:]:
        assert e["eval_hacking/brightness/eval_delta"] == pytest.approx(-0.1)
        assert e["eval_hacking/brightness"] == float(e["eval_hacking/brightness/train_delta"] > 0)


def test_composite_is_the_mean_effect_size_since_the_first_evaluation():
    first = {
        "eval_rewards/a/mean": 1.0,
        "eval_rewards/a/std": 0.5,
        "eval_rewards/b/mean": -2.0,
        "eval_rewards/b/std": 0,
    }
    now = {"eval_rewards/a/mean": 2.0, "eval_rewards/b/mean": -3.0}
    assert composite(["a", "b"], first, None, "eval") == 0.0
    assert composite(["a", "b"], now, first, "eval") == pytest.approx(((2 - 1) / 0.5 + (-3 + 2) / 1) / 2)
    assert composite(["a"], {"eval_rewards/a/mean": 1.0 + 1e-7}, first, "eval") == 0.0  # float noise rounds away
    assert composite(["c"], now, first, "eval") is None
    assert composite(["a", "b"], {"eval_rewards/a/mean": math.nan}, first, "eval") is None
