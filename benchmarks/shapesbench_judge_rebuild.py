"""How much do ShapesBench's judge-based scores depend on the exact bits of the shipped judges?

The judges are trained deterministically, but only bit for bit on one torch build and CPU: elsewhere their training
drifts by rounding, which 1,000 AdamW steps amplify (``verify-shipped`` prints how far). This script trains the
three judges again *on this machine* from the shipped configs (into ``--cache``, reused on a rerun), rescores every
run's saved held-out images (``runs/*.images.pt``) with them, and prints per method, mean over seeds, each
judge-based reward (``alignment``, ``preference``, ``judge``, ``retrieval``) and its gain over the base, with the
shipped judges and with the rebuilt ones side by side. docs/shapesbench.md#limitations reads it.

    python benchmarks/shapesbench_judge_rebuild.py --out benchmarks/results/shapesbench-v2.1
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from pathlib import Path

JUDGE_REWARDS = ("alignment", "preference", "judge", "retrieval")


def rebuild_judges(cache: Path) -> None:
    """Point the judges at ``cache`` (training them there when missing), never at the shipped files."""
    os.environ["MARBLE_TRL_CACHE"] = str(cache)
    from marble_trl.shapesbench import judges

    judges.shipped_judge = lambda key: None
    judges.load_judge.cache_clear()
    for config in judges.JUDGES.values():
        judges.build_judge(config, quiet=False)


def rescore(out: Path, cache: Path) -> dict[str, dict[str, list[float]]]:
    """``{run: {reward: [shipped, rebuilt]}}`` for every record with saved images, plus ``base`` (from weighted_sum)."""
    import torch

    from marble_trl.evaluation.scores import mean_sem
    from marble_trl.shapesbench.bench import eval_inputs
    from marble_trl.shapesbench.scorers import score_all

    rebuild_judges(cache)
    rows: dict[str, dict[str, list[float]]] = {}
    for path in sorted((out / "runs").glob("*.json")):
        images_path = path.with_name(path.stem + ".images.pt")
        if not images_path.is_file():
            continue
        record = json.loads(path.read_text())
        saved = torch.load(images_path)
        prompts, columns = eval_inputs(record["budget"])
        targets = [(path.stem, "eval", "eval")]
        if record.get("base_eval") and saved.get("base") is not None:
            targets.append((f"base-seed{record['seed']}", "base", "base_eval"))
        for name, images_key, record_key in targets:
            scores = score_all(prompts, saved[images_key].float() / 255, columns, names=JUDGE_REWARDS)
            rows[name] = {r: [record[record_key][r], mean_sem(scores[r])[0]] for r in JUDGE_REWARDS}
        print(f"rescored {path.stem}", flush=True)
    return rows


def table(rows: dict[str, dict[str, list[float]]]) -> str:
    by_method: dict[str, list[str]] = {}
    for run in rows:
        by_method.setdefault(run.rsplit("-seed", 1)[0], []).append(run)
    base = {r: [statistics.mean(rows[k][r][i] for k in by_method["base"]) for i in (0, 1)] for r in JUDGE_REWARDS}
    head = " | ".join(f"{r}: shipped / rebuilt (gain)" for r in JUDGE_REWARDS)
    lines = [f"| method | seeds | {head} |", "|---" * (len(JUDGE_REWARDS) + 2) + "|"]
    for method, runs in by_method.items():
        cells = []
        for r in JUDGE_REWARDS:
            s, b = (statistics.mean(rows[k][r][i] for k in runs) for i in (0, 1))
            cells.append(f"{s:.3f} / {b:.3f} ({s - base[r][0]:+.3f} / {b - base[r][1]:+.3f})")
        lines.append(f"| {method} | {len(runs)} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/shapesbench-v2.1"))
    parser.add_argument("--cache", type=Path, default=Path("outputs/judge-rebuild"))
    args = parser.parse_args()
    print(table(rescore(args.out, args.cache)))


if __name__ == "__main__":
    main()
