"""Export (diffusers / PEFT, raw / EMA), `marble-trl generate`, the model card, and pushes to a local Hub stand-in.

The Hub is unreachable here: `hub_stub.StubHub` serves the HTTP endpoints huggingface_hub 2.4's `create_repo` and
`upload_folder` call (create, validate-yaml, preupload, git-lfs batch + PUT, NDJSON commit) on 127.0.0.1.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hub_stub import StubHub
from huggingface_hub import ModelCard
from marble_runs import SAMPLE_PROMPTS, make_trainer, restored_trainer
from PIL import Image

from marble_trl.cli import main
from marble_trl.models import build_tiny_sd3_pipeline
from marble_trl.publish.card import CARD_TAGS, render_model_card
from marble_trl.publish.export import generate_images
from marble_trl.publish.run_info import card_info_from_checkpoint
from marble_trl.rewards.images import from_pil
from marble_trl.rollout.solvers import make_scheduler

pytestmark = pytest.mark.filterwarnings("ignore:Already found a `peft_config`:UserWarning")
ROOT = Path(__file__).resolve().parents[1]
PNG_TOLERANCE = 1 / 255 + 1e-4  # uint8 rounding of PNGs


@pytest.fixture
def stub_hub(monkeypatch):
    """The stand-in Hub, with huggingface_hub pointed at it (what HF_ENDPOINT does at import time)."""
    from huggingface_hub import constants

    with StubHub() as hub:
        for name in ("NO_PROXY", "no_proxy"):  # never route 127.0.0.1 through a proxy
            monkeypatch.setenv(name, "127.0.0.1,localhost")
        monkeypatch.setattr(constants, "ENDPOINT", hub.url)
        monkeypatch.setattr(constants, "HF_HUB_DISABLE_XET", True)
        monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
        yield hub


def _export(checkpoint: Path, output: Path, *extra: str) -> Path:
    assert main(["export", "--checkpoint", str(checkpoint), "--output", str(output), *extra]) == 0
    return output


def test_exported_lora_reproduces_the_trainer_raw_and_ema(reference_run, tmp_path):
    """diffusers' own load_lora_weights on a fresh tiny pipeline gives the trainer's images (raw and EMA weights)."""
    raw = _export(reference_run.checkpoint(6), tmp_path / "raw")
    ema = _export(reference_run.checkpoint(6), tmp_path / "ema", "--ema")
    assert (raw / "pytorch_lora_weights.safetensors").is_file() and (raw / "README.md").is_file()
    assert json.loads((raw / "marble_trl.json").read_text())["sampling"]["resolution"] == 16

    ours = reference_run.images  # the trainer's own images after step 6 (the state of checkpoint-6)
    base = generate_images(
        "tiny", SAMPLE_PROMPTS, None, seed=3, num_inference_steps=2, resolution=16, scheduler="euler"
    )
    assert (ours - base).abs().max() > 1e-3, "vacuous: the LoRA changes nothing"
    images_dir = tmp_path / "images"
    code = main(
        ["generate", "--model", "tiny", "--lora", str(raw), "--prompts", *SAMPLE_PROMPTS]
        + ["--output", str(images_dir), "--seed", "3"]
    )
    assert code == 0
    pngs = sorted(images_dir.glob("*.png"))
    assert [p.name for p in pngs] == ["000-a-red-apple-on-a-table.png", "001-a-boat-on-a-calm-lake.png"]
    assert (from_pil([Image.open(p) for p in pngs]) - ours).abs().max() <= PNG_TOLERANCE
    torch.testing.assert_close(generate_images("tiny", SAMPLE_PROMPTS, raw, seed=3), ours, atol=1e-4, rtol=1e-4)

    ours_ema = reference_run.images_ema
    assert (ours_ema - ours).abs().max() > 1e-4, "vacuous: the EMA equals the raw weights"
    torch.testing.assert_close(generate_images("tiny", SAMPLE_PROMPTS, ema, seed=3), ours_ema, atol=1e-4, rtol=1e-4)

    # A checkpoint folder loads as it is: load_lora_weights picks pytorch_lora_weights.safetensors, or the EMA file.
    ckpt = reference_run.checkpoint(6)
    torch.testing.assert_close(generate_images("tiny", SAMPLE_PROMPTS, ckpt, seed=3), ours, atol=1e-4, rtol=1e-4)
    from_ema_file = generate_images("tiny", SAMPLE_PROMPTS, ckpt, seed=3, weight_name="param_ema.safetensors")
    torch.testing.assert_close(from_ema_file, ours_ema, atol=1e-4, rtol=1e-4)


def test_peft_format_export_loads_with_peft(reference_run, tmp_path):
    from peft import PeftModel

    out = _export(reference_run.checkpoint(6), tmp_path / "peft", "--format", "peft")
    assert sorted(p.name for p in out.iterdir()) == [
        "README.md",
        "adapter_config.json",
        "adapter_model.safetensors",
        "marble_trl.json",
    ]
    assert json.loads((out / "adapter_config.json").read_text())["lora_alpha"] == 8
    pipe = build_tiny_sd3_pipeline(seed=0)
    PeftModel.from_pretrained(pipe.transformer, str(out))  # injects the LoRA into pipe.transformer in place
    pipe.set_progress_bar_config(disable=True)
    pipe.scheduler = make_scheduler("euler", pipe.scheduler)
    images = pipe(
        SAMPLE_PROMPTS,
        num_inference_steps=2,
        guidance_scale=1.0,
        height=16,
        width=16,
        max_sequence_length=8,
        output_type="pt",
        generator=torch.Generator().manual_seed(3),
    ).images
    torch.testing.assert_close(images, reference_run.images, atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="PEFT-format"):
        generate_images("tiny", SAMPLE_PROMPTS, out)
    _run_card_snippet(out)


def _run_card_snippet(folder: Path) -> dict:
    """Run the card's usage snippet against ``folder`` (the tiny model's snippet runs offline)."""
    text = (folder / "README.md").read_text()
    snippet = re.search(r"```python\n(.*?)```", text, re.S).group(1).replace("path/to/this/folder", str(folder))
    scope: dict = {}
    exec(snippet, scope)
    assert scope["image"].size == (16, 16)
    return scope


def _row(text: str, first_cell: str, nth: int = 0) -> list[str]:
    """The cells of the ``nth`` table row of the card starting with ``first_cell``."""
    line = [ln for ln in text.splitlines() if ln.startswith(f"| {first_cell} |")][nth]
    return [c.strip() for c in line.strip("|").split("|")]


def test_model_card_renders_real_values(reference_run, tmp_path):
    out = _export(reference_run.checkpoint(6), tmp_path / "card", "--sample_prompts", *SAMPLE_PROMPTS)
    text = (out / "README.md").read_text()
    card = ModelCard(text)
    assert card.data.library_name == "diffusers" and card.data.pipeline_tag == "text-to-image"
    assert set(CARD_TAGS) <= set(card.data.tags) and {"diffusers", "lora", "text-to-image", "trl", "marble"} <= set(
        card.data.tags
    )
    assert card.data.get("base_model") is None  # the tiny model is no Hub id; the body names it
    assert (
        "A LoRA for `tiny`" in text
        and 'load_model("tiny", tiny_seed=0)' in text
        and "StableDiffusion3Pipeline" not in text
    )
    config = json.loads((out / "marble_trl.json").read_text())
    assert config["base_model"] == "tiny" and config["tiny_seed"] == 0  # what --sample_prompts rebuilt it from
    assert [p.name for p in tmp_path.iterdir()] == ["card"]  # the staging folder was renamed, nothing else left
    for entry in card.data.widget:  # sample images, rendered through load_lora_weights, shipped with the card
        assert (out / entry["output"]["url"]).is_file()
    assert [e["text"] for e in card.data.widget] == SAMPLE_PROMPTS

    for name in ("brightness", "contrast", "redness"):
        means = reference_run.logged(f"rewards/{name}/mean")
        assert len(means) == 6
        row = _row(text, name)
        assert row[1:4] == ["1", f"{means[0]:.4g}", f"{means[-1]:.4g}"] and row[5] == "6", row
    alpha_bar = reference_run.balancer["alpha_bar"]  # the run's final coefficients
    for k, name in enumerate(("brightness", "contrast", "redness")):
        assert _row(text, name, nth=1)[1:3] == [f"{1 / 3:.4g}", f"{alpha_bar[k]:.4g}"]  # the MARBLE table
    assert "refreshed 3 times (every 2 steps)" in text
    assert _row(text, "`learning_rate`")[1] == "0.02" and _row(text, "optimizer steps")[1] == "6"
    assert "## Samples" in text and "n/a" not in text.split("## Training configuration")[0]
    for needle in ("load_lora_weights", "arXiv 2605.06507", "arxiv.org/abs/2509.16117", "@article{marble2026"):
        assert needle in text

    _run_card_snippet(out)  # the usage snippet is real code

    hub_card = ModelCard(
        render_model_card(
            card_info_from_checkpoint(
                reference_run.checkpoint(6),
                base_model="stabilityai/stable-diffusion-3.5-medium",
                repo_id="me/sd35-marble",
                license="other",
            )
        )
    )
    assert hub_card.data.base_model == "stabilityai/stable-diffusion-3.5-medium" and hub_card.data.license == "other"
    assert 'from_pretrained("stabilityai/stable-diffusion-3.5-medium"' in hub_card.text
    assert 'pipe.load_lora_weights("me/sd35-marble")' in hub_card.text


def test_trainer_push_to_hub_end_to_end(reference_run, stub_hub, tmp_path):
    # The reference run's trainer after step 6, restored from its checkpoint into a fresh output_dir.
    trainer = restored_trainer(reference_run, tmp_path / "run", hub_model_id="marble-org/tiny-marble-lora")
    commit = trainer.push_to_hub(token=stub_hub.token, num_samples=2)
    assert commit.commit_url.startswith(f"{stub_hub.url}/marble-org/tiny-marble-lora/commit/")
    files = stub_hub.repos["marble-org/tiny-marble-lora"]
    out = Path(trainer.args.output_dir)
    assert {"README.md", "pytorch_lora_weights.safetensors", "marble_trl.json", "samples/000.png"} <= set(files)
    assert not [p for p in files if p.startswith(("checkpoint-", "tmp-")) or p == "training_args.bin"]
    assert files["pytorch_lora_weights.safetensors"] == (out / "pytorch_lora_weights.safetensors").read_bytes()
    assert any(method == "PUT" for method, _ in stub_hub.requests), "binaries should go through git-lfs"
    assert not stub_hub.unexpected
    card = ModelCard(files["README.md"].decode())
    assert card.data.library_name == "diffusers" and "marble" in card.data.tags
    assert 'pipe.load_lora_weights("marble-org/tiny-marble-lora")' in card.text

    # What was pushed reproduces the trainer.
    download = tmp_path / "download"
    for path, data in files.items():
        (download / path).parent.mkdir(parents=True, exist_ok=True)
        (download / path).write_bytes(data)
    pushed = generate_images("tiny", SAMPLE_PROMPTS, download, seed=3)
    torch.testing.assert_close(pushed, reference_run.images, atol=1e-4, rtol=1e-4)


@pytest.mark.slow
def test_export_cli_pushes_through_HF_ENDPOINT(reference_run, tmp_path):
    """`marble-trl export --push_to_hub` in a fresh process configured only by HF_ENDPOINT and HF_TOKEN."""
    with StubHub() as hub:
        env = {**os.environ, "HF_ENDPOINT": hub.url, "HF_TOKEN": hub.token, "HF_HUB_DISABLE_XET": "1"}
        env.update(NO_PROXY="127.0.0.1,localhost", no_proxy="127.0.0.1,localhost")
        env.pop("HF_HUB_OFFLINE", None)
        cmd = [sys.executable, "-m", "marble_trl.cli", "export", "--checkpoint", str(reference_run.checkpoint(3))]
        cmd += ["--output", str(tmp_path / "export"), "--ema", "--push_to_hub", "someone/marble-ema"]
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        assert "pushed to someone/marble-ema" in done.stdout
        files = hub.repos["someone/marble-ema"]
        assert sorted(files) == ["README.md", "marble_trl.json", "pytorch_lora_weights.safetensors"]
        assert json.loads(files["marble_trl.json"])["weights"] == "ema"
        assert "parameter EMA" in files["README.md"].decode()
        assert not hub.unexpected


def test_checkpoint_pushes_during_training(stub_hub, tmp_path):
    """push_to_hub=True with hub_strategy="checkpoint": each save uploads the LoRA, the card and last-checkpoint/."""
    trainer = make_trainer(
        tmp_path / "live",
        max_steps=1,
        save_strategy="steps",
        save_steps=1,
        push_to_hub=True,
        hub_model_id="stub-user/live-run",
        hub_strategy="checkpoint",
        hub_token=stub_hub.token,
    )
    assert trainer.hub_model_id == "stub-user/live-run"
    trainer.train()  # waits for the background uploads at the end
    files = stub_hub.repos["stub-user/live-run"]
    assert {"README.md", "pytorch_lora_weights.safetensors", "last-checkpoint/marble_checkpoint.json"} <= set(files)
    assert "last-checkpoint/optimizer.pt" in files and not any(p.startswith("checkpoint-") for p in files)
    summaries = sorted(c["summary"] for c in stub_hub.commits)
    assert summaries == ["Training in progress, step 1", "Training in progress, step 1, checkpoint"]
    assert not stub_hub.unexpected
