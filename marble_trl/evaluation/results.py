"""The results of an evaluation: each reward's summary over the scored images (mean, standard deviation, standard
error, count, and the mean per prompt source), and what ``marble-trl evaluate`` writes from them across models: the
``results.md`` / ``results.csv`` tables with the paper's composite (:mod:`marble_trl.evaluation.scores`), the
side-by-side comparison sheet and the reward bar chart.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .scores import composite_zscores, markdown_table, mean_sem, write_csv

logger = logging.getLogger(__name__)


def summarize_scores(
    names: Sequence[str], rows: Sequence[dict[str, Any]], sources: Sequence[str | None] | None = None
) -> dict[str, float]:
    """``{name}/mean``, ``{name}/std`` (population), ``{name}/sem`` and ``{name}/count`` of each reward over ``rows``
    (dicts ``{name: score or None}``); with ``sources``, also ``{name}/{source}/mean`` for each source where the reward
    applies to at least one sample."""
    out: dict[str, float] = {}
    for name in names:
        values = [r.get(name) for r in rows]
        mean, sem, n = mean_sem(values)
        xs = [float(v) for v in values if v is not None]
        std = math.sqrt(sum((x - mean) ** 2 for x in xs) / n) if n else math.nan
        out.update({f"{name}/mean": mean, f"{name}/std": std, f"{name}/sem": sem, f"{name}/count": float(n)})
        if sources is not None:
            for source in sorted({s for s in sources if s is not None}):
                sub_mean, _, sub_n = mean_sem([v for v, s in zip(values, sources) if s == source])
                if sub_n:  # a reward that applies to no sample of a source says nothing about it
                    out[f"{name}/{source}/mean"] = sub_mean
    return out


def save_comparison(
    cells: Sequence[tuple[str, Sequence[Path], Sequence[dict[str, Any] | None]]],
    row_labels: Sequence[Sequence[str] | str],
    path: str | os.PathLike,
) -> Path:
    """The side-by-side sheet: one column per model (``(name, image files, scores)`` in ``cells``, the files in the
    same (prompt, image) order for every model), one row per (prompt, image)."""
    from .samples import comparison_sheet

    names = [name for name, _, _ in cells]
    images = [[files[r] for _, files, _ in cells] for r in range(len(row_labels))]
    scores = [[s[r] for _, _, s in cells] for r in range(len(row_labels))]
    sheet = comparison_sheet(names, images, row_labels, scores)
    path = Path(path)
    sheet.save(path)
    return path


def save_reward_chart(results: Sequence[dict[str, Any]], names: Sequence[str], path: str | os.PathLike) -> Path | None:
    """A bar chart per reward of each model's mean with its standard error (``results`` as returned by
    :func:`~marble_trl.evaluation.run.evaluate_models`). Needs matplotlib (the ``bench`` / ``dev`` extras): without it,
    logs a note and returns ``None``."""
    try:
        from matplotlib import colormaps
        from matplotlib.figure import Figure  # no pyplot: the global backend is left alone
    except ImportError:
        logger.warning(
            "rewards.png not written: matplotlib is not installed (pip install 'marble_trl[bench]'); the same numbers "
            "are in results.md."
        )
        return None
    models = [str(r["model"]) for r in results]
    k = max(1, len(names))
    fig = Figure(figsize=(max(3.0, 0.6 * len(models) + 1.6) * k, 3.6), layout="constrained")
    axes = fig.subplots(1, k, squeeze=False)
    colors = [colormaps["tab10"](m % 10) for m in range(len(models))]
    for ax, name in zip(axes[0], names):
        means = [float(r.get(f"{name}/mean", math.nan)) for r in results]
        sems = [float(r.get(f"{name}/sem", math.nan)) for r in results]
        xs = list(range(len(models)))
        ax.bar(
            xs, [m if math.isfinite(m) else 0.0 for m in means],
            yerr=[s if math.isfinite(s) else 0.0 for s in sems], color=colors, capsize=4,
        )  # fmt: skip
        for x, m, s in zip(xs, means, sems):
            text = f"{m:.3g}" if math.isfinite(m) else "n/a"
            y = (m if math.isfinite(m) else 0.0) + (s if math.isfinite(s) else 0.0) * (1 if m >= 0 else -1)
            ax.annotate(
                text, (x, y), textcoords="offset points", xytext=(0, 3 if m >= 0 else -10), ha="center", fontsize=8
            )
        ax.set_title(name)
        ax.set_xticks(xs, models, rotation=30 if len(models) > 2 else 0, ha="right" if len(models) > 2 else "center")
        ax.axhline(0.0, color="0.5", linewidth=0.8)
        ax.margins(y=0.15)
    fig.suptitle("mean reward per model (error bars: standard error of the mean)", fontsize=10)
    path = Path(path)
    fig.savefig(path, dpi=100)
    return path


def write_results(results: list[dict[str, Any]], names: Sequence[str], output: str | os.PathLike) -> None:
    """Add the composite to ``results`` and write ``results.md`` and ``results.csv``."""
    output = Path(output)
    table = {r["model"]: {n: r[f"{n}/mean"] for n in names} for r in results}
    usable = [n for n in names if all(math.isfinite(table[m][n]) for m in table)]
    composite = composite_zscores(table, usable) if usable else {}
    for r in results:
        r["composite"] = composite.get(r["model"], math.nan)
    columns = ["model", *[c for n in names for c in (f"{n}/mean", f"{n}/sem")], "composite", "images", "lora"]
    text = "# Evaluation results\n\n" + markdown_table(results, columns[:-1])
    text += (
        "\nmean and standard error of the mean over prompts x images; composite: the mean over rewards of each "
        "model's z-score against the models in this table"
    )
    skipped = [n for n in names if n not in usable]
    if skipped:
        text += f" (left out, not scored on every model: {', '.join(skipped)})"
    text += ".\n"
    by_source = [k for n in names for k in sorted({k for r in results for k in r if k.startswith(f"{n}/")})
                 if k.count("/") == 2]  # fmt: skip
    if by_source:
        text += "\n## By prompt source\n\n" + markdown_table(results, ["model", *by_source])
        text += "\nmean of each reward on each prompt source where it applies (`source` column).\n"
    (output / "results.md").write_text(text, encoding="utf-8")
    write_csv(output / "results.csv", results, [*columns[:-1], *by_source, columns[-1]])
