"""The ShapesBench run records (``runs/*.json``, written by :mod:`marble_trl.shapesbench.bench`) as the report's
tables and plots read them: loading them, the methods present in catalogue order, the runs of the score tables, and
the per-step cosines of an update with the rewards that had signal in that step.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .methods import all_methods


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
