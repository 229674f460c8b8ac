"""A readable console: GRPO's logging_steps, rewards first in every log, no warning of the package's own at config
time, DDP without find_unused_parameters, torch_num_threads, and the per-reward summary at the end of
`marble-trl train`."""

from __future__ import annotations

import re
import warnings
from pathlib import Path

import pytest
import torch
from datasets import Dataset
from transformers import TrainerCallback

from marble_trl import MarbleDiffusionNFTConfig, MarbleDiffusionNFTTrainer
from marble_trl.cli import main
from marble_trl.trainer.console import order_logs, reward_summary_lines

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "recipes" / "tiny-random.yaml"
TRAIN = Dataset.from_dict({"prompt": ["a red apple", "a blue car"]})


def brightness(prompts, images, **_):
    return images.float().mean(dim=(1, 2, 3)).tolist()


def contrast(prompts, images, **_):
    return images.float().std(dim=(1, 2, 3)).tolist()


def test_order_logs_puts_loss_reward_and_reward_means_first_and_timings_last():
    logs = {
        "loss": 1.0, "grad_norm": 0.1, "learning_rate": 0.01, "rewards/a/time": 0.2, "rewards/a/mean": 0.5,
        "rewards/a/std": 0.1, "rewards/b/mean": 0.3, "reward": 0.8, "time/rollout": 3.0, "kl": 0.0, "reward_std": 0.1,
    }  # fmt: skip
    same = order_logs(logs)
    assert same is logs
    assert list(logs) == [
        "loss", "reward", "reward_std", "rewards/a/mean", "rewards/b/mean", "grad_norm", "learning_rate",
        "rewards/a/std", "kl", "rewards/a/time", "time/rollout",
    ]  # fmt: skip
    evals = order_logs({"eval_samples": 4.0, "eval_rewards/a/std": 0.1, "eval_runtime": 1.0, "eval_composite": 0.2,
                        "eval_rewards/a/mean": 0.5})  # fmt: skip
    assert list(evals) == [
        "eval_composite",
        "eval_rewards/a/mean",
        "eval_samples",
        "eval_rewards/a/std",
        "eval_runtime",
    ]


def test_reward_summary_lines_first_and_last_logged_mean():
    history = [
        {"loss": 1.0, "rewards/a/mean": 0.5, "rewards/b/mean": float("nan"), "step": 10},
        {"eval_rewards/a/mean": 0.4, "step": 10},
        {"loss": 1.0, "rewards/a/mean": 0.75, "rewards/b/mean": -1.0, "step": 20},
        {"loss": 1.0, "rewards/a/mean": 0.7, "rewards/b/mean": -0.5, "step": 30},
        {"eval_rewards/a/mean": 0.45, "step": 30},
    ]
    assert reward_summary_lines(history) == [
        "[marble-trl] rewards/a/mean: 0.5 (step 10) -> 0.7 (step 30), +0.2",
        "[marble-trl] rewards/b/mean: -1 (step 20) -> -0.5 (step 30), +0.5",
        "[marble-trl] eval_rewards/a/mean: 0.4 (step 10) -> 0.45 (step 30), +0.05",
    ]
    assert reward_summary_lines([{"loss": 1.0, "step": 1}]) == []


def test_config_defaults_are_grpo_like_and_raise_no_warning_of_their_own():
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the deprecated gradient_checkpointing alias warned on every config
        args = MarbleDiffusionNFTConfig(output_dir="unused", use_cpu=True, num_generations=8)
    assert args.logging_steps == 10  # TRL GRPO's
    assert args.activation_checkpointing is False and args.gradient_checkpointing is False
    assert args.ddp_find_unused_parameters is False
    assert args.torch_num_threads is None
    with pytest.warns(FutureWarning, match="gradient_checkpointing"):  # the user's own deprecated name still works
        old = MarbleDiffusionNFTConfig(
            output_dir="unused", use_cpu=True, num_generations=8, gradient_checkpointing=True
        )
    assert old.activation_checkpointing is True
    with pytest.raises(ValueError, match="torch_num_threads"):
        MarbleDiffusionNFTConfig(output_dir="unused", use_cpu=True, num_generations=8, torch_num_threads=0)


def test_training_logs_rewards_first_and_torch_num_threads_applies(tmp_path):
    args = MarbleDiffusionNFTConfig(
        output_dir=str(tmp_path), report_to="none", save_strategy="no", disable_tqdm=True, logging_steps=1,
        max_steps=1, per_device_train_batch_size=4, num_generations=2, prompts_per_step=2, resolution=16,
        num_sample_steps=2, sample_scheduler="euler", max_sequence_length=8, lora_r=2, lora_alpha=4, use_cpu=True,
        torch_num_threads=1,
    )  # fmt: skip
    trainer = MarbleDiffusionNFTTrainer("tiny", [contrast, brightness], args=args, train_dataset=TRAIN)
    before = torch.get_num_threads()
    seen = []
    trainer.add_callback(type("Threads", (TrainerCallback,), {"on_step_end": lambda *a, **k: seen.append(
        torch.get_num_threads())}))  # fmt: skip
    trainer.train()
    assert seen == [1] and torch.get_num_threads() == before  # set for train() only: nothing leaks to the process
    entry = next(e for e in trainer.state.log_history if "loss" in e)
    assert list(entry)[:5] == ["loss", "reward", "reward_std", "rewards/contrast/mean", "rewards/brightness/mean"]
    keys = list(entry)
    assert keys.index("rewards/contrast/time") > keys.index("nft/loss_pos")  # timings after the metrics


@pytest.mark.slow
def test_marble_trl_train_prints_one_summary_line_per_reward(tmp_path, capsys):
    out = tmp_path / "run"
    argv = ["train", "--config", str(RECIPE), "--output_dir", str(out), "--max_steps", "2", "--disable_tqdm", "true"]
    assert main([*argv, "--sample_grid_prompts", "0"]) == 0
    printed = capsys.readouterr().out
    for name in ("brightness", "jpeg_compressibility"):
        assert re.search(
            rf"^\[marble-trl\] rewards/{name}/mean: \S+ \(step 1\) -> \S+ \(step 2\), [+-]", printed, re.M
        )


def test_compact_line_shows_step_loss_rewards_alpha_bar_rate_and_eta():
    from marble_trl.trainer.console import compact_line

    logs = {
        "loss": 58.271, "reward": 1.1, "rewards/pickscore/mean": 0.41483, "rewards/ocr/mean": 0.6146,
        "grad_norm": 0.1, "marble/alpha_bar/pickscore": 0.4512, "marble/alpha_bar/ocr": 0.5488, "time/train": 1.2,
    }  # fmt: skip
    line = compact_line(logs, 10, 28, 1.6)
    assert (
        line
        == "step 10/28 | loss 58.27 | pickscore 0.4148, ocr 0.6146 | alpha_bar 0.45 0.55 | 1.6 s/step | ETA 0:00:29"
    )
    assert len(line) < 120  # one console line, not the 1,400-character dict
    evaluation = compact_line({"eval_rewards/a/mean": 0.5, "eval_composite": 0.12, "eval_runtime": 3.0}, 10, 28, None)
    assert evaluation == "eval at step 10 | composite 0.12 | a 0.5"
    assert compact_line({"train_runtime": 75.4, "train_loss": 4.97}, 28, 28, None) == (
        "step 28/28 | done in 0:01:15 | train_loss 4.97"
    )


def test_console_prints_compact_lines_and_trackers_keep_every_metric(tmp_path, capsys):
    args = MarbleDiffusionNFTConfig(
        output_dir=str(tmp_path), report_to="none", save_strategy="no", disable_tqdm=True, logging_steps=1,
        max_steps=2, per_device_train_batch_size=4, num_generations=2, prompts_per_step=2, resolution=16,
        num_sample_steps=2, sample_scheduler="euler", max_sequence_length=8, lora_r=2, lora_alpha=4, use_cpu=True,
    )  # fmt: skip
    trainer = MarbleDiffusionNFTTrainer("tiny", [contrast, brightness], args=args, train_dataset=TRAIN)
    trainer.train()
    printed = capsys.readouterr().out
    lines = [ln for ln in printed.splitlines() if ln.startswith("step ")]
    assert re.match(
        r"^step 1/2 \| loss \S+ \| contrast \S+, brightness \S+ \| alpha_bar \S+ \S+ \| \S+ s/step", lines[0]
    )
    assert "ETA" in lines[0] and "done in" in lines[-1]
    assert "'grad_norm'" not in printed  # no dict
    entry = next(e for e in trainer.state.log_history if "loss" in e)
    assert "grad_norm" in entry and "nft/loss_pos" in entry  # the full dict for trackers and metrics.jsonl
    args.console_format = "full"
    full = MarbleDiffusionNFTTrainer("tiny", [contrast, brightness], args=args, train_dataset=TRAIN)
    full.train()
    assert "'grad_norm'" in capsys.readouterr().out
