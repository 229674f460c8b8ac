"""Why does a ShapesBench specialist reward not improve when trained alone? One factor at a time.

Each run trains ``only_<reward>`` (plain DiffusionNFT, one reward) on the prompts of the reward's own family only
(every group informative), from the cached ShapesBench base model, and scores the held-out prompts of that family
with fixed noise. The baseline is the control run of docs/shapesbench.md (20 steps x 4 prompts x 8 images, lr 2e-3,
KL 0, LoRA r 8 with proj_out, 6 Euler rollout steps, ``scale_rewards="group"``); every other row changes one factor.
``spread`` rows measure, on the base model, the reward's within-group spread (what the advantages are made of) and
the fraction of groups with no spread (no signal), against the evaluation noise (s.e.m. over held-out images).

    python benchmarks/shapesbench_diagnosis.py --out outputs/shapes-diagnosis [--rewards color count position]
        [--factors baseline steps60 ...] [--seeds 0]
    python benchmarks/shapesbench_diagnosis.py --v2 --out outputs/probes-v2 [--factors ff p2s120 ...]
    python benchmarks/shapesbench_diagnosis.py --v21 --out outputs/probes-v21 --rewards count [--factors ff r32 ...]

Each (reward, factor, seed) writes ``<out>/<reward>-<factor>-seed<k>.json`` and is skipped when it exists
(resumable). ``--table`` prints the markdown table from the records.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import time
from pathlib import Path

import torch

from marble_trl import MarbleDiffusionNFTTrainer
from marble_trl.shapesbench.bench import LORA_TARGETS, Budget, _config, eval_images
from marble_trl.shapesbench.methods import Method
from marble_trl.shapesbench.scorers import REWARDS
from marble_trl.shapesbench.shipped import base_model
from marble_trl.shapesbench.world import COLUMNS, all_scenes, prompt_dataset

# v1's control budget (KL off); the scorers are v2's (Gaussian shape match), so numbers differ from the v1 table
BASE = Budget(steps=20, prompts_per_step=4, num_generations=8, learning_rate=2e-3, beta=0.0)
# factor -> (budget changes, config overrides)
FACTORS: dict[str, tuple[dict, dict]] = {
    "baseline": ({}, {}),
    "steps60": ({"steps": 60}, {}),
    "prompts16": ({"prompts_per_step": 16}, {}),
    "group16": ({"num_generations": 16}, {}),
    "lr1e-3": ({"learning_rate": 1e-3}, {}),
    "lr5e-3": ({"learning_rate": 5e-3}, {}),
    "kl1e-4": ({"beta": 1e-4}, {}),
    "rank32": ({"lora_r": 32}, {}),
    "attn_only": ({}, {"lora_target_modules": [t for t in LORA_TARGETS if t != "proj_out"]}),
    "dpm2_10": ({"sample_steps": 10}, {"sample_scheduler": "dpm2"}),
    "tf0.34": ({"timestep_fraction": 0.34}, {}),
    "scale_batch": ({}, {"scale_rewards": "batch"}),
    "nft_beta0.1": ({"nft_beta": 0.1}, {}),
    "big": ({"steps": 60, "prompts_per_step": 16}, {}),
}
# v2 probes: v2's budget (60 steps x 4 prompts x 8 images, KL 1e-4; ``Budget()`` now has 120 steps, chosen from these
# probes) and held-out protocol (``bench.evaluate``), one factor changed; ``control`` is v2's ``only_<reward>`` row.
V2_BUDGET = Budget(steps=60)
FF_TARGETS = ["ff.net.0.proj", "ff.net.2", "ff_context.net.0.proj", "ff_context.net.2"]
V2_FACTORS: dict[str, tuple[dict, dict]] = {
    "control": ({}, {}),
    "ff": ({}, {"lora_target_modules": [*LORA_TARGETS, *FF_TARGETS]}),
    "steps120": ({"steps": 120}, {}),
    "steps180": ({"steps": 180}, {}),  # 3x: how far do position and color go with more steps?
    "p2s120": ({"steps": 120, "prompts_per_step": 2}, {}),  # the same images as the control, in twice the steps
    "p1s240": ({"steps": 240, "prompts_per_step": 1}, {}),
    "lr4e-3": ({"learning_rate": 4e-3}, {}),  # twice the step length: does it stand in for twice the steps?
    "lr8e-3": ({"learning_rate": 8e-3}, {}),
}
# v2.1 probes: today's budget (``Budget()``: 120 steps x 4 prompts x 8 images) on the shipped v2.1 base, one factor
# changed (the count probes of docs/shapesbench.md; ``control`` is the plain ``only_<reward>`` run).
V21_FACTORS: dict[str, tuple[dict, dict]] = {
    "control": ({}, {}),
    "lr3e-3": ({"learning_rate": 3e-3}, {}),
    "steps160": ({"steps": 160}, {}),
    "ff": ({}, {"lora_target_modules": [*LORA_TARGETS, *FF_TARGETS]}),
    "r32": ({"lora_r": 32}, {}),
}
EVAL_PROMPTS_PER_FAMILY = 12  # held-out captions of the family (all of them for color / count: 12 each)
EVAL_IMAGES_PER_PROMPT = 8


def family_scenes(reward: str):
    return [s for s in all_scenes() if s.family == reward]


def held_out(reward: str):
    import random

    pool = family_scenes(reward)
    rng = random.Random(4321)
    return rng.sample(pool, min(EVAL_PROMPTS_PER_FAMILY, len(pool)))


def score(trainer, reward: str, budget: Budget, use_lora: bool) -> dict[str, float]:
    scenes = [s for s in held_out(reward) for _ in range(EVAL_IMAGES_PER_PROMPT)]
    prompts = [s.prompt for s in scenes]
    columns = {c: [s.columns()[c] for s in scenes] for c in COLUMNS}
    images = trainer.generate(prompts, seed=budget.eval_seed, use_lora=use_lora)
    values = torch.tensor([v for v in REWARDS[reward](prompts, images, **columns) if v is not None])
    return {"mean": values.mean().item(), "sem": (values.std() / math.sqrt(len(values))).item(), "n": len(values)}


def within_group_spread(trainer, reward: str, group: int = 8) -> dict[str, float]:
    """On the base model (no LoRA): the reward's std within groups of ``group`` images of one prompt."""
    stds, zero = [], 0
    for i, scene in enumerate(family_scenes(reward)):
        prompts = [scene.prompt] * group
        columns = {c: [scene.columns()[c]] * group for c in COLUMNS}
        images = trainer.generate(prompts, seed=1000 + i, use_lora=False)
        v = torch.tensor(REWARDS[reward](prompts, images, **columns))
        stds.append(v.std(unbiased=False).item())
        zero += int(v.std() == 0)
    n = len(stds)
    return {"mean_group_std": sum(stds) / n, "frac_zero_std": zero / n, "groups": n}


def run(reward: str, factor: str, seed: int, model: str, out: Path) -> dict:
    path = out / f"{reward}-{factor}-seed{seed}.json"
    if path.is_file():
        return json.loads(path.read_text())
    changes, overrides = FACTORS[factor]
    budget = dataclasses.replace(BASE, **changes)
    torch.set_num_threads(budget.threads)
    method = Method(f"only_{reward}", (reward,), overrides=overrides)
    args = _config(method, seed, budget, str(out / "trainer" / path.stem))
    trainer = MarbleDiffusionNFTTrainer(
        model, [REWARDS[reward]], args=args, train_dataset=prompt_dataset(family_scenes(reward))
    )
    start = time.perf_counter()
    record = {"reward": reward, "factor": factor, "seed": seed, "budget": dataclasses.asdict(budget)}
    record["overrides"] = overrides
    if factor == "baseline":
        record["base"] = score(trainer, reward, budget, use_lora=False)
        record["spread"] = within_group_spread(trainer, reward)
    trainer.train()
    record["train_seconds"] = time.perf_counter() - start
    record["trained"] = score(trainer, reward, budget, use_lora=True)
    record["train_reward_curve"] = [h.get(f"rewards/{reward}/mean") for h in trainer.state.log_history if "loss" in h]
    path.write_text(json.dumps(record))
    return record


def run_v2(reward: str, factor: str, seed: int, model: str, out: Path, v21: bool = False) -> dict:
    """One v2 probe: ``only_<reward>`` on its family with v2's budget (v2.1's with ``v21``) and one factor
    changed; writes ``<out>/runs/only_<reward>-<factor>-seed<k>.json`` (a ShapesBench run record, every reward
    held out)."""
    from marble_trl.shapesbench.bench import run_one

    name = f"only_{reward}-{factor}"
    path = out / "runs" / f"{name}-seed{seed}.json"
    if path.is_file():
        return json.loads(path.read_text())
    changes, overrides = (V21_FACTORS if v21 else V2_FACTORS)[factor]
    method = Method(name, (reward,), overrides=overrides, family=reward)
    return run_one(method, seed, dataclasses.replace(Budget() if v21 else V2_BUDGET, **changes), model, out)


def base_eval_v2(model: str, out: Path) -> dict:
    """The base model (no LoRA) on today's held-out set (``V2_BUDGET``'s, e.g. 40 images per count caption);
    writes ``<out>/base-eval.json`` in a run record's ``base_eval`` shape, for :func:`table_v2`."""
    from marble_trl.shapesbench.bench import evaluate

    budget = V2_BUDGET
    torch.set_num_threads(budget.threads)
    method = Method("base", ("count",), family="count")
    args = _config(method, 0, budget, str(out / "trainer" / "base"))
    trainer = MarbleDiffusionNFTTrainer(
        model, [REWARDS["count"]], args=args, train_dataset=prompt_dataset(family_scenes("count"))
    )
    ev = evaluate(trainer, budget, use_lora=False)
    record = {"budget": dataclasses.asdict(budget), "base_eval": ev["scores"], "base_eval_sem": ev["sems"]}
    record["num_images"] = ev["num_images"]
    (out / "base-eval.json").write_text(json.dumps(record))
    return record


def table_v2(out: Path, base_record: Path) -> str:
    """The v2 probes' held-out score of the trained reward against the base: from a benchmark run record's
    ``base_eval`` (e.g. ``benchmarks/results/shapesbench-v2/runs/weighted_sum-seed0.json``), or, for probes
    scored on a larger held-out set, from ``<out>/base-eval.json`` (:func:`base_eval_v2`) on that same set."""
    bases = [json.loads(p.read_text()) for p in (base_record, out / "base-eval.json") if p.is_file()]
    # A record's held-out set is its budget's ``eval_images`` with its noise seed.
    held_out_set = lambda r: ([s.prompt for s in eval_images(r["budget"])], r["budget"]["eval_seed"])  # noqa: E731
    base_sets = [held_out_set(base) for base in bases]
    lines = [
        "| reward | factor | seed | held-out | vs base | steps x prompts | train s |",
        "|---|---|---|---|---|---|---|",
    ]
    for p in sorted((out / "runs").glob("only_*-seed*.json")):
        r = json.loads(p.read_text())
        reward, b = r["rewards"][0], r["budget"]
        factor = r["method"].split("-", 1)[1] if "-" in r["method"] else "control"
        same = [base for base, key in zip(bases, base_sets) if key == held_out_set(r)]
        if not same:
            raise SystemExit(f"no base scored on {p.name}'s held-out set: run --v2 --base-eval first")
        gain = r["eval"][reward] - same[0]["base_eval"][reward]
        lines.append(
            f"| {reward} | {factor} | {r['seed']} | {r['eval'][reward]:.3f} ± {r['eval_sem'][reward]:.3f} | "
            f"{gain:+.3f} | {b['steps']} x {b['prompts_per_step']} | {r['train_seconds']:.0f} |"
        )
    return "\n".join(lines)


def table(out: Path) -> str:
    records = [json.loads(p.read_text()) for p in sorted(out.glob("*.json"))]
    base = {r["reward"]: r for r in records if r["factor"] == "baseline"}
    lines = ["| reward | factor | held-out (trained) | vs base | base | train s |", "|---|---|---|---|---|---|"]
    for r in records:
        b = base.get(r["reward"], {}).get("base")
        t = r["trained"]
        delta = f"{t['mean'] - b['mean']:+.3f}" if b else "?"
        base_txt = f"{b['mean']:.3f} ± {b['sem']:.3f}" if b else "?"
        lines.append(
            f"| {r['reward']} | {r['factor']} | {t['mean']:.3f} ± {t['sem']:.3f} | {delta} | {base_txt} | "
            f"{r['train_seconds']:.0f} |"
        )
    for reward, r in base.items():
        s = r["spread"]
        lines.append(
            f"\n{reward}: within-group std on the base model {s['mean_group_std']:.3f} (groups of 8), "
            f"{s['frac_zero_std']:.0%} of groups without spread; held-out s.e.m. {r['base']['sem']:.3f} "
            f"over {r['base']['n']} images"
        )
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="outputs/shapes-diagnosis")
    p.add_argument("--rewards", nargs="+", default=["color", "count", "position"])
    p.add_argument("--factors", nargs="+", default=None, help="default: every factor (v2: all but control)")
    p.add_argument("--seeds", type=int, nargs="+", default=[0])
    p.add_argument("--model", default=None, help="base pipeline folder (default: the cached ShapesBench base)")
    p.add_argument("--table", action="store_true", help="print the table of the records in --out and exit")
    p.add_argument("--v2", action="store_true", help="the v2 probes (V2_FACTORS, v2's 60-step budget)")
    p.add_argument("--v21", action="store_true", help="the v2.1 probes (V21_FACTORS, today's budget)")
    p.add_argument(
        "--base-eval", action="store_true", help="with --v2 / --v21: score the base on today's held-out set"
    )
    p.add_argument(
        "--base-record",
        default="benchmarks/results/shapesbench-v2/runs/weighted_sum-seed0.json",
        help="with --v2 --table: a benchmark run record whose base_eval is the base",
    )
    a = p.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    if a.table:
        print(table_v2(out, Path(a.base_record)) if a.v2 or a.v21 else table(out))
        return
    model = a.model or str(base_model())
    if a.base_eval:
        print(json.dumps(base_eval_v2(model, out)["base_eval"], indent=1))
        return
    if a.v2 or a.v21:  # run_one sets the budget's one thread itself; a v2 record holds every reward's held-out mean
        one = functools.partial(run_v2, v21=a.v21)
        factors, held_out = a.factors or list(V21_FACTORS if a.v21 else V2_FACTORS)[1:], lambda r, k: r["eval"][k]
    else:
        one, factors, held_out = run, a.factors or list(FACTORS), lambda r, k: r["trained"]["mean"]
    for factor in factors:
        for reward in a.rewards:
            for seed in a.seeds:
                t0 = time.perf_counter()
                r = one(reward, factor, seed, model, out)
                print(f"{reward} {factor} seed {seed}: {held_out(r, reward):.3f} ({time.perf_counter() - t0:.0f} s)")
    print(table_v2(out, Path(a.base_record)) if a.v2 or a.v21 else table(out))


if __name__ == "__main__":
    main()
