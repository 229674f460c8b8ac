"""The benchmark scripts that are not ShapesBench's: ``benchmarks/step_throughput.py`` reports per-round spread and
transformer call counts, warns where rounds disagree, and times the released MARBLE."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parents[1] / "benchmarks" / "step_throughput.py"


def _module():
    spec = importlib.util.spec_from_file_location("step_throughput", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _run(step_time: float, calls=(240, 72)) -> dict:
    return {"step_time": step_time, "peak": 1.0, "unit": "GiB", "grad_calls": calls[0], "no_grad_calls": calls[1]}


def test_summary_reports_the_spread_and_warns_when_rounds_or_calls_disagree():
    results = {
        "weighted_sum": [_run(1.0), _run(1.0), _run(1.0)],
        "marble_n10": [_run(0.85), _run(0.85), _run(0.98)],  # the same calls, timed 1.176x apart: a busy machine
        "marble_n1": [_run(2.0, (500, 72)), _run(2.02, (500, 72)), _run(1.98, (500, 72))],
    }
    rows, warnings = _module().summarise(results, spread_warning=0.05)
    n10 = next(r for r in rows if r["config"] == "marble_n10")
    assert n10["speed"] == pytest.approx(1 / 0.85) and n10["speed_min"] == pytest.approx(1 / 0.98)
    assert any("marble_n10: the rounds disagree" in w for w in warnings)
    assert any("marble_n10: the same transformer calls as weighted_sum (240 + 72)" in w for w in warnings)
    assert not any(w.startswith("marble_n1:") for w in warnings)  # consistent rounds, different calls


@pytest.mark.slow
def test_worker_times_the_released_procedure_and_counts_its_calls(tmp_path):
    """One worker run of the released procedure on a one-layer tiny model, 10 timed steps after 1 warm-up step:
    step 0 solves its 3 pairs, step 10 its first pair (one more forward with gradients, for the per-reward pass)."""
    cmd = [sys.executable, str(SCRIPT), "--worker", "marble_released", "--layers", "1", "--latent-size", "4"]
    cmd += ["--warmup", "1", "--steps", "10", "--batch", "4", "--num-generations", "4", "--prompts-per-step", "1"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    record = json.loads(next(ln for ln in out.stdout.splitlines()[::-1] if ln.startswith("{")))
    assert record["config"] == "marble_released" and record["refreshes"] == 4
    # 10 steps x 3 pairs with gradients, + the step-10 solve's engine forward; without: 4 rollout sampler steps and
    # the old-policy and reference forwards of each pair
    assert record["grad_calls"] == 31 and record["no_grad_calls"] == 10 * (4 + 3 * 2)
    assert record["run_time"] > 0


def _chaos():
    path = Path(__file__).parents[1] / "benchmarks" / "chaos_soak.py"
    spec = importlib.util.spec_from_file_location("chaos_soak", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_chaos_schedule_is_seeded_and_covers_every_phase():
    chaos = _chaos()
    plan = chaos.schedule(0, 10, 200)
    assert plan == chaos.schedule(0, 10, 200) != chaos.schedule(1, 10, 200)
    assert {phase for phase, _ in plan} == set(chaos.PHASES)
    steps = [n for _, n in plan]
    assert steps == sorted(set(steps)) and 1 <= steps[0] and steps[-1] < 190  # spread, before the last steps


@pytest.mark.heavy
@pytest.mark.slow
def test_chaos_soak_killed_runs_end_where_the_uninterrupted_run_ends(tmp_path):
    """SIGKILL inside the last checkpoint save (after the Trainer's files) and at a MARBLE refresh, each resumed from
    the newest valid checkpoint: the final checkpoint and LoRA equal the uninterrupted run's tensor for tensor (the
    soak's figure on a 4-step run; a kill before the optimizer step and the others: benchmarks/chaos_soak.py)."""
    figure = _chaos().soak(
        tmp_path, steps=4, kills=0, seed=0, save_steps=2, eval_steps=2,
        plan=[("save", 3), ("refresh", 1)],
    )  # fmt: skip
    outcomes = [outcome.split(" (pid")[0] for _, outcome in figure["events"]]
    assert outcomes == ["killed at save after step 4", "killed at refresh after step 3"]  # refreshes: steps 1, 4
    assert figure["differing"] == []
