"""ShapesBench tables and plots from the run records (``runs/*.json``) written by :mod:`marble_trl.shapesbench.bench`.

- **Table 1** (``table1_rewards``): held-out score of every reward per method, mean +- standard error over seeds, and
  the composite z-score (``marble_trl.evaluation.scores.composite_zscores`` over the methods and the base model, computed per
  seed, then averaged);
- **Table S1** (``tableS1_harmony``): update harmony over training steps: worst-reward cosine ``min_k cos(d, g_k)``,
  mean cosine, variance of the cosines across rewards, conflict rate ``P(min_k cos < 0)``; over the rewards *with
  signal* in that step (some group with spread). Weighted-sum-type methods: ``update_cos/*`` on every step; MARBLE
  variants: ``marble/cos/*`` on refresh steps;
- **Table 2** (``table2_cost``): median step time and peak RSS, relative to the weighted sum (without the per-step
  cosine diagnostics: ``weighted_sum_plain``) of the same seed;
- the balancer comparison (``balancers``, :mod:`.comparison`): worst, mean and held-out gains and the all-step
  conflict rate of MARBLE, its variants and the aggregators;
- plots: ``reward_curves.png``, ``coefficients.png``, ``cosine_hist.png``.
"""

from __future__ import annotations

import json
import math
import statistics
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ..evaluation.scores import composite_zscores, markdown_table, mean_sem, write_csv
from .bench import eval_images, images_per_prompt
from .comparison import COLUMNS as COMPARISON_COLUMNS
from .comparison import MULTI_REWARD_ORDER, balancer_comparison
from .methods import all_methods
from .scorers import EVAL_NAMES, REWARD_NAMES, STRESS_REWARDS


def load_runs(out_dir: str | Path) -> list[dict[str, Any]]:
    runs = [json.loads(p.read_text()) for p in sorted(Path(out_dir, "runs").glob("*.json"))]
    if not runs:
        raise FileNotFoundError(f"no run records under {Path(out_dir, 'runs')}; run the benchmark first.")
    return runs


def _method_order(runs: Sequence[dict[str, Any]], timing: bool = False) -> list[str]:
    """The methods present, in catalogue order; ``timing_only`` ones only when ``timing`` is set."""
    present = {r["method"] for r in runs}
    return [m for m, spec in all_methods().items() if m in present and (timing or not spec.timing_only)]


def _score_runs(runs: Sequence[dict[str, Any]], stress: bool = False) -> list[dict[str, Any]]:
    """The runs of the score tables: no cost-only run; the stress-test runs only when ``stress``."""
    catalogue = all_methods()
    keep = {m for m in _method_order(runs) if catalogue[m].stress == stress}
    return [r for r in runs if r["method"] in keep]


def _pm(mean: float, sem: float, digits: int = 3) -> str:
    if math.isnan(mean):
        return "n/a"
    return f"{mean:.{digits}f}" if math.isnan(sem) else f"{mean:.{digits}f} ± {sem:.{digits}f}"


def table1(runs: Sequence[dict[str, Any]], stress: bool = False) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Rows for display (``mean ± sem`` strings) and raw rows (means, sems) of Table 1: every evaluation reward
    (trained and held out), the worst training-reward gain over the base (``worst_gain``) and the composite z-score
    over all of them. ``stress``: the same for the opposing-pair stress test."""
    bases = [r for r in runs if r.get("base_eval")]
    runs = _score_runs(runs, stress)
    columns = [*STRESS_REWARDS, *EVAL_NAMES[len(REWARD_NAMES) :]] if stress else list(EVAL_NAMES)
    trained = list(STRESS_REWARDS) if stress else list(REWARD_NAMES)
    methods = _method_order(runs)
    seeds = sorted({r["seed"] for r in runs})
    per_seed: dict[int, dict[str, dict[str, float]]] = defaultdict(dict)
    for r in runs:
        per_seed[r["seed"]][r["method"]] = r["eval"]
    for r in bases:
        per_seed[r["seed"]]["base"] = r["base_eval"]
    rows_order = (["base"] if any("base" in t for t in per_seed.values()) else []) + methods
    # A held-out reward added after some runs (`report --rescore` fills it from saved images): a column no record has
    # is left out, a cell is n/a unless every seed of the row has it, and the composite uses the columns all rows have.
    rows = [row for t in per_seed.values() for row in t.values()]
    columns = [c for c in columns if any(c in row for row in rows)]
    common = [c for c in columns if all(c in row for row in rows)]
    composite: dict[str, list[float]] = defaultdict(list)
    worst: dict[str, list[float]] = defaultdict(list)
    for seed in seeds:
        table = {m: per_seed[seed][m] for m in rows_order if m in per_seed[seed]}
        if len(table) >= 2:
            for m, z in composite_zscores(table, columns=common).items():
                composite[m].append(z)
        base = per_seed[seed].get("base")
        if base is not None:
            for m, row in table.items():
                worst[m].append(min(row[c] - base[c] for c in trained))
    display, raw = [], []
    for m in rows_order:
        d: dict[str, Any] = {"method": m}
        w: dict[str, Any] = {"method": m}
        for col in columns:
            cells = [per_seed[s][m].get(col) for s in seeds if m in per_seed[s]]
            mean, sem, n = mean_sem(cells) if None not in cells else (math.nan, math.nan, 0)
            d[col] = _pm(mean, sem)
            w[col], w[f"{col}_sem"] = mean, sem
        mean, sem, _ = mean_sem(worst.get(m, []))
        d["worst_gain"] = _pm(mean, sem)
        w["worst_gain"], w["worst_gain_sem"] = mean, sem
        mean, sem, n = mean_sem(composite.get(m, []))
        d["composite_z"] = _pm(mean, sem, 2)
        w["composite_z"], w["composite_z_sem"], w["seeds"] = mean, sem, n
        d["seeds"] = n
        display.append(d)
        raw.append(w)
    return display, raw


def learnability(runs: Sequence[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Each reward trained alone (``only_<reward>``) against the base on that reward: the gain (mean ± s.e.m. over
    seeds), the gain in units of that s.e.m., and the evaluation's s.e.m. over images (measurability)."""
    by = defaultdict(dict)
    for r in runs:
        by[r["seed"]][r["method"]] = r
        if r.get("base_eval"):
            by[r["seed"]]["base"] = r
    display, raw = [], []
    for name in REWARD_NAMES:
        gains, image_sems = [], []
        for table in by.values():
            alone, base = table.get(f"only_{name}"), table.get("base")
            if alone is None or base is None:
                continue
            gains.append(alone["eval"][name] - base["base_eval"][name])
            image_sems.append(max(alone.get("eval_sem", {}).get(name, math.nan), base["base_eval_sem"][name]))
        if not gains:
            continue
        mean, sem, n = mean_sem(gains)
        base_means = [t["base"]["base_eval"][name] for t in by.values() if "base" in t]
        w = {
            "reward": name,
            "base": statistics.fmean(base_means),
            "gain": mean,
            "gain_sem": sem,
            "gain_in_sems": mean / sem if sem and sem > 0 else math.nan,
            "image_sem": max(image_sems),
            "seeds": n,
            "learnable": mean >= 0.10 and (n < 2 or mean > 2 * sem),
        }
        raw.append(w)
        display.append(
            {
                "reward": name,
                "base": f"{w['base']:.3f}",
                "trained alone: gain": _pm(mean, sem),
                "gain / s.e.m.": f"{w['gain_in_sems']:.1f}",
                "s.e.m. over images (max)": f"{w['image_sem']:.3f}",
                "seeds": n,
            }
        )
    return display, raw


def claims(t1_raw: Sequence[dict[str, Any]]) -> list[dict[str, str]]:
    """The paper's Table 1 claims checked on the raw Table 1 rows: MARBLE above the base on every training reward
    (by its mean over seeds), and MARBLE's worst-reward gain and composite the best of the multi-reward methods run
    with at least as many seeds as MARBLE."""
    rows = {r["method"]: r for r in t1_raw}
    if "marble" not in rows or "base" not in rows:
        return []
    marble, base = rows["marble"], rows["base"]
    below = [n for n in REWARD_NAMES if not marble[n] > base[n]]
    multi = [m for m in MULTI_REWARD_ORDER if m in rows and rows[m]["seeds"] >= marble["seeds"]]  # as many seeds

    def best(key: str) -> str:
        ranked = sorted(multi, key=lambda m: -rows[m][key] if math.isfinite(rows[m][key]) else math.inf)
        return ranked[0] if ranked else "n/a"

    return [
        {
            "claim": "MARBLE's mean is above the base on every training reward",
            "measured": "yes" if not below else f"no: not above on {', '.join(below)}",
        },
        {
            "claim": "MARBLE's worst-reward gain is the best of the multi-reward methods",
            "measured": f"best: {best('worst_gain')} ({rows[best('worst_gain')]['worst_gain']:+.3f}; MARBLE "
            f"{marble['worst_gain']:+.3f})",
        },
        {
            "claim": "MARBLE's composite is the best of the multi-reward methods",
            "measured": f"best: {best('composite_z')} ({rows[best('composite_z')]['composite_z']:+.2f}; MARBLE "
            f"{marble['composite_z']:+.2f})",
        },
    ]


def _cosine_steps(run: dict[str, Any]) -> list[list[float]]:
    """Per step, the cosines cos(update, g_k) of the rewards with signal in that step."""
    out = []
    for h in run["log_history"]:
        # A MARBLE refresh step logs marble/cos/* (cos(d_final, g_k)); every other step update_cos/*. An estimated
        # refresh logs both: its marble/cos/* are the subset's, its update_cos/* those of the whole step (kept).
        diagnosed = any("update_cos/" + n in h for n in run["rewards"])
        refresh = any("marble/cos/" + n in h for n in run["rewards"])
        prefix = "marble/cos/" if refresh and not diagnosed else "update_cos/"
        cos = []
        for name in run["rewards"]:
            key = prefix + name
            zero_std = h.get(f"rewards/{name}/frac_zero_std")
            value = h.get(key)
            if value is not None and math.isfinite(value) and zero_std is not None and zero_std < 1.0:
                cos.append(float(value))
        if cos:
            out.append(cos)
    return out


def tableS1(runs: Sequence[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Update-harmony statistics per multi-reward method (mean ± sem over seeds of per-run averages)."""
    runs = _score_runs(runs)
    display, raw = [], []
    for m in _method_order(runs):
        stats: dict[str, list[float]] = defaultdict(list)
        steps = 0
        for r in (r for r in runs if r["method"] == m and len(r["rewards"]) > 1):
            per_step = _cosine_steps(r)
            if not per_step:
                continue
            steps += len(per_step)
            worst = [min(c) for c in per_step]
            stats["worst_cos"].append(statistics.fmean(worst))
            stats["mean_cos"].append(statistics.fmean(statistics.fmean(c) for c in per_step))
            stats["var_cos"].append(statistics.fmean(statistics.pvariance(c) for c in per_step))
            stats["conflict_rate"].append(statistics.fmean(float(w < 0) for w in worst))
        if not stats:
            continue
        d: dict[str, Any] = {"method": m, "steps": steps}
        w: dict[str, Any] = {"method": m, "steps": steps}
        for key in ("worst_cos", "mean_cos", "var_cos", "conflict_rate"):
            mean, sem, _ = mean_sem(stats[key])
            d[key] = _pm(mean, sem)
            w[key], w[f"{key}_sem"] = mean, sem
        display.append(d)
        raw.append(w)
    return display, raw


def table2(runs: Sequence[dict[str, Any]], skip: int = 1) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Median step time and peak RSS per method, relative to the reference of the same seed (median over seeds).

    The reference is ``weighted_sum_plain`` (the weighted sum without per-step cosine diagnostics) when it was run,
    else ``weighted_sum``. Times and ratios come from the same runs: those of the seeds the reference ran with (all
    seeds of a method when the reference has none in common with it).
    """
    by = {(r["method"], r["seed"]): r for r in runs}
    ref = "weighted_sum_plain" if any(r["method"] == "weighted_sum_plain" for r in runs) else "weighted_sum"
    catalogue, display, raw = all_methods(), [], []
    for m in _method_order(runs, timing=True):
        speed, mem, step_ms, peak = [], [], [], []
        paired = {seed for (method, seed) in by if method == m and (ref, seed) in by}
        for (method, seed), r in by.items():
            if method != m or (paired and seed not in paired):
                continue
            times = r["step_times"][skip:] or r["step_times"]
            t = statistics.median(times)
            step_ms.append(1000 * t)
            peak.append(r["peak_rss_gib"])
            base = by.get((ref, seed))
            if base:
                tb = statistics.median(base["step_times"][skip:] or base["step_times"])
                speed.append(tb / t)
                mem.append(r["peak_rss_gib"] / base["peak_rss_gib"])
        cosines = bool(catalogue[m].overrides.get("log_update_cosines"))
        n = next(r.get("budget", {}).get("log_update_cosines_interval", 1) for (k, _), r in by.items() if k == m)
        label = "no" if not cosines else "every step" if n == 1 else f"1 step in {n}"  # older records: every step
        w = {
            "method": m,
            "per_step_cosines": label,
            "step_ms": statistics.median(step_ms),
            "relative_speed": statistics.median(speed) if speed else math.nan,
            "peak_rss_gib": statistics.median(peak),
            "relative_peak_rss": statistics.median(mem) if mem else math.nan,
        }
        raw.append(w)
        display.append(
            {
                "method": m,
                "per-step cosine diagnostics": label,
                "step time (median)": f"{w['step_ms']:.0f} ms",
                f"speed vs {ref}": f"{w['relative_speed']:.3f}x",
                "peak RSS": f"{w['peak_rss_gib']:.2f} GiB",
                f"peak RSS vs {ref}": f"{w['relative_peak_rss']:.3f}x",
            }
        )
    return display, raw


def _series(run: dict[str, Any], key: str) -> tuple[list[int], list[float]]:
    xs, ys = [], []
    for h in run["log_history"]:
        if key in h and h[key] is not None and "step" in h:
            xs.append(int(h["step"]))
            ys.append(float(h[key]))
    return xs, ys


def _mean_curve(runs: Sequence[dict[str, Any]], key: str, smooth: int = 3) -> tuple[list[int], list[float]]:
    acc: dict[int, list[float]] = defaultdict(list)
    for r in runs:
        for x, y in zip(*_series(r, key)):
            acc[x].append(y)
    xs = sorted(acc)
    ys = [statistics.fmean(acc[x]) for x in xs]
    if smooth > 1 and len(ys) >= smooth:
        ys = [statistics.fmean(ys[max(0, i - smooth + 1) : i + 1]) for i in range(len(ys))]
    return xs, ys


def plots(runs: Sequence[dict[str, Any]], out_dir: Path) -> list[Path]:
    """Reward curves, MARBLE coefficient trajectories and cosine histograms as PNG files."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    runs = _score_runs(runs)
    methods = _method_order(runs)
    multi = [m for m in methods if m in MULTI_REWARD_ORDER]
    by_method = {m: [r for r in runs if r["method"] == m] for m in methods}
    files = []

    fig, axes = plt.subplots(1, len(REWARD_NAMES), figsize=(4 * len(REWARD_NAMES), 3.4), squeeze=False)
    for ax, name in zip(axes[0], REWARD_NAMES):
        for m in [*multi, f"only_{name}"]:
            if m not in by_method:
                continue
            xs, ys = _mean_curve(by_method[m], f"rewards/{name}/mean")
            if xs:
                specialist = m.startswith("only_")
                label = "that reward's specialist (only_*)" if specialist else m
                ax.plot(xs, ys, label=label, linestyle="--" if specialist else "-", color="k" if specialist else None)
        ax.set_title(f"{name} (training batch, mean over seeds)", fontsize=9)
        ax.set_xlabel("step")
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    files.append(out_dir / "reward_curves.png")
    fig.savefig(files[-1], dpi=110)
    plt.close(fig)

    coef_methods = [m for m in ("marble", "marble_every_step", "sequential") if m in by_method]
    fig, axes = plt.subplots(1, max(1, len(coef_methods)), figsize=(5 * max(1, len(coef_methods)), 3.4), squeeze=False)
    for ax, m in zip(axes[0], coef_methods):
        for k, name in enumerate(REWARD_NAMES):
            if m == "sequential":
                hist = by_method[m][0].get("stage_weights") or []
                xs, ys = list(range(len(hist))), [w[k] for w in hist]
            else:
                xs, ys = _mean_curve(by_method[m], f"marble/alpha_bar/{name}", smooth=1)
            if xs:
                ax.plot(xs, ys, marker="o", markersize=3, label=name)
        ax.set_title(f"{m}: {'stage weights' if m == 'sequential' else 'alpha_bar (mean over seeds)'}", fontsize=9)
        ax.set_xlabel("step")
        ax.set_ylim(-0.02, 1.02)
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    files.append(out_dir / "coefficients.png")
    fig.savefig(files[-1], dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6, 3.6))
    bins = [i / 10 for i in range(-10, 11)]
    for m in multi:
        worst = [min(c) for r in by_method[m] for c in _cosine_steps(r)]
        if worst:
            ax.hist(worst, bins=bins, histtype="step", linewidth=1.5, label=f"{m} (n={len(worst)})", density=True)
    ax.axvline(0.0, color="k", linewidth=0.8)
    ax.set_xlabel("worst-reward cosine min_k cos(update, g_k) per step")
    ax.set_ylabel("density")
    ax.legend(fontsize=7)
    fig.tight_layout()
    files.append(out_dir / "cosine_hist.png")
    fig.savefig(files[-1], dpi=110)
    plt.close(fig)
    grid = sample_grid(runs, out_dir)
    if grid is not None:
        files.append(grid)
    return files


def sample_grid(runs: Sequence[dict[str, Any]], out_dir: Path, per_family: int = 4) -> Path | None:
    """``samples.png``: seed 0's held-out images (first image of the first ``per_family`` captions of every family),
    one row per model (base first)."""
    import matplotlib.pyplot as plt
    import torch

    from .world import FAMILIES

    rows: list[tuple[str, Any]] = []
    base = None
    for m in _method_order(runs):
        path = out_dir / "runs" / f"{m}-seed0.images.pt"
        if not path.is_file():
            continue
        data = torch.load(path)
        base = data["base"] if data.get("base") is not None else base
        rows.append((m, data["eval"]))
    if base is not None:
        rows.insert(0, ("base", base))
    if not rows:
        return None
    budget = runs[0]["budget"]
    scenes = eval_images(budget)  # one scene per image; a caption's first image is its first occurrence
    firsts = [i for i, s in enumerate(scenes) if i == 0 or s.prompt != scenes[i - 1].prompt]
    picks = [i for f in FAMILIES for i in [j for j in firsts if scenes[j].family == f][:per_family]]
    fig, axes = plt.subplots(len(rows), len(picks), figsize=(0.9 * len(picks) + 1.6, 0.95 * len(rows) + 0.6))
    axes = np.atleast_2d(axes)
    for r, (name, images) in enumerate(rows):
        for c, i in enumerate(picks):
            ax = axes[r][c]
            ax.imshow(images[i].permute(1, 2, 0).numpy(), interpolation="nearest")
            ax.set_xticks([])
            ax.set_yticks([])
            if r == 0:
                ax.set_title(scenes[i].prompt, fontsize=5)
            if c == 0:
                ax.set_ylabel(name, fontsize=6, rotation=0, ha="right", va="center")
    fig.tight_layout()
    path = out_dir / "samples.png"
    fig.savefig(path, dpi=130)
    plt.close(fig)
    return path


def write_report(out_dir: str | Path, make_plots: bool = True) -> str:
    """Write ``table1_rewards``, ``tableS1_harmony``, ``table2_cost`` (.md and .csv), the plots, and
    ``report.md`` (all three tables); returns the markdown."""
    out_dir = Path(out_dir)
    runs = load_runs(out_dir)
    seeds = sorted({r["seed"] for r in runs})
    budget = runs[0]["budget"]
    sections = [
        f"ShapesBench: {len({r['method'] for r in runs})} methods x seeds {seeds}; budget {budget['steps']} steps x "
        f"{budget['prompts_per_step']} prompts x {budget['num_generations']} images; held-out "
        f"{budget['eval_per_family']} prompts per family x {budget['eval_images_per_prompt']} images "
        f"({images_per_prompt(budget, 'count')} per count prompt).\n"
    ]
    t1d, t1r = table1(runs)
    cols1 = ["method", *(c for c in EVAL_NAMES if c in t1r[0]), "worst_gain", "composite_z"]
    sections.append("## Table 1: held-out rewards (mean ± s.e.m. over seeds)\n\n" + markdown_table(t1d, cols1))
    write_csv(out_dir / "table1_rewards.csv", t1r, list(t1r[0]))
    (out_dir / "table1_rewards.md").write_text(markdown_table(t1d, cols1))

    checks = claims(t1r)
    if checks:
        sections.append("## The paper's claims, checked\n\n" + markdown_table(checks, ["claim", "measured"]))

    ld, lr = learnability(runs)
    if ld:
        sections.append("## Learnability: each reward trained alone\n\n" + markdown_table(ld, list(ld[0])))
        write_csv(out_dir / "learnability.csv", lr, list(lr[0]))
        (out_dir / "learnability.md").write_text(markdown_table(ld, list(ld[0])))

    if _score_runs(runs, stress=True):
        sd, _ = table1(runs, stress=True)
        cols_stress = ["method", *(c for c in [*STRESS_REWARDS, *EVAL_NAMES[len(REWARD_NAMES) :]] if c in sd[0])]
        cols_stress += ["worst_gain", "composite_z"]
        sections.append("## Stress test: an opposing pair of general rewards\n\n" + markdown_table(sd, cols_stress))
        (out_dir / "table_stress.md").write_text(markdown_table(sd, cols_stress))

    tsd, tsr = tableS1(runs)
    cols_s = ["method", "worst_cos", "mean_cos", "var_cos", "conflict_rate", "steps"]
    sections.append("## Table S1: update harmony (mean ± s.e.m. over seeds)\n\n" + markdown_table(tsd, cols_s))
    if tsr:
        write_csv(out_dir / "tableS1_harmony.csv", tsr, list(tsr[0]))
    (out_dir / "tableS1_harmony.md").write_text(markdown_table(tsd, cols_s))

    bd, br = balancer_comparison(runs, tsr)
    if bd:
        table = markdown_table(bd, ["method", *COMPARISON_COLUMNS, "seeds"])
        sections.append("## Balancers compared (mean ± s.e.m. over seeds; gains over the base)\n\n" + table)
        write_csv(out_dir / "balancers.csv", br, list(br[0]))
        (out_dir / "balancers.md").write_text(table)

    t2d, t2r = table2(runs)
    cols2 = list(t2d[0])
    sections.append("## Table 2: cost (median over the seeds the reference ran with)\n\n" + markdown_table(t2d, cols2))
    write_csv(out_dir / "table2_cost.csv", t2r, list(t2r[0]))
    (out_dir / "table2_cost.md").write_text(markdown_table(t2d, cols2))

    if make_plots:
        plots(runs, out_dir)
    text = "\n".join(sections)
    (out_dir / "report.md").write_text(text)
    return text
