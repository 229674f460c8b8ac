"""ShapesBench v2's rewards: learned judges that no prompt-independent image can game, the held-out fidelity score,
and the shipped weights (judges and the ``shapes`` base model)."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
import torch

from marble_trl.shapesbench import judges, scorers, shipped, world
from marble_trl.shapesbench.world import COLORS, render, to_tensor


def _world_batch(per_prompt: int = 3, seed: int = 500):
    scenes = [s for s in world.all_scenes() for _ in range(per_prompt)]
    images = to_tensor(np.stack([render(s, seed + i) for i, s in enumerate(scenes)]))
    columns = {c: [s.columns()[c] for s in scenes] for c in world.COLUMNS}
    return [s.prompt for s in scenes], images, columns


def _degenerate(n: int, gen: torch.Generator, fixed: torch.Tensor) -> dict[str, torch.Tensor]:
    """The prompt-independent images a reward hacker reaches for: stripes, flat frames, noise, one fixed image."""
    ramp = torch.arange(32).float()
    palette = list(COLORS.values())
    stripes = []
    for i in range(n):
        period = 2 + i % 5
        line = (ramp // period) % 2
        mask = (line.view(1, 32) if i % 2 else line.view(32, 1)).expand(32, 32)
        stripes.append(mask[None] * torch.tensor(palette[i % 4]).view(3, 1, 1) / 255.0)
    return {
        "stripes": torch.stack(stripes),
        "black frame": torch.full((n, 3, 32, 32), 13 / 255),
        "flat colour": torch.rand(n, 3, 1, 1, generator=gen).expand(n, 3, 32, 32).clone(),
        "noise": torch.rand(n, 3, 32, 32, generator=gen),
        "fixed image": fixed.expand(n, 3, 32, 32).clone(),
    }


@pytest.mark.parametrize("name", list(scorers.GENERAL_REWARDS))
def test_general_rewards_resist_prompt_independent_images(name):
    prompts, images, columns = _world_batch()
    truth = float(np.mean(scorers.REWARDS[name](prompts, images, **columns)))
    gen = torch.Generator().manual_seed(0)
    for fixed_index in (0, 40, 70):  # a colour, a count and a position scene, drawn for every prompt
        for label, x in _degenerate(len(prompts), gen, images[fixed_index : fixed_index + 1]).items():
            score = float(np.mean(scorers.REWARDS[name](prompts, x, **columns)))
            assert score < truth - 0.2, f"{name}: {label} scores {score:.3f}, the world's own images {truth:.3f}"


@pytest.mark.parametrize("name", list(judges.JUDGES))
def test_judges_prefer_the_true_caption_and_clean_images(name):
    prompts, images, columns = _world_batch(per_prompt=2)
    rng = random.Random(0)
    near = [
        judges.near_miss(world.Scene(p, f, **_attrs(columns, i)), rng)
        for i, (p, f) in enumerate(zip(prompts, columns["family"]))
    ]
    true = np.array(judges.judge_scores(name, prompts, images))
    wrong = np.array(judges.judge_scores(name, near, images))
    assert (true > wrong).mean() > 0.8, f"{name}: the true caption wins only {(true > wrong).mean():.0%}"
    if judges.JUDGES[name].degraded:
        blurred = judges._blur(images, 5)
        assert (true > np.array(judges.judge_scores(name, prompts, blurred))).mean() > 0.8


def _attrs(columns, i):
    return {a: columns[a][i] for a in ("shape", "color", "count", "position")}


def test_near_miss_changes_exactly_one_attribute():
    rng = random.Random(1)
    by_prompt = {s.prompt: s for s in world.all_scenes()}
    for scene in world.all_scenes():
        other = by_prompt[judges.near_miss(scene, rng)]
        if scene.family == "general":
            assert other.family != "general"
            continue
        assert other.family == scene.family
        diff = [a for a in ("shape", "color", "count", "position") if getattr(a_ := other, a) != getattr(scene, a)]
        assert len(diff) == 1, (scene.prompt, a_.prompt)


def test_judge_scores_are_probabilities_and_deterministic():
    prompts, images, _ = _world_batch(per_prompt=1)
    a = judges.judge_scores("preference", prompts, images)
    b = judges.judge_scores("preference", prompts, images.clone())
    assert a == b and all(0.0 <= v <= 1.0 for v in a)
    up = torch.nn.functional.interpolate(images, size=(64, 64), mode="nearest")  # another resolution is resized
    assert np.allclose(judges.judge_scores("preference", prompts, up), a, atol=0.1)


def test_unknown_judge_is_named():
    with pytest.raises(ValueError, match="unknown judge 'nope'.*alignment"):
        judges.load_judge("nope")


def test_fidelity_ranks_world_above_blur_blobs_stripes_and_empty():
    prompts, images, columns = _world_batch(per_prompt=1)
    gen = torch.Generator().manual_seed(3)
    truth = np.mean(scorers.fidelity(prompts, images))
    assert truth > 0.85
    blurred = judges._blur(images, 3)
    noisy = (images + 0.2 * torch.randn(images.shape, generator=gen)).clamp(0, 1)
    for label, x in [("blur", blurred), ("noise", noisy), *_degenerate(len(prompts), gen, images[:1]).items()]:
        if label == "fixed image":
            continue  # fidelity is prompt-free: a world image is world-like (the judges catch the fixed image)
        assert np.mean(scorers.fidelity(prompts, x)) < truth - 0.25, label
    assert scorers.fidelity(prompts[:1], torch.full((1, 3, 32, 32), 13 / 255)) == [0.0]


def test_retrieval_is_chance_for_any_prompt_independent_image_and_high_on_the_world():
    """``retrieval`` ranks an image's caption among its family's captions by the held-out judge: the world's images
    rank their own caption near the top, and one image drawn for every caption of a family averages exactly 0.5
    (its ranks are a permutation), whatever the image; the general family's captions name nothing (``None``)."""
    prompts, images, _ = _world_batch(per_prompt=2)
    families = [s.family for s in world.all_scenes() for _ in range(2)]
    scores = scorers.retrieval(prompts, images)
    by_family = lambda values, f: [v for v, g in zip(values, families) if g == f]  # noqa: E731
    assert all(v is None for v in by_family(scores, "general"))
    for family in ("color", "count", "position"):
        assert np.mean(by_family(scores, family)) > 0.8, family
    one = world.all_scenes()
    gen = torch.Generator().manual_seed(1)
    for label, x in _degenerate(1, gen, images[:1]).items():
        fixed = scorers.retrieval([s.prompt for s in one], x.expand(len(one), 3, 32, 32))
        for family in ("color", "count", "position"):
            values = [v for v, s in zip(fixed, one) if s.family == family]
            assert np.mean(values) == pytest.approx(0.5, abs=1e-12), (label, family)
    with pytest.raises(ValueError, match="world's captions only.*a purple cow"):
        scorers.retrieval(["a purple cow"], images[:1])


def test_caption_ranks_match_the_judges_own_scores_and_count_ties_half():
    """``caption_ranks`` reuses the judge's image features across candidates: its ranks equal those from scoring
    every (candidate, image) pair with ``judge_scores``, and a candidate list with the caption twice is a tie."""
    prompts, images, _ = _world_batch(per_prompt=1)
    cands = [[s.prompt for s in world.all_scenes() if s.family == "count"]] * 12
    idx = [i for i, s in enumerate(world.all_scenes()) if s.family == "count"]
    ranks = judges.caption_ranks("judge", [prompts[i] for i in idx], images[idx], cands)
    for r, i in zip(ranks, idx):
        scores = np.array(judges.judge_scores("judge", cands[0], images[i : i + 1].expand(12, 3, 32, 32)))
        own = scores[cands[0].index(prompts[i])]
        assert r == pytest.approx(((scores < own).sum() + 0.5 * ((scores == own).sum() - 1)) / 11)
    assert judges.caption_ranks("judge", [prompts[0]], images[:1], [[prompts[0], prompts[0]]]) == [0.5]
    with pytest.raises(ValueError, match="needs its own caption"):
        judges.caption_ranks("judge", [prompts[0]], images[:1], [[prompts[1], prompts[2]]])


def test_diversity_is_zero_for_a_fixed_picture_about_one_on_the_world_and_per_caption():
    """``diversity``: squared distance to the other images of the caption over the world's expectation of it."""
    prompts, images, _ = _world_batch(per_prompt=6, seed=900)
    scores = np.array(scorers.diversity(prompts, images), dtype=float)
    assert 0.8 < scores.mean() <= 1.0  # the world's images score about 1 (clipped per image)
    first = [i for i in range(len(prompts)) if i % 6 == 0]
    collapsed = images.clone()
    for i in first:
        collapsed[i : i + 6] = images[i]  # one picture per caption, whatever the noise
    assert scorers.diversity(prompts, collapsed) == [0.0] * len(prompts)
    # per caption: a permutation of the batch, or other captions' images, change nothing
    perm = torch.randperm(len(prompts), generator=torch.Generator().manual_seed(0)).tolist()
    permuted = scorers.diversity([prompts[i] for i in perm], images[perm])
    assert np.allclose(permuted, scores[perm], rtol=1e-12, atol=0)
    assert np.allclose(scorers.diversity(prompts[:6], images[:6]), scores[:6], rtol=1e-12, atol=0)
    assert scorers.diversity(prompts[:1], images[:1]) == [None]  # alone with its caption
    noise = torch.rand(12, 3, 32, 32, generator=torch.Generator().manual_seed(2))
    assert scorers.diversity(prompts[:12], noise) == [1.0] * 12  # noise is diverse: read it beside fidelity


def test_judges_train_deterministically(monkeypatch, tmp_path):
    """A judge is a pure function of its config: two trainings give bit-identical weights (small config)."""
    config = judges.JudgeConfig(name="t", seed=5, num_images=64, steps=3, batch_size=8, width=4, embed=8)
    a, _ = judges.train_judge(config)
    b, _ = judges.train_judge(config)
    for (k, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items()):
        assert torch.equal(x, y), k
    assert judges.JudgeConfig(name="t", seed=6).key() != judges.JudgeConfig(name="t", seed=5).key()


@pytest.mark.parametrize("name", list(judges.JUDGES))
def test_shipped_judges_match_their_configs(name):
    """The package ships every judge under its config hash (no training at test or benchmark time)."""
    path = judges.judge_file(judges.JUDGES[name])
    assert path.parent == shipped.WEIGHTS, (
        f"judge {name!r} is not shipped: run `python -m marble_trl.shapesbench ship`"
    )


def test_cost_table_takes_times_and_ratios_from_the_same_runs():
    """Table 2: a method run with seeds 0 and 1 against a reference run with seed 0 only reports seed 0's step time,
    so its time and its ratio to the reference describe the same runs."""
    from marble_trl.shapesbench.report import table2

    def run(method, seed, seconds):
        return {"method": method, "seed": seed, "step_times": [9.0, seconds, seconds], "peak_rss_gib": 1.0}

    runs = [run("weighted_sum_plain", 0, 2.0), run("marble", 0, 4.0), run("marble", 1, 1.0)]
    display, raw = table2(runs)
    marble = next(r for r in raw if r["method"] == "marble")
    assert marble["step_ms"] == 4000.0 and marble["relative_speed"] == 0.5
    # records from before the budget's log_update_cosines_interval diagnosed every step
    assert next(r for r in display if r["method"] == "marble")["per-step cosine diagnostics"] == "every step"
    for r in runs:
        r["budget"] = {"log_update_cosines_interval": 3}
    display, _ = table2(runs)
    assert {r["method"]: r["per-step cosine diagnostics"] for r in display} == {
        "weighted_sum_plain": "no",
        "marble": "1 step in 3",
    }


def test_balancer_comparison_gains_and_conflicts_over_seeds():
    """The balancer comparison: per seed, the worst and mean training-reward gain and the mean held-out gain over that
    seed's base, then mean and s.e.m. over seeds; the conflict rate is Table S1's; non-balancers are left out."""
    from marble_trl.shapesbench.comparison import HELD_OUT, balancer_comparison
    from marble_trl.shapesbench.scorers import EVAL_NAMES, REWARD_NAMES

    def evals(train: float, held_out: float) -> dict:
        return {n: (train if n in REWARD_NAMES else held_out) for n in EVAL_NAMES}

    bases = [
        {"method": "only_color", "seed": s, "eval": evals(0.5, 0.5), "base_eval": evals(0.5, 0.5)} for s in (0, 1)
    ]
    upgrad = [{"method": "upgrad", "seed": s, "eval": {**evals(0.5 + g, 0.5 + g), REWARD_NAMES[0]: 0.5 - g}}
              for s, g in ((0, 0.1), (1, 0.3))]  # fmt: skip
    harmony = [{"method": "upgrad", "conflict_rate": 0.25, "conflict_rate_sem": 0.05}]
    display, raw = balancer_comparison([*bases, *upgrad], harmony)
    assert [r["method"] for r in raw] == ["upgrad"] and raw[0]["seeds"] == 2
    k = len(REWARD_NAMES)
    assert raw[0]["worst_gain"] == pytest.approx(-0.2) and raw[0]["worst_gain_sem"] == pytest.approx(0.1)
    assert raw[0]["mean_gain"] == pytest.approx(0.2 * (k - 2) / k)  # (k - 1) gains of g, one of -g
    assert raw[0]["held_out_gain"] == pytest.approx(0.2) and len(HELD_OUT) >= 2
    assert raw[0]["conflict_rate"] == 0.25 and display[0]["conflict_rate"] == "0.250 ± 0.050"
    assert display[0]["silent_refreshes"] == "n/a"  # no refresh in these runs' logs


def test_silent_refreshes_counts_rewards_without_signal_at_refresh_steps():
    from marble_trl.shapesbench.comparison import silent_refreshes

    refresh = lambda **zero_std: {  # noqa: E731
        **{f"marble/alpha/{n}": 0.5 for n in ("color", "count")},
        **{f"rewards/{n}/frac_zero_std": v for n, v in zero_std.items()},
    }
    history = [
        refresh(color=1.0, count=0.5),  # color silent
        {"rewards/color/frac_zero_std": 1.0, "rewards/count/frac_zero_std": 1.0},  # an amortised step: not counted
        refresh(color=0.75),  # count not logged (no prompt of its family): silent
        refresh(color=0.25, count=0.0),
    ]
    assert silent_refreshes({"rewards": ["color", "count"], "log_history": history}) == pytest.approx(2 / 6)
    assert math.isnan(silent_refreshes({"rewards": ["color"], "log_history": history[1:2]}))  # no refresh


def test_claims_rank_only_methods_run_on_as_many_seeds_as_marble():
    from marble_trl.shapesbench.report import claims
    from marble_trl.shapesbench.scorers import REWARD_NAMES

    def row(method, value, worst, composite, seeds):
        return {"method": method, **dict.fromkeys(REWARD_NAMES, value), "worst_gain": worst,
                "composite_z": composite, "seeds": seeds}  # fmt: skip

    rows = [row("base", 0.5, 0.0, 0.0, 1), row("marble", 0.6, -0.05, 0.3, 3), row("upgrad", 0.6, -0.02, 0.2, 3),
            row("nash_mtl", 0.6, -0.01, 0.9, 1)]  # fmt: skip
    checked = {c["claim"]: c["measured"] for c in claims(rows)}
    assert checked["MARBLE's mean is above the base on every training reward"] == "yes"
    assert checked["MARBLE's worst-reward gain is the best of the multi-reward methods"].startswith("best: upgrad")
    assert checked["MARBLE's composite is the best of the multi-reward methods"].startswith("best: marble ")


def test_probe_table_compares_each_probe_with_a_base_on_its_own_held_out_set(tmp_path):
    """``shapesbench_diagnosis.py --v2 --table``: a probe scored on 40 images per count caption is compared with the
    base scored on that same set, one scored on 24 with the benchmark record's base; a probe without one is refused."""
    import importlib.util
    import json
    from pathlib import Path

    path = Path(__file__).parents[1] / "benchmarks" / "shapesbench_diagnosis.py"
    spec = importlib.util.spec_from_file_location(path.stem, path)
    diag = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(diag)
    old = {"eval_per_family": 12, "eval_images_per_prompt": 24, "eval_seed": 12345}
    new = {**old, "eval_images_per_count_prompt": 40}
    (tmp_path / "runs").mkdir()
    budget = {"steps": 120, "prompts_per_step": 4}

    def probe(name: str, held_out: dict, score: float) -> None:
        record = {"method": f"only_count-{name}", "rewards": ["count"], "seed": 0, "budget": {**budget, **held_out}}
        record |= {"eval": {"count": score}, "eval_sem": {"count": 0.02}, "train_seconds": 1.0}
        (tmp_path / "runs" / f"only_count-{name}-seed0.json").write_text(json.dumps(record))

    bench_record = tmp_path / "weighted_sum-seed0.json"
    bench_record.write_text(json.dumps({"budget": old, "base_eval": {"count": 0.5}}))
    probe("old", old, 0.6)
    probe("new", new, 0.6)
    with pytest.raises(SystemExit, match="--base-eval"):
        diag.table_v2(tmp_path, bench_record)
    (tmp_path / "base-eval.json").write_text(json.dumps({"budget": new, "base_eval": {"count": 0.45}}))
    rows = {line.split(" | ")[1]: line for line in diag.table_v2(tmp_path, bench_record).splitlines()[2:]}
    assert "| +0.150 |" in rows["new"] and "| +0.100 |" in rows["old"]
    probe("other_noise", {**new, "eval_seed": 1}, 0.6)  # the same captions under other noise: not the same set
    with pytest.raises(SystemExit, match="other_noise"):
        diag.table_v2(tmp_path, bench_record)


def test_marble_refresh_stats_count_silent_refreshes_and_average_only_active_gradient_norms():
    """``benchmarks/marble_refresh_stats.py``: a refresh where a reward has no signal (gradient norm 0) counts as
    silent and stays out of its mean gradient norm, but not out of its mean ``alpha*`` / ``alpha_bar``; the
    non-refresh steps of the log are ignored."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).parents[1] / "benchmarks" / "marble_refresh_stats.py"
    spec = importlib.util.spec_from_file_location(path.stem, path)
    stats_mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(stats_mod)

    def refresh(a: float, b: float, norm_a: float, norm_b: float) -> dict:
        return {
            "marble/alpha/a": a, "marble/alpha/b": 1 - a,
            "marble/alpha_bar/a": b, "marble/alpha_bar/b": 1 - b,
            "marble/grad_norm/a": norm_a, "marble/grad_norm/b": norm_b,
        }  # fmt: skip

    history = [refresh(0.5, 0.5, 0.2, 0.1), {"loss": 1.0}, refresh(1.0, 0.65, 0.4, 0.0), {"loss": 0.9}]
    stats = stats_mod.refresh_stats({"method": "marble", "seed": 0, "rewards": ["a", "b"], "log_history": history})
    assert stats["a"] == pytest.approx(
        {"alpha_star": 0.75, "alpha_bar": 0.575, "grad_norm": 0.3, "silent": 0, "refreshes": 2}
    )
    assert stats["b"] == pytest.approx(
        {"alpha_star": 0.25, "alpha_bar": 0.425, "grad_norm": 0.1, "silent": 1, "refreshes": 2}
    )
    with pytest.raises(SystemExit, match="no MARBLE refresh"):
        stats_mod.refresh_stats(
            {"method": "weighted_sum", "seed": 0, "rewards": ["a"], "log_history": [{"loss": 1.0}]}
        )


def test_judge_rebuild_table_averages_seeds_and_gains_against_each_judges_own_base():
    """``benchmarks/shapesbench_judge_rebuild.py``: a method's shipped and rebuilt scores are averaged over its seeds,
    and each gain is taken against the base scored by the same judges (not across them)."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).parents[1] / "benchmarks" / "shapesbench_judge_rebuild.py"
    spec = importlib.util.spec_from_file_location(path.stem, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    rewards = mod.JUDGE_REWARDS
    rows = {
        "base-seed0": {r: [0.2, 0.3] for r in rewards},
        "marble-seed0": {r: [0.4, 0.2] for r in rewards},
        "marble-seed1": {r: [0.6, 0.4] for r in rewards},
    }
    lines = mod.table(rows).splitlines()
    marble = next(line for line in lines if line.startswith("| marble |"))
    assert marble.count("0.500 / 0.300 (+0.300 / +0.000)") == len(rewards)
    assert "| 2 |" in marble
