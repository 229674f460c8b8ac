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
- the plots (:mod:`.plots`): ``reward_curves.png``, ``coefficients.png``, ``cosine_hist.png``, ``samples.png``.
"""

from __future__ import annotations

import math
import statistics
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..evaluation.scores import composite_zscores, markdown_table, mean_sem, write_csv
from .bench import images_per_prompt
from .comparison import COLUMNS as COMPARISON_COLUMNS
from .comparison import MULTI_REWARD_ORDER, balancer_comparison
from .methods import all_methods
from .plots import plots
from .records import _cosine_steps, _method_order, _score_runs, load_runs
from .scorers import EVAL_NAMES, REWARD_NAMES, STRESS_REWARDS


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
