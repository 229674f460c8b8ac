"""Running ShapesBench: every method x every seed with the same budget, then a held-out evaluation of each run.

One run = one :class:`~marble_trl.MarbleDiffusionNFTTrainer` on the pretrained base model (see
:mod:`marble_trl.shapesbench.pretrain`), trained for ``Budget.steps`` optimizer steps of
``Budget.prompts_per_step x Budget.num_generations`` images, then evaluated on a fixed held-out prompt set with fixed
noise (every reward scored on every image, ``None`` where it does not apply). Runs execute in subprocesses (``jobs >=
1``: peak memory per run, ``jobs`` at a time) or in this process one after another (``jobs = 0``). Each run writes
``runs/<method>-seed<k>.json``; :mod:`marble_trl.shapesbench.report` turns those into the tables and plots.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from ..evaluation.scores import mean_sem
from ..models.sd3 import DEFAULT_LORA_TARGETS
from .methods import Method, StepTimer, all_methods, attach
from .scorers import HELD_OUT_REWARDS, REWARD_NAMES, REWARDS, score_all
from .world import COLUMNS, Scene, eval_scenes, family_dataset, train_dataset

# The reference's attention projections, plus proj_out so the tiny model can move colours quickly.
LORA_TARGETS = [*DEFAULT_LORA_TARGETS, "proj_out"]


@dataclass(frozen=True)
class Budget:
    """The training budget every method gets, and the evaluation protocol."""

    steps: int = 120  # v2's 60 left the specialists short of +0.10 alone; 120 x 4 x 8 is the probes' budget (docs)
    num_generations: int = 8
    prompts_per_step: int = 4
    sample_steps: int = 6
    timestep_fraction: float = 0.99  # the reference: all but one timestep (0.34 learned 4x less per step, docs)
    learning_rate: float = 2e-3
    lora_r: int = 8
    beta: float = 1e-4  # the paper's KL weight
    nft_beta: float = 1.0
    eval_per_family: int = 12
    # the product-scored color and position spread over [0, 1] (std ~0.33 over images): 32 per caption for an s.e.m.
    # <= 0.02 over their 12 captions (v2.0's 24 gave up to 0.0215)
    eval_images_per_prompt: int = 32
    # count is a 0 / 0.5 / 1 score (std ~0.39 over images): an s.e.m. <= 0.02 needs ~400 images of its 12 captions
    eval_images_per_count_prompt: int = 40
    eval_seed: int = 12345
    threads: int = 1
    # Table S1's diagnostic on every n-th step only (it costs a per-reward gradient pass); training is unchanged
    log_update_cosines_interval: int = 3


def _config(method: Method, seed: int, budget: Budget, output_dir: str):
    from ..nft_config import MarbleDiffusionNFTConfig

    images = budget.prompts_per_step * budget.num_generations
    settings = dict(
        output_dir=output_dir,
        report_to="none",
        save_strategy="no",
        overwrite_output_dir=True,  # a run's record is written only when it completes: a killed run starts over
        disable_tqdm=True,
        logging_steps=1,
        max_steps=budget.steps,
        learning_rate=budget.learning_rate,
        per_device_train_batch_size=images,
        num_generations=budget.num_generations,
        prompts_per_step=budget.prompts_per_step,
        resolution=32,
        num_sample_steps=budget.sample_steps,
        sample_scheduler="euler",
        max_sequence_length=8,
        lora_r=budget.lora_r,
        lora_alpha=2 * budget.lora_r,
        lora_target_modules=list(LORA_TARGETS),
        beta=budget.beta,
        nft_beta=budget.nft_beta,
        timestep_fraction=budget.timestep_fraction,
        log_update_cosines_interval=budget.log_update_cosines_interval,
        use_cpu=True,
        seed=seed,
    )
    return MarbleDiffusionNFTConfig(**{**settings, **method.overrides})  # a method's overrides win (e.g. LoRA targets)


def eval_images(budget: Budget | dict[str, Any]) -> list[Scene]:
    """The held-out set, one scene per image: ``eval_per_family`` captions of every family, each repeated
    ``eval_images_per_prompt`` times (``eval_images_per_count_prompt`` for count captions; run records written
    before that field existed used ``eval_images_per_prompt`` for every caption)."""
    b = budget if isinstance(budget, dict) else asdict(budget)
    return [s for s in eval_scenes(b["eval_per_family"]) for _ in range(images_per_prompt(b, s.family))]


def images_per_prompt(budget: dict[str, Any], family: str) -> int:
    """Held-out images of each caption of ``family`` under a run record's ``budget``."""
    if family == "count":
        return budget.get("eval_images_per_count_prompt", budget["eval_images_per_prompt"])
    return budget["eval_images_per_prompt"]


def eval_inputs(budget: Budget | dict[str, Any]) -> tuple[list[str], dict[str, list]]:
    """The held-out set's prompts and metadata columns, one entry per image (:func:`eval_images`)."""
    scenes = eval_images(budget)
    return [s.prompt for s in scenes], {c: [s.columns()[c] for s in scenes] for c in COLUMNS}


def evaluate(trainer: Any, budget: Budget, use_lora: bool = True, batch: int = 128) -> dict[str, Any]:
    """Generate the held-out set (:func:`eval_images`) with fixed noise (held-out seeds) and score every reward;
    per-reward means and s.e.m. over images."""
    prompts, columns = eval_inputs(budget)
    images = torch.cat(
        [
            trainer.generate(prompts[i : i + batch], seed=budget.eval_seed + i, use_lora=use_lora)
            for i in range(0, len(prompts), batch)
        ]
    )
    scores = score_all(prompts, images, columns)
    means, sems = {}, {}
    for name, values in scores.items():
        means[name], sems[name], _ = mean_sem(values)
    per_image = {name: [None if v is None else round(float(v), 6) for v in values] for name, values in scores.items()}
    return {"scores": means, "sems": sems, "num_images": len(prompts), "images": images, "per_image": per_image}


def run_one(method: Method, seed: int, budget: Budget, model: str, out_dir: Path) -> dict[str, Any]:
    """Train ``method`` with ``seed`` and evaluate it; writes and returns the run record."""
    from ..trainer import MarbleDiffusionNFTTrainer

    torch.set_num_threads(budget.threads)
    out_dir = Path(out_dir)
    run_dir = out_dir / "runs"
    run_dir.mkdir(parents=True, exist_ok=True)
    name = f"{method.name}-seed{seed}"
    timer = StepTimer()
    rewards = [REWARDS[r] for r in method.rewards]
    start = time.perf_counter()
    trainer = MarbleDiffusionNFTTrainer(
        model,
        reward_funcs=rewards,
        args=_config(method, seed, budget, str(out_dir / "trainer" / name)),
        train_dataset=family_dataset(method.family) if method.family else train_dataset(),
        callbacks=[timer],
    )
    weights_history = attach(trainer, method)
    trainer.train()
    train_seconds = time.perf_counter() - start
    ev = evaluate(trainer, budget)
    base = evaluate(trainer, budget, use_lora=False) if method.name == "weighted_sum" else None
    record = {
        "method": method.name,
        "seed": seed,
        "rewards": list(method.rewards),
        "budget": asdict(budget),
        "eval": ev["scores"],
        "eval_sem": ev["sems"],
        "base_eval": base["scores"] if base else None,
        "base_eval_sem": base["sems"] if base else None,
        # every held-out image's score (None: not applicable), in eval_images order: paired image-level analyses
        "eval_per_image": ev["per_image"],
        "base_eval_per_image": base["per_image"] if base else None,
        "family": method.family,
        "log_history": trainer.state.log_history,
        "step_times": timer.step_times(),
        "train_seconds": train_seconds,
        "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
        "stage_weights": weights_history(),
    }
    (run_dir / f"{name}.json").write_text(json.dumps(record, default=_json_default))
    # Every run's held-out images as uint8 (3.5 MB; 7 with the base): the report's sample grid (seed 0), and a held-out
    # score added later can be computed from them without retraining (`report --rescore`).
    to_u8 = lambda x: (x * 255).round().to(torch.uint8)  # noqa: E731
    images = {"eval": to_u8(ev["images"]), "base": to_u8(base["images"]) if base else None}
    torch.save(images, run_dir / f"{name}.images.pt")
    return record


def _json_default(obj: Any) -> Any:
    return str(obj)  # anything json cannot encode (e.g. a tensor in the log history) as its repr


def _subprocess_run(method: str, seed: int, budget: Budget, model: str, out_dir: Path, log: Path) -> None:
    cmd = [
        sys.executable,
        "-m",
        "marble_trl.shapesbench",
        "_worker",
        "--method",
        method,
        "--seed",
        str(seed),
        "--model",
        model,
        "--out",
        str(out_dir),
        "--budget",
        json.dumps(asdict(budget)),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": str(budget.threads), "HF_HUB_OFFLINE": "1"}
    with log.open("w") as f:
        proc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, check=False)
    if proc.returncode:
        raise RuntimeError(f"run {method} seed {seed} failed (exit {proc.returncode}); see {log}")


def run_benchmark(
    model: str,
    out_dir: str | Path,
    methods: Sequence[str] | None = None,
    seeds: Sequence[int] = (0, 1, 2),
    budget: Budget | None = None,
    jobs: int = 2,
    skip_existing: bool = False,
) -> list[Path]:
    """Run every (method, seed); returns the run-record paths. ``jobs=0`` runs in this process."""
    budget = budget or Budget()
    out_dir = Path(out_dir)
    catalogue = all_methods()
    names = list(methods) if methods else list(catalogue)
    unknown = [n for n in names if n not in catalogue]
    if unknown:
        raise ValueError(f"unknown methods {unknown}; choose from {list(catalogue)}")
    if "weighted_sum" not in names:
        raise ValueError("the method list must include 'weighted_sum' (the reference of Table 2 and the base row).")
    (out_dir / "runs").mkdir(parents=True, exist_ok=True)
    (out_dir / "logs").mkdir(parents=True, exist_ok=True)
    # Seed by seed (a complete table after each seed), the seed-0-only cost and stress runs last.
    todo = [(n, s) for s in seeds for n in names if not catalogue[n].seed0_only]
    todo += [(n, seeds[0]) for n in names if catalogue[n].seed0_only]
    paths = [out_dir / "runs" / f"{n}-seed{s}.json" for n, s in todo]
    pending = [(n, s) for (n, s), p in zip(todo, paths) if not (skip_existing and p.is_file())]
    started = time.perf_counter()

    failed: list[str] = []

    def one(item: tuple[str, int]) -> None:
        n, s = item
        t0 = time.perf_counter()
        try:
            if jobs == 0:
                run_one(catalogue[n], s, budget, model, out_dir)
            else:
                _subprocess_run(n, s, budget, model, out_dir, out_dir / "logs" / f"{n}-seed{s}.log")
        except Exception as error:  # keep going: one failed run must not cancel the others (resume re-runs it)
            failed.append(f"{n} seed {s}: {error}")
            print(f"[shapesbench] FAILED {n} seed {s}: {error}", flush=True)
            return
        print(
            f"[shapesbench] {n} seed {s}: {time.perf_counter() - t0:.0f} s "
            f"(elapsed {time.perf_counter() - started:.0f} s)",
            flush=True,
        )

    if jobs == 0:
        for item in pending:
            one(item)
    else:
        with ThreadPoolExecutor(max_workers=jobs) as pool:
            list(pool.map(one, pending))
    if failed:
        raise RuntimeError(f"{len(failed)} run(s) failed (re-run with --skip-existing to retry them): {failed}")
    return paths


def rescore(out_dir: str | Path) -> list[str]:
    """Add to each run record under ``out_dir`` the held-out rewards it lacks (scorers added after it ran), scored
    on its saved held-out images (``runs/<run>.images.pt``; the base's too where saved). Those images are uint8, so
    a score can differ from one on the run's float images by the rounding (1/255 per pixel). Returns the runs
    changed; a run without saved images keeps its columns, and the report shows n/a where a column is missing."""
    changed = []
    for path in sorted(Path(out_dir, "runs").glob("*.json")):
        record = json.loads(path.read_text())
        images_path = path.with_name(path.stem + ".images.pt")
        if not images_path.is_file():
            continue
        saved = torch.load(images_path)
        prompts, columns = eval_inputs(record["budget"])
        touched = False
        for key, images_key in (("eval", "eval"), ("base_eval", "base")):
            missing = [n for n in HELD_OUT_REWARDS if record.get(key) is not None and n not in record[key]]
            if not missing or saved.get(images_key) is None:
                continue
            scores = score_all(prompts, saved[images_key].float() / 255, columns, names=missing)
            for name, values in scores.items():
                record[key][name], record[f"{key}_sem"][name], _ = mean_sem(values)
            touched = True
        if touched:
            path.write_text(json.dumps(record, default=_json_default))
            changed.append(path.stem)
    return changed


def worker_main(argv: Sequence[str]) -> None:
    """Entry point of one subprocess run (``python -m marble_trl.shapesbench _worker ...``)."""
    import argparse

    parser = argparse.ArgumentParser()
    parser.add_argument("--method", required=True)
    parser.add_argument("--seed", type=int, required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--budget", required=True)
    args = parser.parse_args(argv)
    budget = Budget(**json.loads(args.budget))
    run_one(all_methods()[args.method], args.seed, budget, args.model, Path(args.out))


__all__ = ["Budget", "REWARD_NAMES", "eval_images", "evaluate", "rescore", "run_benchmark", "run_one"]
