"""The balancer comparison of the ShapesBench report (``balancers.md``): MARBLE as in the paper, its beyond-the-paper
variants (norm-aware amortisation, estimated refreshes, every-step refreshes) and the Gram-based aggregators of
multi-objective optimisation, side by side on what does not depend on which other methods ran.

Per method, mean +- s.e.m. over seeds of: the worst and the mean training-reward gain over the base (held-out
images), the mean held-out-only gain (over the rewards never trained on that every record has), and the all-step
conflict rate (Table S1: the share of steps whose update has a negative cosine with some reward's gradient) and, for
MARBLE's variants, the share of (refresh, training reward) pairs in which the reward had no signal (no group with
spread: its alpha* is 0 there). The composite z-score of Table 1 is left out: it is standardised over the methods present in each seed, so it moves when methods are added.
Throughput is measured side by side by ``benchmarks/step_throughput.py`` (docs/marble.md), not here: these runs share
the machine and log per-step diagnostics.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

from ..balance.registry import AGGREGATORS
from ..evaluation.scores import mean_sem
from .scorers import EVAL_NAMES, REWARD_NAMES

# The multi-reward methods beyond the paper's set (ablations, other weightings), in table order.
BEYOND_PAPER = (
    "marble_norm_aware",
    "marble_hold",
    "marble_norm_aware_hold",
    "marble_estimated",
    "marble_every_step_estimated",
    "marble_every_step_estimated_s3",
    *AGGREGATORS,
)
MULTI_REWARD_ORDER = (
    "weighted_sum",
    "normalize_then_sum",
    "sequential",
    "marble",
    "marble_every_step",
    "fixed_uniform",
    *BEYOND_PAPER,
)
BALANCERS = ("weighted_sum", "marble", "marble_every_step", *BEYOND_PAPER)  # the balancer comparison's rows
HELD_OUT = tuple(n for n in EVAL_NAMES if n not in REWARD_NAMES)
COLUMNS = ("worst_gain", "mean_gain", "held_out_gain", "conflict_rate", "silent_refreshes")


def silent_refreshes(run: dict[str, Any]) -> float:
    """The share of (QP refresh, training reward) pairs of a run in which the reward had no signal: every group of
    the step tied or not applicable (``rewards/<name>/frac_zero_std`` 1). ``nan`` for a run without refreshes."""
    pairs = [
        step.get(f"rewards/{name}/frac_zero_std", 1.0) >= 1.0
        for step in run.get("log_history", [])
        for name in run["rewards"]
        if f"marble/alpha/{name}" in step
    ]
    return statistics.fmean(pairs) if pairs else float("nan")


def _rate(mean: float, sem: float, digits: int) -> str:
    if mean != mean:  # nan
        return "n/a"
    return f"{mean:.{digits}f}" if sem != sem else f"{mean:.{digits}f} ± {sem:.{digits}f}"


def _pm(mean: float, sem: float) -> str:
    if mean != mean:  # nan
        return "n/a"
    return f"{mean:+.3f}" if sem != sem else f"{mean:+.3f} ± {sem:.3f}"


def balancer_comparison(
    runs: Sequence[dict[str, Any]], harmony: Sequence[dict[str, Any]]
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Display and raw rows, from the run records and ``harmony``, Table S1's raw rows (their conflict rates, mean
    and s.e.m. over seeds)."""
    bases = {r["seed"]: r["base_eval"] for r in runs if r.get("base_eval")}
    conflict = {row["method"]: row for row in harmony}
    # the held-out rewards every record has (older records lack those added later; `report --rescore`)
    held_out = [n for n in HELD_OUT if all(n in r["eval"] for r in runs) and all(n in b for b in bases.values())]
    per_method: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for r in runs:
        base = bases.get(r["seed"])
        if r["method"] not in BALANCERS or base is None:
            continue
        gains = [r["eval"][n] - base[n] for n in REWARD_NAMES]
        stats = per_method[r["method"]]
        stats["worst_gain"].append(min(gains))
        stats["mean_gain"].append(statistics.fmean(gains))
        stats["held_out_gain"].append(statistics.fmean(r["eval"][n] - base[n] for n in held_out))
        if (silent := silent_refreshes(r)) == silent:
            stats["silent_refreshes"].append(silent)
    display, raw = [], []
    for method in (m for m in BALANCERS if m in per_method):
        stats = per_method[method]
        d: dict[str, Any] = {"method": method}
        w: dict[str, Any] = {"method": method, "seeds": len(stats["worst_gain"])}
        for key in COLUMNS[:3]:
            mean, sem, _ = mean_sem(stats[key])
            d[key], w[key], w[f"{key}_sem"] = _pm(mean, sem), mean, sem
        row = conflict.get(method)
        mean, sem = (row["conflict_rate"], row["conflict_rate_sem"]) if row else (float("nan"), float("nan"))
        d["conflict_rate"] = _rate(mean, sem, 3)
        w["conflict_rate"], w["conflict_rate_sem"] = mean, sem
        mean, sem, _ = mean_sem(stats["silent_refreshes"]) if stats["silent_refreshes"] else (float("nan"),) * 3
        d["silent_refreshes"] = _rate(mean, sem, 2)
        w["silent_refreshes"], w["silent_refreshes_sem"] = mean, sem
        d["seeds"] = w["seeds"]
        display.append(d)
        raw.append(w)
    return display, raw
