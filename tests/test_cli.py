"""The `marble-trl train` command on the tiny recipe, its help, exporting its output folder, and the LoRA it writes
loading in plain diffusers."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from PIL import Image

from marble_trl.cli import main
from marble_trl.models import build_tiny_sd3_pipeline

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "recipes" / "tiny-random.yaml"


@pytest.fixture(scope="module")
def recipe_run(tmp_path_factory) -> Path:
    """`marble-trl train` on the tiny recipe (3 steps, save_strategy "no": no checkpoint), as the quickstart runs it."""
    out = tmp_path_factory.mktemp("recipe") / "run"
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
    return out


def test_train_command_runs_the_recipe(recipe_run):
    out = recipe_run
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


def test_train_help_lists_the_wrapper_flags(capsys):
    with pytest.raises(SystemExit) as done:
        main(["train", "--help"])
    assert done.value.code == 0
    text = capsys.readouterr().out
    own = text.split("marble-trl train (the command's own flags):")[1].split("\noptions:")[0]
    for flag in ("--config YAML", "--accelerate_config FILE", "--num_processes N"):
        assert flag in own, flag
    assert text.index("own flags):") < text.index("\noptions:")  # above the ~200 fields
    batch = " ".join(text.split("--per-device-train-batch-size PER_DEVICE_TRAIN_BATCH_SIZE")[1].split())
    assert batch.startswith("Images (not prompts) per micro-batch on each process"), batch[:120]
    assert "batch size per device" not in batch.split("(default: 8)")[0]


def test_export_from_the_final_output_dir(recipe_run, tmp_path, capsys):
    """The quickstart's output folder (no checkpoint) exports; the base model is recorded as `tiny` with its seed, so
    the sample images render without --model."""
    from marble_trl.publish.export import generate_images

    recorded = json.loads((recipe_run / "marble_trl.json").read_text())
    assert recorded["base_model"] == "tiny" and recorded["tiny_seed"] == 0  # the CLI passes a pipeline object
    assert recorded["global_step"] == 3 and recorded["aggregation"] in ("marble", "auto")
    out = tmp_path / "export"
    prompts = ["a red apple on a table", "a boat on a calm lake"]
    assert main(["export", "--checkpoint", str(recipe_run), "--output", str(out), "--sample_prompts", *prompts]) == 0
    assert sorted(p.name for p in out.iterdir()) == [
        "README.md",
        "marble_trl.json",
        "pytorch_lora_weights.safetensors",
        "samples",
    ]
    assert not [p for p in tmp_path.iterdir() if p.name != "export"]  # no staging folder left
    config = json.loads((out / "marble_trl.json").read_text())
    assert config["base_model"] == "tiny" and config["tiny_seed"] == 0 and config["global_step"] == 3
    assert config["sampling"]["resolution"] == 32
    card = (out / "README.md").read_text()
    assert "A LoRA for `tiny`" in card and "unknown" not in card
    assert "| `learning_rate` | 0.01 |" in card and "| optimizer steps | 3 |" in card
    assert "| brightness | 1 |" in card  # the reward table from metrics.jsonl
    assert sorted(p.name for p in (out / "samples").iterdir()) == ["000.png", "001.png"]
    # the exported LoRA is the run's LoRA: same images as from the output folder itself
    torch.testing.assert_close(
        generate_images("tiny", prompts, out, seed=1), generate_images("tiny", prompts, recipe_run, seed=1)
    )


def test_export_failure_leaves_no_partial_folder(recipe_run, tmp_path, monkeypatch):
    import marble_trl.publish.export as export

    def broken(*args, **kwargs):
        raise RuntimeError("rendering failed")

    monkeypatch.setattr(export, "generate_images", broken)
    out = tmp_path / "export"
    with pytest.raises(RuntimeError, match="rendering failed"):
        main(["export", "--checkpoint", str(recipe_run), "--output", str(out), "--sample_prompts", "a cat"])
    assert list(tmp_path.iterdir()) == []  # neither --output nor the staging folder

    # replacing a previous export: on failure the previous one stays as it was
    monkeypatch.undo()
    assert main(["export", "--checkpoint", str(recipe_run), "--output", str(out)]) == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    monkeypatch.setattr(export, "generate_images", broken)
    with pytest.raises(RuntimeError, match="rendering failed"):
        main(["export", "--checkpoint", str(recipe_run), "--output", str(out), "--overwrite", "--sample_prompts", "a"])
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert [p.name for p in tmp_path.iterdir()] == ["export"]


def test_export_refusals(recipe_run, tmp_path):
    with pytest.raises(ValueError, match="parameter EMA is saved in checkpoints"):
        main(["export", "--checkpoint", str(recipe_run), "--output", str(tmp_path / "ema"), "--ema"])
    other = tmp_path / "notes"
    other.mkdir()
    (other / "todo.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="not empty"):
        main(["export", "--checkpoint", str(recipe_run), "--output", str(other)])
    with pytest.raises(FileExistsError, match="replaces only a previous export"):
        main(["export", "--checkpoint", str(recipe_run), "--output", str(other), "--overwrite"])
    assert (other / "todo.txt").read_text() == "mine"
    with pytest.raises(ValueError, match="holds the folder being exported"):
        main(["export", "--checkpoint", str(recipe_run), "--output", str(recipe_run.parent), "--overwrite"])
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


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
    from marble_trl.data.prompts import load_prompt_dataset

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
    from marble_trl.rollout.solvers import make_scheduler

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


MAIN_JOB = ROOT / "recipes" / "tiny-cpu.yaml"


def test_main_job_recipe_evaluates_before_and_after(tmp_path, capsys):
    """The README's main job (shortened): MARBLE on the shipped `shapes` model with three ShapesBench rewards, and
    the held-out evaluation before and after training written into run_summary.json and printed as a table."""
    out = tmp_path / "main"
    code = main(
        [
            "train",
            "--config",
            str(MAIN_JOB),
            "--output_dir",
            str(out),
            "--max_steps",
            "2",
            "--eval_num_images_per_prompt",
            "1",
            "--sample_grid_prompts",
            "2",
            "--disable_tqdm",
            "true",
        ]
    )
    assert code == 0
    summary = json.loads((out / "run_summary.json").read_text())
    names = ["shapes_preference", "shapes_alignment", "shapes_count", "shapes_judge", "shapes_fidelity"]
    assert list(summary["eval_before"]) == names and list(summary["eval_after"]) == names
    assert all(0.0 <= v <= 1.0 for v in [*summary["eval_before"].values(), *summary["eval_after"].values()])
    printed = capsys.readouterr().out
    assert "held-out eval reward" in printed and "shapes_judge" in printed and "(held out)" in printed
    assert json.loads((out / "marble_trl.json").read_text())["base_model"] == "shapes"
    assert (out / "samples_before_after.png").is_file()


def test_grid_prompts_take_each_source_in_turn():
    from datasets import Dataset

    from marble_trl.commands.train import grid_prompt_list

    rows = {"prompt": ["a", "b", "a", "c", "x", "y", "b", "z"], "source": ["s1"] * 4 + ["s2"] * 3 + ["s3"]}
    mixture = Dataset.from_dict(rows)
    assert grid_prompt_list(mixture, 4) == ["a", "x", "z", "b"]
    assert grid_prompt_list(mixture, 10) == ["a", "x", "z", "b", "y", "c"]  # "b" of s2 is s1's: drawn once
    assert grid_prompt_list(Dataset.from_dict({"prompt": ["a", "b", "a", "c"]}), 2) == ["a", "b"]
    assert grid_prompt_list(mixture, 0) == []


def test_eval_before_after_needs_eval_prompts(tmp_path):
    with pytest.raises(ValueError, match="eval_before_after needs held-out prompts: set eval_dataset_name"):
        main(["train", "--output_dir", str(tmp_path), "--reward_funcs", "brightness", "--eval_before_after", "true"])


def test_the_cli_and_the_package_import_no_model_code_until_asked():
    """`import marble_trl.cli` (the launcher wrapper, --help) loads neither torch, diffusers nor TRL; the public names
    and the subpackages load on first use."""
    code = (
        "import sys, marble_trl, marble_trl.cli\n"
        "assert not {'torch', 'diffusers', 'trl'} & set(sys.modules), sorted({'torch', 'diffusers', 'trl'} & set(sys.modules))\n"
        "assert callable(marble_trl.rewards.register_reward) and marble_trl.MarbleDiffusionNFTConfig.__name__\n"
        "assert marble_trl.cli.MarbleScriptArguments.__name__ == 'MarbleScriptArguments'\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
