"""Summaries of per-reward scores across models: mean and standard error, and the paper's composite z-score.

The MARBLE paper ranks models on several rewards at once by a composite: for every reward column, the z-score of each
model against the models being compared (mean and population standard deviation over those models), then the mean
of a model's z-scores over the columns. A column where every model scores the same carries no ranking information and
contributes 0. ``marble-trl evaluate`` and ShapesBench both report it.
"""

from __future__ import annotations

import csv
import math
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path


def mean_sem(values: Iterable[float | None]) -> tuple[float, float, int]:
    """Mean, standard error of the mean (sample std / sqrt(n)) and count of the non-``None`` values.

    ``None`` values (a reward that does not apply to a prompt) are skipped; no value gives ``(nan, nan, 0)``; one
    value gives a standard error of ``nan``.
    """
    xs = [float(v) for v in values if v is not None]
    n = len(xs)
    if n == 0:
        return math.nan, math.nan, 0
    mean = sum(xs) / n
    if n == 1:
        return mean, math.nan, 1
    var = sum((x - mean) ** 2 for x in xs) / (n - 1)
    return mean, math.sqrt(var / n), n


def composite_zscores(
    table: Mapping[str, Mapping[str, float]],
    columns: Sequence[str] | None = None,
    lower_is_better: Iterable[str] = (),
) -> dict[str, float]:
    """The composite score of every model: the mean over reward columns of the model's z-score in that column.

    Args:
        table: ``{model: {column: score}}``; every model needs every column used.
        columns: the columns to use (default: the columns of the first model, in order).
        lower_is_better: columns whose z-score is negated (e.g. a loss).

    A column's z-score uses the mean and the population standard deviation over the models compared; a column with
    zero spread contributes 0 to every model. Non-finite scores raise, naming the model and the column.
    """
    models = list(table)
    if not models:
        return {}
    cols = list(columns) if columns is not None else list(table[models[0]])
    if not cols:
        raise ValueError("composite_zscores needs at least one reward column.")
    flip = set(lower_is_better)
    totals = dict.fromkeys(models, 0.0)
    for col in cols:
        values = []
        for model in models:
            if col not in table[model]:
                raise KeyError(f"Model {model!r} has no score for column {col!r}; every model needs every column.")
            value = float(table[model][col])
            if not math.isfinite(value):
                raise ValueError(f"Model {model!r} has a non-finite score {value} for column {col!r}.")
            values.append(value)
        mean = sum(values) / len(values)
        std = math.sqrt(sum((v - mean) ** 2 for v in values) / len(values))
        if std <= 1e-12 * max(1.0, abs(mean)):
            continue
        sign = -1.0 if col in flip else 1.0
        for model, value in zip(models, values):
            totals[model] += sign * (value - mean) / std
    return {model: total / len(cols) for model, total in totals.items()}


def _fmt(value: object, digits: int) -> str:
    if isinstance(value, float):
        return "nan" if math.isnan(value) else f"{value:.{digits}f}"
    return str(value)


def markdown_table(rows: Sequence[Mapping[str, object]], columns: Sequence[str], digits: int = 4) -> str:
    """A GitHub-flavoured markdown table of ``rows`` (dicts) restricted to ``columns``; floats to ``digits``."""
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for row in rows:
        lines.append("| " + " | ".join(_fmt(row.get(c, ""), digits) for c in columns) + " |")
    return "\n".join(lines) + "\n"


def write_csv(path: str | Path, rows: Sequence[Mapping[str, object]], columns: Sequence[str]) -> None:
    """Write ``rows`` (dicts) to a CSV file with the header ``columns``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=list(columns), extrasaction="ignore")
        writer.writeheader()
        for row in rows:
            writer.writerow({c: row.get(c, "") for c in columns})
