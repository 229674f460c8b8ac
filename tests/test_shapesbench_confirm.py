"""The pre-registered confirmatory analysis (``python -m marble_trl.shapesbench confirm``) on synthetic run records:
paired gains and differences by seed, one-sided bounds, the MDE, and each hypothesis' verdict."""

from __future__ import annotations

import json
import math

import pytest

from marble_trl.shapesbench.confirm import Estimate, load, paired_tables, report, verdicts

REWARDS = ("alignment", "preference", "color", "count", "position")
BASE = dict.fromkeys(REWARDS, 0.5)


def _write(out, method: str, seed: int, scores: dict, base: bool = False) -> None:
    record = {"method": method, "seed": seed, "eval": scores, "base_eval": BASE if base else None}
    (out / "runs").mkdir(parents=True, exist_ok=True)
    (out / "runs" / f"{method}-seed{seed}.json").write_text(json.dumps(record))


def test_estimate_is_the_mean_with_its_sem_and_one_sided_t_bound():
    e = Estimate.of([1.0, 2.0, 3.0, 4.0, 5.0])
    assert e.mean == 3.0 and e.sem == pytest.approx(math.sqrt(2.5) / math.sqrt(5))
    assert e.lower == pytest.approx(3.0 - 2.132 * e.sem) and e.shown


def test_paired_tables_and_verdicts_follow_the_protocol(tmp_path):
    # weighted_sum: +0.1 on every reward but count (-0.05); released: +0.2 everywhere, seed noise +-0.01
    for seed in range(5):
        noise = 0.01 * (seed - 2)
        _write(tmp_path, "weighted_sum", seed, {r: 0.6 + noise if r != "count" else 0.45 + noise for r in REWARDS},
               base=True)  # fmt: skip
        _write(tmp_path, "marble_released", seed, {r: 0.7 + noise for r in REWARDS})
        _write(tmp_path, "marble", seed, {r: 0.4 + noise if r == "count" else 0.65 for r in REWARDS})
        _write(tmp_path, "marble_masked", seed, {r: 0.45 + noise / 2 if r == "count" else 0.65 for r in REWARDS})
    runs, base = load(tmp_path)
    tables = paired_tables(runs, base, REWARDS)
    released = tables["marble_released"]
    assert released["gain"]["count"].mean == pytest.approx(0.2)
    assert (
        released["vs_weighted_sum"]["count"].mean == pytest.approx(0.25)
        and released["vs_weighted_sum"]["count"].sem < 1e-12
    )
    assert released["worst_gain"].mean == pytest.approx(0.2)
    assert released["worst_vs_weighted_sum"].mean == pytest.approx(0.25)  # ws's worst gain is count's -0.05
    tables["_runs"] = runs
    rows = {h: v for h, _, v in verdicts(tables)}
    assert rows["H1. marble_released above the base on every training reward"] == "confirmed"
    assert rows["H2. marble_released's worst gain beats the weighted sum's"] == "shown"
    assert rows["H5. marble (N = 10) loses count to the base"] == "shown"
    assert rows["H3. the masked solve raises count (marble_masked - marble)"] == "shown"  # +0.05, small spread
    assert rows["H3. the masked solve raises position (marble_masked - marble)"] == "not shown"  # no difference
    text = report(tmp_path, REWARDS)
    assert "**+0.200 ± 0.007**" in text and (tmp_path / "confirm.md").read_text() == text
    assert "| H1. marble_released above the base on every training reward |" in text
