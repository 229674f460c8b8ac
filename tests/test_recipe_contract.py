"""The recipe contract: every ``recipes/*.yaml`` trains through ``marble-trl train --config`` on its family's tiny
model, with its own solver, schedule, savers, sample grid and evaluation.

The only overrides are :data:`OVERRIDES` (and the reward stand-ins of :data:`STANDINS`), listed once here; everything
else runs as written. Prompts the package names (``bundled``, ShapesBench, the papers' prompt sets and mixtures such
as ``marble_5rewards``) are resolved by the real loader: the prompt sets from a cache holding synthetic files whose
digests the registry is pointed at (tests/prompt_set_stub.py), so nothing is downloaded; a file of the user's is
replaced by offline prompts. A new recipe is covered without editing this file (its family comes from its Hub id:
``FlowModelAdapter.hub_ids``). Stand-ins keep the recipe's reward names, number and options (ignored) and return
``None`` exactly where the real reward does not apply (OCR: no quoted text; GenEval: no GenEval metadata).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
import yaml
from prompt_set_stub import install_synthetic

from marble_trl.cli import main
from marble_trl.data.prompt_sets import MIXTURES
from marble_trl.data.sources import default_source_name, is_builtin
from marble_trl.models import family_of
from marble_trl.rewards import registry
from marble_trl.rewards.ocr import quoted_text

ROOT = Path(__file__).resolve().parents[1]
RECIPES = sorted((ROOT / "recipes").glob("*.yaml"))


def _settings(recipe: Path) -> dict:
    """A recipe's training settings: everything but its output folder (launcher variants differ only there)."""
    raw = yaml.safe_load(recipe.read_text())
    raw.pop("output_dir", None)
    return raw


# One run per distinct set of settings: the full fine-tuning recipes for DDP, ZeRO-2, ZeRO-3 and FSDP2 are one run
# launched four ways (the launchers are the tests' of test_full_sharded.py); the test below checks they stay so.
TRAINED: list[Path] = []
for _recipe in sorted(RECIPES, key=lambda r: len(r.stem)):  # the shortest name of each group: the launcher-free one
    if all(_settings(_recipe) != _settings(seen) for seen in TRAINED):
        TRAINED.append(_recipe)
TRAINED.sort()


def test_launcher_variants_of_a_recipe_differ_only_in_their_output_folder():
    variants = [r for r in RECIPES if r not in TRAINED]
    assert variants, "no launcher variant is deduplicated: drop this test or the TRAINED list"
    for trained in TRAINED:
        group = [trained, *(r for r in variants if _settings(r) == _settings(trained))]
        base = min((r.stem for r in group), key=len)  # e.g. <name>.yaml with <name>-zero3.yaml, <name>-fsdp2.yaml
        assert all(r.stem.startswith(base) for r in group), [r.name for r in group]


OFFLINE_MODELS = ("tiny", "shapes")  # recipes that already name an offline model keep it, at its resolution

# Every override, with why: sizes (1-2 steps of 2 groups of 2 images), the device, the precision, the output folder.
OVERRIDES = {
    "num_generations": 2,
    "prompts_per_step": 2,
    "per_device_train_batch_size": 2,
    "max_sequence_length": 8,
    "eval_num_images_per_prompt": 1,
    "sample_grid_seeds": 1,
    "use_cpu": True,
    "bf16": False,
    "torch_dtype": "float32",
    "report_to": "none",
    "logging_steps": 1,  # a 1-step run logs its step (the main job logs every 5)
}
SWAPPED_MODEL = {"resolution": 16, "num_frames": 3}  # the tiny stand-ins' sizes (a recipe's 512 px / 33 frames)


def _standin(name: str, applies):
    """A reward factory with the options of the real one (ignored): brightness where ``applies(prompt, columns)``."""

    def factory(**_options):
        def reward(prompts, images, **columns):
            rows = [{k: v[i] for k, v in columns.items() if isinstance(v, list)} for i in range(len(prompts))]
            score = images.float().flatten(1).mean(dim=1).tolist()
            return [s if applies(p, row) else None for p, s, row in zip(prompts, score, rows)]

        reward.__name__ = name
        return reward

    return factory


def _everywhere(prompt, row) -> bool:
    return True


# The rewards that need downloaded weights or a server, and where each applies.
STANDINS = {
    "pickscore": _everywhere,
    "hpsv2": _everywhere,
    "clipscore": _everywhere,
    "aesthetic": _everywhere,
    "imagereward": _everywhere,
    "unifiedreward": _everywhere,
    "ocr": lambda prompt, row: quoted_text(prompt) is not None,
    "geneval": lambda prompt, row: row.get("include") is not None,
    "clip_directional": _everywhere,
}

# Offline prompts with the columns the recipes' rewards read: plain, quoted text (OCR), GenEval metadata.
PROMPTS = [
    {"prompt": "a red apple on a table", "tag": None, "include": None},
    {"prompt": 'a shop sign that says "OPEN"', "tag": None, "include": None},
    {"prompt": "a photo of two cats", "tag": "counting", "include": [{"class": "cat", "count": 2}]},
    {"prompt": "a blue boat on a lake", "tag": None, "include": None},
    {"prompt": 'a poster with the words "HELLO MARBLE"', "tag": None, "include": None},
    {"prompt": "a photo of a red bench", "tag": "colors", "include": [{"class": "bench", "count": 1, "color": "red"}]},
]


def _users_file(path: str) -> bool:
    """A prompt file the recipe's user provides (not one the package names, not one in the repository)."""
    return not is_builtin(path) and not Path(path).exists()


def _overrides(recipe: dict, tmp_path: Path) -> dict:
    """Every override of one recipe (the family's tiny model, the offline prompts where it names a file of its
    user's, the sizes) as ``--field value`` pairs."""
    out = {**OVERRIDES, "output_dir": str(tmp_path / "out")}
    model = recipe["model_name_or_path"]
    if model not in OFFLINE_MODELS:
        out["model_name_or_path"] = family_of(model).tiny_name
        out.update({k: v for k, v in SWAPPED_MODEL.items() if k != "num_frames" or "num_frames" in recipe})
    if "dataset_name" in recipe and _users_file(recipe["dataset_name"]):
        prompts = tmp_path / "prompts.jsonl"
        rows = PROMPTS
        if family_of(model).editing:  # an editing recipe's rows: each instruction with its image and edit mask
            rows = [{**row, **_edit_files(tmp_path, i)} for i, row in enumerate(PROMPTS)]
        prompts.write_text("".join(json.dumps(row) + "\n" for row in rows))
        out["dataset_name"] = str(prompts)
    mixture = recipe.get("dataset_mixture") or []
    if any(_users_file(source["path"]) for source in mixture if isinstance(source, dict)):
        specs = []  # each source a file of the offline prompts under the source's name, with the recipe's ratio
        for source in mixture:
            path = tmp_path / f"{source.get('name') or default_source_name(source['path'])}.jsonl"
            path.write_text("".join(json.dumps(row) + "\n" for row in PROMPTS))
            specs.append(f"{path}={source['ratio']}" if "ratio" in source else str(path))
        out["dataset_mixture"] = specs
    # Two steps where one step would not show the recipe's schedule (the old policy held for N steps).
    out["max_steps"] = 2 if recipe.get("old_policy_update_interval", 1) > 1 else 1
    return out


def _edit_files(folder: Path, i: int) -> dict[str, str]:
    """Row ``i``'s source image and edit mask, written under ``folder`` (paths relative to the data file)."""
    import numpy as np
    from PIL import Image

    (folder / "images").mkdir(exist_ok=True)
    pixels = (np.random.RandomState(i).rand(40, 40, 3) * 255).astype(np.uint8)
    Image.fromarray(pixels).save(folder / "images" / f"{i}.png")
    mask = np.zeros((40, 40), dtype=np.uint8)
    mask[:20, :20] = 255
    Image.fromarray(mask).save(folder / "images" / f"{i}-mask.png")
    return {"source_images": f"images/{i}.png", "edit_masks": f"images/{i}-mask.png"}


def _flags(overrides: dict) -> list[str]:
    flags = []
    for key, value in overrides.items():
        values = value if isinstance(value, list) else [value]
        flags += [f"--{key}", *(str(v).lower() if isinstance(v, bool) else str(v) for v in values)]
    return flags


@pytest.fixture
def standins(monkeypatch):
    for name, applies in STANDINS.items():
        monkeypatch.setitem(registry._REGISTRY, name, (_standin(name, applies), True))


@pytest.fixture
def prompt_sets(monkeypatch, tmp_path):
    """The named prompt sets as synthetic files in a cache the registry trusts (the suite is offline)."""
    return install_synthetic(monkeypatch, tmp_path / "prompt-sets")


def _named_sources(recipe: dict) -> set[str]:
    """The source labels of a recipe whose prompts are a named mixture or a mixture of named prompt sets."""
    if recipe.get("dataset_name") in MIXTURES:
        return {spec["name"] for spec in MIXTURES[recipe["dataset_name"]]}
    mixture = [s for s in recipe.get("dataset_mixture") or [] if isinstance(s, dict)]
    if mixture and not any(_users_file(s["path"]) for s in mixture):
        return {s.get("name") or default_source_name(s["path"]) for s in mixture}
    return set()


def test_every_recipe_reward_is_offline_or_has_a_standin():
    names = {n for r in RECIPES for n in yaml.safe_load(r.read_text())["reward_funcs"]}
    offline = {n for n in names if n.startswith("shapes_")} | {"brightness", "contrast", "temporal_consistency"}
    offline |= {"jpeg_compressibility", "jpeg_incompressibility", "preservation"}
    assert names <= offline | set(STANDINS), names - offline - set(STANDINS)


@pytest.mark.slow
@pytest.mark.parametrize("recipe", TRAINED, ids=lambda p: p.stem)
def test_recipe_trains_as_written_on_its_family_tiny_model(recipe, tmp_path, standins, prompt_sets, capsys):
    raw = yaml.safe_load(recipe.read_text())
    overrides = _overrides(raw, tmp_path)
    main(["train", "--config", str(recipe), *_flags(overrides)])
    out = Path(overrides["output_dir"])
    summary = json.loads((out / "run_summary.json").read_text())
    assert summary["global_step"] == overrides["max_steps"]
    assert torch.isfinite(torch.tensor(summary["train_loss"]))
    if raw.get("use_peft", True):
        assert (out / "pytorch_lora_weights.safetensors").is_file()
    else:  # full fine-tuning: the whole transformer as a diffusers model folder
        assert (out / "transformer" / "config.json").is_file() and not (
            out / "pytorch_lora_weights.safetensors"
        ).exists()
    logged = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [entry for entry in logged if "loss" in entry]
    rewards = raw["reward_funcs"]
    for name in rewards:  # every reward scored (a specialist's mean is absent when no prompt of a step applies)
        assert any(f"rewards/{name}/frac_not_applicable" in entry for entry in steps), name
    sources = _named_sources(raw)
    if sources:  # the mixture was loaded as written: per-source metrics under the recipe's source names only
        logged_sources = {
            k.split("/")[2] for entry in steps for k in entry if re.fullmatch(r"rewards/[^/]+/[^/]+/mean", k)
        }
        assert logged_sources and logged_sources <= sources, (logged_sources, sources)
    if raw.get("sample_grid_prompts", 4):
        assert (out / "samples_before_after.png").is_file()
    if raw.get("eval_before_after"):
        assert set(summary["eval_before"]) == set(raw.get("eval_reward_funcs", rewards))
