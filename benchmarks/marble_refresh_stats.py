"""MARBLE's refresh statistics from ShapesBench run records, per reward.

For every MARBLE-family run record given (``runs/<method>-seed<k>.json``), prints over its refresh steps: the mean
QP solution ``alpha*``, the mean EMA coefficient ``alpha_bar``, the mean gradient norm over the refreshes where the
reward had signal, and the number of refreshes where it had none (no prompt of its family, or only tied groups:
gradient norm 0, ``alpha*`` 0, and Eq. 12 decays its ``alpha_bar`` by ``rho``). docs/shapesbench.md reads these.

    python benchmarks/marble_refresh_stats.py benchmarks/results/shapesbench-v2.1/runs/marble-seed*.json
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path


def refresh_stats(record: dict) -> dict[str, dict[str, float]]:
    names = list(record["rewards"])
    rows = [e for e in record["log_history"] if f"marble/alpha/{names[0]}" in e]
    if not rows:
        raise SystemExit(f"{record['method']}-seed{record['seed']}: no MARBLE refresh in its log history")
    stats = {}
    for name in names:
        norms = [e.get(f"marble/grad_norm/{name}") or 0.0 for e in rows]
        active = [g for g in norms if g > 0]
        stats[name] = {
            "alpha_star": statistics.mean(e.get(f"marble/alpha/{name}", 0.0) for e in rows),
            "alpha_bar": statistics.mean(e.get(f"marble/alpha_bar/{name}", 0.0) for e in rows),
            "grad_norm": statistics.mean(active) if active else 0.0,
            "silent": len(norms) - len(active),
            "refreshes": len(rows),
        }
    return stats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("records", nargs="+", type=Path)
    args = parser.parse_args()
    for path in args.records:
        stats = refresh_stats(json.loads(path.read_text()))
        print(f"{path.stem}:")
        for name, s in stats.items():
            print(
                f"  {name:12s} alpha* {s['alpha_star']:.2f}  alpha_bar {s['alpha_bar']:.2f}  "
                f"grad norm {s['grad_norm']:.3f}  silent {s['silent']}/{s['refreshes']}"
            )


if __name__ == "__main__":
    main()
