"""The `marble-trl train` command on the tiny recipe, and the LoRA it writes loading in plain diffusers."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from PIL import Image

from marble_trl.cli import main
from marble_trl.models import build_tiny_sd3_pipeline

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "recipes" / "tiny-cpu.yaml"


def test_train_command_runs_the_recipe(tmp_path):
    out = tmp_path / "run"
    code = main(
        [
            "train",
            "--config",
            str(RECIPE),
            "--output_dir",
            str(out),
            "--max_steps",
            "3",
            "--disable_tqdm",
            "true",
            "--marble_refresh_interval",
            "2",
        ]
    )
    assert code == 0
    assert (out / "pytorch_lora_weights.safetensors").is_file()
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "rewards/brightness/mean" in r]
    assert [r["step"] for r in steps] == [1, 2, 3]
    assert all("rewards/jpeg_compressibility/mean" in r and "loss" in r for r in steps)
    assert sum("marble/worst_cos" in r for r in steps) == 2  # refreshes at steps 0 and 2
    grid = Image.open(out / "samples_before_after.png")
    assert grid.width > 0 and grid.height > grid.width // 4
    summary = json.loads((out / "run_summary.json").read_text())
    assert summary["global_step"] == 3


def test_cli_overrides_yaml_and_rejects_unknown(tmp_path, capsys):
    from trl import TrlParser

    from marble_trl.cli import MarbleScriptArguments
    from marble_trl.nft_config import MarbleDiffusionNFTConfig

    parser = TrlParser((MarbleScriptArguments, MarbleDiffusionNFTConfig))
    script, cfg = parser.parse_args_and_config(
        [
            "--config",
            str(RECIPE),
            "--output_dir",
            str(tmp_path),
            "--learning_rate",
            "0.5",
            "--reward_funcs",
            "contrast",
        ]
    )
    assert cfg.learning_rate == 0.5 and script.reward_funcs == ["contrast"]
    assert cfg.num_generations == 8 and cfg.gradient_accumulation_steps == 2  # derived from prompts_per_step
    bad = tmp_path / "bad.yaml"
    bad.write_text(RECIPE.read_text() + "\nnot_a_field: 1\n")
    try:
        parser.parse_args_and_config(["--config", str(bad)])
    except ValueError as err:
        assert "not_a_field" in str(err)
    else:
        raise AssertionError("an unknown YAML key was accepted")


def test_saved_lora_loads_in_plain_diffusers(tmp_path):
    from marble_trl import MarbleDiffusionNFTConfig, MarbleDiffusionNFTTrainer
    from marble_trl.data import load_prompt_dataset

    args = MarbleDiffusionNFTConfig(
        output_dir=str(tmp_path),
        report_to="none",
        save_strategy="no",
        disable_tqdm=True,
        max_steps=2,
        learning_rate=3e-2,
        per_device_train_batch_size=4,
        num_generations=4,
        prompts_per_step=2,
        resolution=32,
        num_sample_steps=3,
        sample_scheduler="euler",
        max_sequence_length=8,
        lora_r=4,
        lora_alpha=8,
        use_cpu=True,
        beta=0.0,
    )
    trainer = MarbleDiffusionNFTTrainer("tiny", "brightness", args=args, train_dataset=load_prompt_dataset())
    trainer.train()
    trainer.save_model(str(tmp_path / "lora"))
    prompts = ["a red apple on a table", "a boat on a calm lake"]
    ours = trainer.generate(prompts, seed=3)
    base = trainer.generate(prompts, seed=3, use_lora=False)

    fresh = build_tiny_sd3_pipeline(seed=0)
    fresh.load_lora_weights(str(tmp_path / "lora"))
    fresh.set_progress_bar_config(disable=True)
    from marble_trl.rollout import make_scheduler

    fresh.scheduler = make_scheduler("euler", fresh.scheduler)
    theirs = fresh(
        prompts,
        num_inference_steps=3,
        guidance_scale=1.0,
        height=32,
        width=32,
        max_sequence_length=8,
        output_type="pt",
        generator=torch.Generator().manual_seed(3),
    ).images
    assert (ours - base).abs().max() > 1e-3, "the LoRA changed nothing; the comparison would be vacuous"
    torch.testing.assert_close(theirs, ours, atol=1e-4, rtol=1e-4)


def test_ci_script_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    command = next(line.strip() for line in readme.splitlines() if "pytest" in line and "pip install" in line)
    assert command in ci
