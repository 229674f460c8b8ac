"""The pre-registered confirmatory comparison of ShapesBench (docs/shapesbench.md, "Confirmatory protocol"): paired
statistics over seeds, the minimum detectable effect, and the verdict of each hypothesis, from the run records.

For method m, seed s and training reward r: the gain over the base ``g = score(m, s, r) - score(base, r)`` (the same
held-out images and noise), the paired difference against the weighted sum ``d = score(m, s, r) - score(ws, s, r)``
(the same seed), and the worst gain ``min_r g``. Each is reported as its mean over the seeds, the s.e.m. (sd / sqrt n)
and the one-sided 95% lower bound ``mean - t(0.95, n - 1) s.e.m.``; a difference is **shown** when ``|mean| > 2
s.e.m.``, **confirmed** (95%, one-sided) when the bound is past 0 in the hypothesis' direction. The minimum detectable
effect is 2 x the paired s.e.m.

    python -m marble_trl.shapesbench confirm --out benchmarks/results/shapesbench-confirm
"""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .scorers import REWARD_NAMES

# One-sided 95% quantiles of Student's t by degrees of freedom (scipy.stats.t.ppf(0.95, df)).
T95 = {1: 6.314, 2: 2.920, 3: 2.353, 4: 2.132, 5: 2.015, 6: 1.943, 7: 1.895, 8: 1.860, 9: 1.833, 10: 1.812}
METHODS = (
    "weighted_sum",
    "normalize_then_sum",
    "marble",
    "marble_released",
    "marble_masked",
    "marble_every_step",
    "nash_mtl",
    "marble_norm_aware_hold",  # H6, registered after the other seven had run
)


@dataclass(frozen=True)
class Estimate:
    """A mean over seeds with its s.e.m. and one-sided 95% bounds (``n`` seeds)."""

    mean: float
    sem: float
    n: int

    @classmethod
    def of(cls, values: list[float]) -> Estimate:
        n = len(values)
        sem = statistics.stdev(values) / math.sqrt(n) if n > 1 else math.nan
        return cls(statistics.fmean(values), sem, n)

    @property
    def lower(self) -> float:
        return self.mean - T95.get(self.n - 1, 1.645) * self.sem

    @property
    def upper(self) -> float:
        return self.mean + T95.get(self.n - 1, 1.645) * self.sem

    @property
    def shown(self) -> bool:
        return abs(self.mean) > 2 * self.sem

    def __str__(self) -> str:
        return f"{self.mean:+.3f} ± {self.sem:.3f}"


def load(out_dir: str | Path, methods: tuple[str, ...] = METHODS) -> tuple[dict[str, dict[int, dict]], dict]:
    """``{method: {seed: held-out scores}}`` of the records under ``out_dir/runs`` and the base's scores."""
    runs: dict[str, dict[int, dict]] = {m: {} for m in methods}
    base = None
    for path in sorted(Path(out_dir, "runs").glob("*.json")):
        record = json.loads(path.read_text())
        if record["method"] in runs:
            runs[record["method"]][int(record["seed"])] = record["eval"]
        if record.get("base_eval") is not None:
            base = record["base_eval"]
    if base is None:
        raise ValueError(f"{out_dir}: no record holds the base's scores (a weighted_sum run evaluates the base).")
    return runs, base


def paired_tables(runs: dict[str, dict[int, dict]], base: dict, rewards=tuple(REWARD_NAMES)) -> dict[str, Any]:
    """Per method: per-reward gains over the base and differences against the weighted sum (paired by seed), the
    worst gain, and the worst gain's difference against the weighted sum."""
    ws = runs["weighted_sum"]
    out: dict[str, Any] = {}
    for method, seeds in runs.items():
        common = sorted(set(seeds) & set(ws))
        if not seeds:
            continue
        gains = {r: Estimate.of([seeds[s][r] - base[r] for s in sorted(seeds)]) for r in rewards}
        versus = {r: Estimate.of([seeds[s][r] - ws[s][r] for s in common]) for r in rewards} if common else {}
        worst = [min(seeds[s][r] - base[r] for r in rewards) for s in sorted(seeds)]
        worst_ws = {s: min(ws[s][r] - base[r] for r in rewards) for s in common}
        out[method] = {
            "seeds": sorted(seeds),
            "gain": gains,
            "vs_weighted_sum": versus,
            "worst_gain": Estimate.of(worst),
            "worst_gain_per_seed": worst,
            "worst_vs_weighted_sum": Estimate.of(
                [min(seeds[s][r] - base[r] for r in rewards) - worst_ws[s] for s in common]
            )
            if common
            else None,  # fmt: skip
        }
    return out


def verdicts(tables: dict[str, Any]) -> list[tuple[str, str, str]]:
    """The pre-registered hypotheses H1-H6: ``(hypothesis, measured, verdict)``."""
    rows = []

    def above_base(method: str, tag: str) -> None:
        if method not in tables:
            return
        gains = tables[method]["gain"]
        bounds = ", ".join(f"{r} {g} (bound {g.lower:+.3f})" for r, g in gains.items())
        ok = all(g.lower > 0 for g in gains.values())
        shown = [r for r, g in gains.items() if g.lower > 0]
        verdict = "confirmed" if ok else f"not confirmed: above the base with 95% confidence on {shown or 'none'}"
        rows.append((f"{tag}. {method} above the base on every training reward", bounds, verdict))

    def worst_beats_ws(method: str, tag: str) -> None:
        if method not in tables or tables[method]["worst_vs_weighted_sum"] is None:
            return
        d = tables[method]["worst_vs_weighted_sum"]
        verdict = "shown" if d.mean > 2 * d.sem else ("shown the other way" if d.mean < -2 * d.sem else "not shown")
        rows.append((f"{tag}. {method}'s worst gain beats the weighted sum's", f"{d} (paired)", verdict))

    above_base("marble_released", "H1")
    above_base("marble_every_step", "H1b")
    worst_beats_ws("marble_released", "H2")
    worst_beats_ws("marble_every_step", "H2b")
    rows.extend(_h3(tables))
    worst_beats_ws("nash_mtl", "H4")
    if "marble" in tables:
        g = tables["marble"]["gain"]["count"]
        verdict = "shown" if g.mean < -2 * g.sem else ("shown the other way" if g.mean > 2 * g.sem else "not shown")
        rows.append(("H5. marble (N = 10) loses count to the base", str(g), verdict))
    worst_beats_ws("marble_norm_aware_hold", "H6")
    above_base("marble_norm_aware_hold", "H6")
    return rows


def _h3(tables: dict[str, Any]) -> list[tuple[str, str, str]]:
    """H3 needs the per-seed scores, kept in ``tables["_runs"]``: masked minus paper MARBLE, paired by seed."""
    runs = tables.get("_runs")
    if runs is None or not runs.get("marble_masked") or not runs.get("marble"):
        return []
    seeds = sorted(set(runs["marble_masked"]) & set(runs["marble"]))
    rows = []
    for reward in ("count", "position"):
        d = Estimate.of([runs["marble_masked"][s][reward] - runs["marble"][s][reward] for s in seeds])
        verdict = "shown" if d.mean > 2 * d.sem else ("shown the other way" if d.mean < -2 * d.sem else "not shown")
        rows.append((f"H3. the masked solve raises {reward} (marble_masked - marble)", f"{d} (paired)", verdict))
    return rows


def report(out_dir: str | Path, rewards=tuple(REWARD_NAMES)) -> str:
    """The confirmatory tables and verdicts as markdown (also written to ``out_dir/confirm.md``)."""
    runs, base = load(out_dir)
    tables = paired_tables(runs, base, rewards)
    tables["_runs"] = runs
    methods = [m for m in METHODS if m in tables]
    n = {m: len(tables[m]["seeds"]) for m in methods}
    lines = [f"Seeds: {sorted({s for m in methods for s in tables[m]['seeds']})}; base: the shipped model.", ""]
    lines += ["**Gain over the base** (mean ± s.e.m. over seeds; **bold**: its one-sided 95% bound is above 0):", ""]
    lines += ["| method | n | " + " | ".join(rewards) + " | worst gain | worst gain per seed |"]
    lines += ["|---" * (len(rewards) + 4) + "|"]
    base_row = " | ".join(f"{base[r]:.3f}" for r in rewards)
    lines.append(f"| base (score) | | {base_row} | | |")
    for m in methods:
        t = tables[m]
        cells = [f"**{t['gain'][r]}**" if t["gain"][r].lower > 0 else str(t["gain"][r]) for r in rewards]
        per_seed = ", ".join(f"{w:+.3f}" for w in t["worst_gain_per_seed"])
        lines.append(f"| {m} | {n[m]} | " + " | ".join(cells) + f" | {t['worst_gain']} | {per_seed} |")
    lines += ["", "**Against the weighted sum, paired by seed** (**bold**: more than 2 s.e.m. from 0):", ""]
    lines += ["| method | " + " | ".join(rewards) + " | worst gain |", "|---" * (len(rewards) + 2) + "|"]
    for m in methods:
        t = tables[m]
        if m == "weighted_sum" or not t["vs_weighted_sum"]:
            continue
        cells = [f"**{d}**" if d.shown else str(d) for d in t["vs_weighted_sum"].values()]
        worst = t["worst_vs_weighted_sum"]
        lines.append(f"| {m} | " + " | ".join(cells) + f" | {'**' + str(worst) + '**' if worst.shown else worst} |")
    lines += ["", "**Minimum detectable effect** (2 x the paired s.e.m., mean over the methods):", ""]
    lines += ["| comparison | " + " | ".join(rewards) + " | worst gain |", "|---" * (len(rewards) + 2) + "|"]
    others = [m for m in methods if m != "weighted_sum"]
    for label, key in (("against the base", "gain"), ("against the weighted sum", "vs_weighted_sum")):
        mdes = []
        for r in rewards:
            sems = [tables[m][key][r].sem for m in others if tables[m][key]]
            mdes.append(f"{2 * statistics.fmean(sems):.3f}" if sems else "n/a")
        worst_key = "worst_gain" if key == "gain" else "worst_vs_weighted_sum"
        sems = [tables[m][worst_key].sem for m in others if tables[m][worst_key] is not None]
        lines.append(f"| {label} | " + " | ".join(mdes) + f" | {2 * statistics.fmean(sems):.3f} |")
    lines += ["", "**Hypotheses** (pre-registered; docs/shapesbench.md):", "", "| hypothesis | measured | verdict |"]
    lines += ["|---|---|---|"]
    lines += [f"| {h} | {m} | {v} |" for h, m, v in verdicts(tables)]
    text = "\n".join(lines) + "\n"
    Path(out_dir, "confirm.md").write_text(text)
    return text
