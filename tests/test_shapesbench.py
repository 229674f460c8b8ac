"""ShapesBench: the world, its scorers on images drawn with known content, and a reduced end-to-end benchmark."""

from __future__ import annotations

import csv
import math

import numpy as np
import pytest
import torch

from marble_trl.shapesbench import scorers as S
from marble_trl.shapesbench import world
from marble_trl.shapesbench.world import Scene, render, to_tensor


def _batch(scenes: list[Scene], seed: int = 0) -> tuple[list[str], torch.Tensor, dict[str, list]]:
    images = to_tensor(np.stack([render(s, seed + i) for i, s in enumerate(scenes)]))
    columns = {c: [s.columns()[c] for s in scenes] for c in world.COLUMNS}
    return [s.prompt for s in scenes], images, columns


def _family(name: str) -> list[Scene]:
    return [s for s in world.all_scenes() if s.family == name]


def test_world_captions_and_metadata():
    scenes = world.all_scenes()
    assert len({s.prompt for s in scenes}) == len(scenes) == 76
    assert {s.family for s in scenes} == set(world.FAMILIES)
    ds = world.prompt_dataset()
    assert {"prompt", *world.COLUMNS} <= set(ds.column_names)
    assert ds[0]["source"] == ds[0]["family"]
    a, b = render(scenes[0], 3), render(scenes[0], 3)
    assert a.shape == (32, 32, 3) and a.dtype == np.uint8 and (a == b).all()  # deterministic from the seed
    assert len(world.eval_scenes(8)) == 8 * 3 + 4


def test_rewards_apply_only_to_their_family():
    prompts, images, columns = _batch(world.all_scenes())
    scores = S.score_all(prompts, images, columns)
    for name in S.SPECIALIST_REWARDS:
        for fam, value in zip(columns["family"], scores[name]):
            assert (value is None) == (fam != name)
    for name in S.GENERAL_REWARDS:
        assert all(v is not None and 0.0 <= v <= 1.0 for v in scores[name])


@pytest.mark.parametrize("name", ["color", "count", "position"])
def test_specialists_score_the_truth_high(name):
    prompts, images, columns = _batch(_family(name) * 3)
    values = S.REWARDS[name](prompts, images, **columns)
    assert min(values) >= 0.75 and np.mean(values) >= 0.95


def test_color_scores_wrong_colour_low():
    truth = _family("color")
    wrong = [
        Scene(s.prompt, "color", shape=s.shape, color=next(c for c in world.COLORS if c != s.color)) for s in truth
    ]
    prompts, images, _ = _batch(wrong)  # drawn in another colour, scored against the prompt's colour
    columns = {c: [s.columns()[c] for s in truth] for c in world.COLUMNS}
    assert max(S.color(prompts, images, **columns)) <= 0.02  # right shape, wrong colour: the product is ~0
    other_shape = {"circle": "square", "square": "triangle", "triangle": "circle"}
    both_wrong = dict(columns, shape=[other_shape[s] for s in columns["shape"]])
    assert max(S.color(prompts, images, **both_wrong)) <= 0.02
    blank = torch.full_like(images, 13 / 255)
    assert max(S.color(prompts, blank, **columns)) == 0.0


def test_color_and_position_score_wrong_shapes_low():
    other = {"circle": "square", "square": "triangle", "triangle": "circle"}
    for family, reward in (("color", S.color), ("position", S.position)):
        truth = _family(family)
        prompts, images, columns = _batch(truth)
        wrong = dict(columns, shape=[other[s] for s in columns["shape"]])
        assert max(reward(prompts, images, **wrong)) <= 0.25  # a wrong shape's Gaussian tail (<= 0.22) at most
        assert np.mean(reward(prompts, images, **columns)) >= 0.9


def test_count_scores_wrong_counts_low():
    for asked in (1, 2, 3, 4):
        for drawn in (1, 2, 3, 4):
            scenes = [Scene("x", "count", shape="circle", count=drawn)] * 4
            _, images, _ = _batch(scenes, seed=10 * drawn)
            values = S.count(["x"] * 4, images, family=["count"] * 4, count=[asked] * 4)
            assert values == [max(0.0, 1 - abs(drawn - asked) / 2)] * 4


def test_position_scores_wrong_side_low():
    opposite = {"left": "right", "right": "left", "top": "bottom", "bottom": "top"}
    other_shape = {"circle": "square", "square": "triangle", "triangle": "circle"}
    truth = _family("position")
    prompts, images, columns = _batch(truth)
    wrong = dict(columns, position=[opposite[p] for p in columns["position"]])
    assert max(S.position(prompts, images, **wrong)) <= 0.2  # a side score of at most 0.2, times the shape
    both_wrong = dict(wrong, shape=[other_shape[s] for s in columns["shape"]])
    assert max(S.position(prompts, images, **both_wrong)) <= 0.05  # 0.2 of side, times a wrong shape's tail
    assert np.mean(S.position(prompts, images, **columns)) >= 0.9


def test_general_rewards_rank_blur_noise_and_flat():
    prompts, images, _ = _batch(world.all_scenes())
    blur = torch.nn.functional.avg_pool2d(images, 3, 1, 1)
    noise = torch.rand(images.shape, generator=torch.Generator().manual_seed(0))
    flat = torch.full_like(images, 0.3)
    sharp = {k: np.mean(S.sharpness(prompts, x)) for k, x in [("truth", images), ("blur", blur), ("flat", flat)]}
    assert sharp["truth"] > 0.4 > 0.15 > sharp["blur"] > sharp["flat"] == 0.0
    comp = {
        k: np.mean(S.compressibility(prompts, x)) for k, x in [("truth", images), ("noise", noise), ("flat", flat)]
    }
    assert comp["flat"] > comp["truth"] > 0.5 > 0.3 > comp["noise"]


def test_count_components():
    mask = np.zeros((12, 12), dtype=bool)
    mask[0:3, 0:3] = True
    mask[8:11, 8:11] = True
    mask[0, 6:11] = True  # a speck of 5 px: below the minimum size (half the world's smallest shape)
    assert S.count_components(mask) == 2
    assert S.count_components(mask, min_size=3) == 3


def test_every_world_object_counts_and_specks_do_not():
    """The smallest shapes the world draws (count scenes of radius 3) are objects; the minimum is half of them."""
    smallest = []
    for seed in range(200):
        scene = world.Scene("x", "count", shape=world.SHAPES[seed % 3], count=4)
        fg = S.foreground(world.to_tensor(render(scene, seed)[None]))[0].numpy()
        found = S.components(fg, min_size=1)
        assert len(found) == 4
        smallest.append(found[-1][0])
    assert S.MIN_COMPONENT_PX <= min(smallest) / 2 + 1


def test_methods_catalogue_and_stage_schedule():
    from marble_trl.shapesbench.methods import all_methods, stage_weights

    methods = all_methods()
    assert {f"only_{r}" for r in S.REWARD_NAMES} <= set(methods)
    for name in ("weighted_sum", "normalize_then_sum", "sequential", "marble", "marble_every_step", "fixed_uniform"):
        assert name in methods
    assert methods["marble"].overrides["marble_refresh_interval"] == 10
    assert methods["marble_every_step"].overrides["marble_refresh_interval"] == 1
    rewards = tuple(S.REWARD_NAMES)
    schedule = [stage_weights(s, 10, rewards) for s in range(10)]
    assert all(sum(w) == 1.0 for w in schedule)
    assert [rewards[w.index(1.0)] for w in schedule[::2]] == [
        "color",
        "count",
        "position",
        "alignment",
        "preference",
    ]
    assert methods["only_color"].family == "color" and methods["only_alignment"].family is None
    assert methods["stress_marble"].rewards == ("sharpness", "compressibility", "color", "count", "position")


def test_every_methods_overrides_make_a_valid_config(tmp_path):
    from marble_trl.shapesbench.bench import Budget, _config
    from marble_trl.shapesbench.methods import all_methods

    for method in all_methods().values():
        args = _config(method, 0, Budget(), str(tmp_path))  # __post_init__ checks every field
        assert all(getattr(args, k) == v for k, v in method.overrides.items()), method.name
    assert _config(all_methods()["marble_hold"], 0, Budget(), str(tmp_path)).marble_silent_rewards == "hold"


def test_held_out_set_gives_count_captions_enough_images():
    from collections import Counter

    from marble_trl.shapesbench.bench import Budget, eval_images

    scenes = eval_images(Budget())
    per_family = Counter(s.family for s in scenes)
    assert per_family == {"color": 12 * 32, "count": 12 * 40, "position": 12 * 32, "general": 4 * 32}
    # an s.e.m. <= 0.02 for count's 0 / 0.5 / 1 score (std <= 0.45 at worst) needs >= 400 images
    assert 0.45 / math.sqrt(per_family["count"]) <= 0.021
    # color and position (products in [0, 1]): a std over images of up to 0.365 measured (v2.1's first run)
    assert 0.365 / math.sqrt(per_family["color"]) <= 0.02 and per_family["position"] == per_family["color"]
    # run records from before the field: every caption had eval_images_per_prompt images
    old = {"eval_per_family": 12, "eval_images_per_prompt": 24}
    assert Counter(s.family for s in eval_images(old))["count"] == 12 * 24


def test_a_methods_overrides_win_over_the_budgets_settings(tmp_path):
    from marble_trl.shapesbench.bench import LORA_TARGETS, Budget, _config
    from marble_trl.shapesbench.methods import Method

    targets = [*LORA_TARGETS, "ff.net.2"]
    method = Method("probe", ("color",), overrides={"lora_target_modules": targets, "beta": 0.0})
    args = _config(method, 0, Budget(), str(tmp_path))
    assert args.lora_target_modules == targets and args.beta == 0.0 and args.nft_beta == Budget().nft_beta


def test_the_budget_sets_how_often_table_s1s_diagnostic_runs(tmp_path):
    from marble_trl.shapesbench.bench import Budget, _config
    from marble_trl.shapesbench.methods import all_methods

    marble = all_methods()["marble"]
    assert _config(marble, 0, Budget(log_update_cosines_interval=5), str(tmp_path)).log_update_cosines_interval == 5
    assert _config(marble, 0, Budget(), str(tmp_path)).log_update_cosines_interval == 3


@pytest.mark.slow
def test_reduced_benchmark_end_to_end(tmp_path, monkeypatch):
    """A tiny pretraining, one seed, six methods, two steps: every table and plot is written and finite."""
    from marble_trl.shapesbench.__main__ import main

    monkeypatch.setenv("MARBLE_TRL_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "out"
    main(
        [
            "run",
            "--out",
            str(out),
            "--seeds",
            "0",
            "--jobs",
            "0",
            "--methods",
            "only_color",
            "weighted_sum",
            "weighted_sum_plain",
            "sequential",
            "marble",
            "marble_plain",
            "fixed_uniform",
            "--steps",
            "2",
            "--num-generations",
            "4",
            "--prompts-per-step",
            "4",
            "--sample-steps",
            "2",
            "--eval-per-family",
            "1",
            "--eval-images-per-prompt",
            "2",
            "--log-update-cosines-interval",
            "1",
            "--pretrain-num-images",
            "64",
            "--pretrain-vae-steps",
            "3",
            "--pretrain-steps",
            "3",
            "--pretrain-warmup-steps",
            "1",
            "--pretrain-batch-size",
            "8",
            "--pretrain-num-layers",
            "2",
            "--pretrain-heads",
            "2",
        ]
    )
    methods = ["base", "only_color", "weighted_sum", "sequential", "marble", "fixed_uniform"]
    rows = list(csv.DictReader((out / "table1_rewards.csv").open()))
    assert [r["method"] for r in rows] == methods
    for row in rows:
        for name in S.REWARD_NAMES:
            assert math.isfinite(float(row[name])), (row["method"], name)
        assert math.isfinite(float(row["composite_z"]))
    harmony = list(csv.DictReader((out / "tableS1_harmony.csv").open()))
    assert {r["method"] for r in harmony} == {"weighted_sum", "sequential", "marble", "fixed_uniform"}
    assert all(-1 <= float(r["worst_cos"]) <= 1 and 0 <= float(r["conflict_rate"]) <= 1 for r in harmony)
    # MARBLE's Table S1 row covers its refresh step (marble/cos) and its amortised step (update_cos).
    assert {r["method"]: int(r["steps"]) for r in harmony}["marble"] == 2
    cost = list(csv.DictReader((out / "table2_cost.csv").open()))
    expected_cost = ["only_color", "weighted_sum", "weighted_sum_plain", "sequential", "marble", "marble_plain"]
    assert [r["method"] for r in cost] == [*expected_cost, "fixed_uniform"]
    assert all(float(r["relative_speed"]) > 0 and float(r["relative_peak_rss"]) > 0 for r in cost)
    balancers = list(csv.DictReader((out / "balancers.csv").open()))
    assert [r["method"] for r in balancers] == ["weighted_sum", "marble"]
    assert all(math.isfinite(float(r["mean_gain"])) for r in balancers)
    report = (out / "report.md").read_text()
    assert "## Balancers compared" in report
    for name in [*methods, *S.REWARD_NAMES]:
        assert name in report
    for png in ("reward_curves.png", "coefficients.png", "cosine_hist.png", "samples.png"):
        assert (out / png).stat().st_size > 1000
    _check_rescore(out, main)


def _check_rescore(out, main) -> None:
    """A run record written before a held-out reward existed: the report shows n/a for it and leaves it out of the
    composite; `report --rescore` scores it on the run's saved (uint8) held-out images."""
    import json

    from marble_trl.evaluation.scores import mean_sem
    from marble_trl.shapesbench.bench import eval_images

    later = ("retrieval", "diversity")
    path = out / "runs" / "marble-seed0.json"
    record = json.loads(path.read_text())
    assert all(math.isfinite(record["eval"][n]) for n in later)
    stripped = {**record, "eval": {k: v for k, v in record["eval"].items() if k not in later}}
    path.write_text(json.dumps(stripped))
    main(["report", "--out", str(out)])
    rows = {r["method"]: r for r in csv.DictReader((out / "table1_rewards.csv").open())}
    assert math.isnan(float(rows["marble"]["retrieval"])) and math.isfinite(float(rows["sequential"]["retrieval"]))
    main(["report", "--out", str(out), "--rescore"])
    again = json.loads(path.read_text())
    saved = torch.load(out / "runs" / "marble-seed0.images.pt")["eval"].float() / 255
    prompts = [s.prompt for s in eval_images(record["budget"])]
    for name in later:
        assert again["eval"][name] == mean_sem(S.REWARDS[name](prompts, saved))[0]
    assert again["eval"]["diversity"] == pytest.approx(record["eval"]["diversity"], abs=0.01)  # uint8 rounding
    assert {k: v for k, v in again["eval"].items() if k not in later} == stripped["eval"]
    rows = {r["method"]: r for r in csv.DictReader((out / "table1_rewards.csv").open())}
    assert math.isfinite(float(rows["marble"]["retrieval"]))


def test_pretraining_is_deterministic_and_cached(tmp_path, monkeypatch):
    from safetensors.torch import load_file

    from marble_trl.shapesbench.pretrain import PretrainConfig, model_path, pretrain

    config = PretrainConfig(
        num_images=32, vae_steps=2, steps=2, warmup_steps=1, batch_size=4, vae_batch_size=4, num_layers=1, heads=2
    )
    weights = []
    for run in ("a", "b"):
        monkeypatch.setenv("MARBLE_TRL_CACHE", str(tmp_path / run))
        path = pretrain(config, quiet=True)
        assert path == model_path(config) and (path / "model_index.json").is_file()
        weights.append(load_file(str(path / "transformer" / "diffusion_pytorch_model.safetensors")))
        assert pretrain(config, quiet=True) == path  # cached: returned without training
    assert weights[0].keys() == weights[1].keys()
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])
    assert PretrainConfig(seed=1).key() != PretrainConfig().key()


def test_pretraining_with_a_short_clip_context_and_large_patches(tmp_path, monkeypatch):
    """``clip_max_length`` pads both CLIP tokenizers to fewer tokens and ``patch_size`` sets the image tokens; the
    saved pipeline loads with both, still encodes the longest caption whole, and v2's values (77, 2) keep the hash
    the fields' absence had."""
    from marble_trl.models import load_sd3_pipeline
    from marble_trl.shapesbench.pretrain import PretrainConfig, longest_caption_tokens, pretrain
    from marble_trl.shapesbench.world import all_scenes

    tiny = dict(num_images=16, vae_steps=1, steps=1, warmup_steps=1, batch_size=4, vae_batch_size=4, num_layers=1)
    assert PretrainConfig(clip_max_length=77, patch_size=2, steps=1000).key() == "835ec3e7e9d8"  # v2's base model
    assert PretrainConfig(clip_max_length=77).key() != PretrainConfig().key()
    assert PretrainConfig(patch_size=2).key() != PretrainConfig().key()
    with pytest.raises(ValueError, match="clip_max_length=16.*truncate"):
        PretrainConfig(clip_max_length=16)
    with pytest.raises(ValueError, match="patch_size=3.*divide"):
        PretrainConfig(patch_size=3)
    monkeypatch.setenv("MARBLE_TRL_CACHE", str(tmp_path))
    pipe = load_sd3_pipeline(str(pretrain(PretrainConfig(clip_max_length=32, patch_size=4, **tiny), quiet=True)))
    assert pipe.tokenizer_max_length == 32 and pipe.tokenizer_2.model_max_length == 32
    longest = max((s.prompt for s in all_scenes()), key=lambda p: len(pipe.tokenizer(p).input_ids))
    assert len(pipe.tokenizer(longest).input_ids) == longest_caption_tokens() <= 32
    embeds, _, _, _ = pipe.encode_prompt(longest, None, None, do_classifier_free_guidance=False, max_sequence_length=8)
    assert embeds.shape[1] == 32 + 8  # the joint text stream: CLIP's context, then T5's (here zeros) 8 tokens
    latents = torch.zeros(1, 4, 16, 16)
    assert pipe.transformer.pos_embed(latents).shape[1] == (16 // 4) ** 2  # 16 image tokens


def test_runner_keeps_going_after_a_failed_run(tmp_path, monkeypatch):
    """One failed run is reported at the end; it does not cancel the runs still pending (ThreadPoolExecutor.map
    cancels them when a result raises), and seed-0-only runs come after every seed."""
    from marble_trl.shapesbench import bench

    done = []

    def fake(method, seed, budget, model, out_dir, log):
        if method == "only_color":
            raise RuntimeError("boom")
        done.append((method, seed))

    monkeypatch.setattr(bench, "_subprocess_run", fake)
    methods = ["only_color", "only_count", "weighted_sum", "marble_plain", "marble"]
    with pytest.raises(RuntimeError, match=r"2 run\(s\) failed.*only_color seed 0.*boom"):
        bench.run_benchmark("m", tmp_path, methods=methods, seeds=[0, 1], jobs=1)
    assert done == [
        ("only_count", 0),
        ("weighted_sum", 0),
        ("marble", 0),
        ("only_count", 1),
        ("weighted_sum", 1),
        ("marble", 1),
        ("marble_plain", 0),
    ]
