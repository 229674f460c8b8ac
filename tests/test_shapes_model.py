"""The ``shapes`` model shipped in the package: it loads wherever ``tiny`` does, draws the ShapesBench world at its
documented base level, and its files are the ones ``MANIFEST.json`` records (rebuilt bit for bit by
``python -m marble_trl.shapesbench verify-shipped``)."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
import torch

from marble_trl.data.sources import SHAPES_SOURCES
from marble_trl.models import load_sd3_pipeline, shapes_model_path
from marble_trl.shapesbench import scorers, shipped, world
from marble_trl.shapesbench.pretrain import PretrainConfig

# Held-out specialist means of the shipped base model with the protocol of `_draw` (docs/shapesbench.md, "The base
# model"): 12 captions of the family x 4 images, Euler 6 steps, seed 2024.
BASE_LEVEL = {"color": 0.449, "count": 0.542, "position": 0.295}


def _draw(family: str):
    scenes = [s for s in world.all_scenes() if s.family == family]
    scenes = [s for s in random.Random(0).sample(scenes, 12) for _ in range(4)]
    from marble_trl.publish.export import generate_images

    images = generate_images(
        "shapes",
        [s.prompt for s in scenes],
        seed=2024,
        num_inference_steps=6,
        scheduler="euler",
        resolution=32,
        max_sequence_length=8,
        device="cpu",
    )
    columns = {c: [s.columns()[c] for s in scenes] for c in world.COLUMNS}
    return scorers.REWARDS[family]([s.prompt for s in scenes], images, **columns)


def test_shapes_loads_like_tiny_and_names_itself():
    pipe = load_sd3_pipeline("shapes")
    assert type(pipe).__name__ == "StableDiffusion3Pipeline"
    assert pipe.name_or_path == "shapes"  # model cards and adapters record the name, not a site-packages path
    info = json.loads((shapes_model_path() / "shapesbench.json").read_text())
    assert info["key"] == PretrainConfig().key()  # the shipped model is the default pretraining's


@pytest.mark.parametrize("family", sorted(BASE_LEVEL))
def test_shapes_draws_the_world_at_its_base_level(family):
    values = _draw(family)
    mean = float(np.mean(values))
    sem = float(np.std(values, ddof=1) / np.sqrt(len(values)))
    # A thresholded score of deterministic images: BLAS differences move it by far less than its s.e.m.
    assert abs(mean - BASE_LEVEL[family]) < max(0.03, sem), (family, mean, sem)


def test_shipped_tensors_match_the_manifest():
    manifest = json.loads(shipped.MANIFEST.read_text())
    assert set(manifest) == {"shapes", "alignment", "preference", "judge"}
    assert shipped.tensor_hashes(shipped.WEIGHTS / "shapes") == manifest["shapes"]["tensors"]
    from marble_trl.shapesbench.judges import JUDGES, judge_file

    for name, config in JUDGES.items():
        assert manifest[name]["config_key"] == config.key()
        assert shipped.tensor_hashes(judge_file(config)) == manifest[name]["tensors"]


def test_missing_shapes_model_names_the_fix(monkeypatch, tmp_path):
    import marble_trl.models.tiny as offline_models

    monkeypatch.setattr(offline_models, "SHIPPED_WEIGHTS", tmp_path)
    with pytest.raises(FileNotFoundError, match="shapes.*marble_trl.shapesbench ship"):
        load_sd3_pipeline("shapes")


def test_shapes_prompt_sources_carry_the_metadata():
    from marble_trl.data.sources import load_source

    train = load_source("shapes")
    assert {"prompt", "family", "color", "shape", "count", "position", "source"} <= set(train.column_names)
    families = train["family"]
    assert {f: families.count(f) for f in world.FAMILIES} == {f: 48 for f in world.FAMILIES}
    assert set(load_source("shapes_position")["family"]) == {"position"}
    assert len(load_source("shapes_eval")) == 12 * 3 + 4
    with pytest.raises(ValueError, match="unknown ShapesBench family"):
        world.family_dataset("nope")


def test_shapes_rewards_are_registered():
    from marble_trl.rewards import available_rewards, get_reward
    from marble_trl.shapesbench import rewards as shapes_rewards
    from marble_trl.shapesbench.scorers import REWARDS

    # the core's name tables list the benchmark's rewards and sources without importing it: they must match it
    names = {f"shapes_{n}" for n in (*shapes_rewards.NAMES, *shapes_rewards.EDIT_NAMES)}
    assert set(shapes_rewards.NAMES) <= set(REWARDS)
    assert all(callable(getattr(shapes_rewards, f"shapes_{n}")) for n in shapes_rewards.EDIT_NAMES)
    assert names == {n for n in available_rewards() if n.startswith("shapes_")}
    editing = ("shapes_edit", "shapes_edit_eval")  # the editing world's rows (tests/test_editing.py)
    assert {s for s in SHAPES_SOURCES if s not in ("shapes", "shapes_eval", *editing)} == {
        f"shapes_{f}" for f in world.FAMILIES
    }
    scenes = [s for s in world.all_scenes() if s.family == "position"][:4]
    images = world.to_tensor(np.stack([world.render(s, i) for i, s in enumerate(scenes)]))
    columns = {c: [s.columns()[c] for s in scenes] for c in world.COLUMNS}
    got = get_reward("shapes_position")([s.prompt for s in scenes], images, **columns)
    assert got == scorers.position([s.prompt for s in scenes], images, **columns)
    assert get_reward("shapes_color")([s.prompt for s in scenes], images, **columns) == [None] * 4
    assert get_reward("shapes_retrieval")([s.prompt for s in scenes], images) == scorers.retrieval(
        [s.prompt for s in scenes], images
    )
    assert torch.is_tensor(images)


def test_ship_then_verify_reproduces_bit_for_bit(tmp_path, monkeypatch):
    """`ship` then `verify-shipped` on tiny configs: a rebuild from scratch (the base model and the judges in two
    processes) matches the manifest built in one, and a manifest that does not match the files is reported by name
    with the size of the difference."""
    from safetensors.torch import load_file, save_file

    from marble_trl.shapesbench import judges, pretrain, ship

    monkeypatch.setenv("MARBLE_TRL_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(shipped, "WEIGHTS", tmp_path / "weights")
    monkeypatch.setattr(shipped, "MANIFEST", tmp_path / "weights" / "MANIFEST.json")
    tiny = dict(num_images=32, vae_steps=2, steps=2, warmup_steps=1, batch_size=4, vae_batch_size=4, num_layers=1)
    small = dict(num_images=16, steps=2, batch_size=4, width=4, embed=8)
    tiny_judges = {n: judges.JudgeConfig(name=n, seed=i, **small) for i, n in enumerate(judges.JUDGES)}
    monkeypatch.setattr(ship, "configs", lambda: (pretrain.PretrainConfig(heads=2, **tiny), tiny_judges))
    ship.ship(quiet=True, jobs=1)
    assert (tmp_path / "weights" / "shapes" / "model_index.json").is_file()
    assert ship.verify_shipped(quiet=True, jobs=2) == {}  # built in two processes: the same bits as in one
    manifest = json.loads(shipped.MANIFEST.read_text())
    key = next(iter(manifest["judge"]["tensors"]))
    manifest["judge"]["tensors"][key] = "0" * 64
    shipped.MANIFEST.write_text(json.dumps(manifest))
    assert ship.verify_shipped(quiet=True, jobs=1) == {"judge": 0.0}  # the hash differs, the files do not
    # a shipped file that drifted: its difference relative to the tensor's scale is reported
    judge_file = ship.shipped_path("judge")
    tensors = load_file(judge_file)
    name, t = next((n, t) for n, t in tensors.items() if t.abs().max() > 0)
    tensors[name] = t + 1e-3 * t.abs().max()
    save_file(tensors, judge_file)
    assert ship.verify_shipped(quiet=True, jobs=1)["judge"] == pytest.approx(1e-3, rel=1e-2)


def test_the_benchmark_runs_on_the_shipped_model_and_pretrains_only_for_another_config(monkeypatch, tmp_path):
    import marble_trl.shapesbench.pretrain as pretrain_mod

    built = []
    monkeypatch.setattr(pretrain_mod, "pretrain", lambda config: built.append(config) or tmp_path)
    assert shipped.base_model() == shipped.WEIGHTS / "shapes" and not built
    other = PretrainConfig(steps=PretrainConfig().steps + 1)
    assert shipped.base_model(other) == tmp_path and built == [other]
