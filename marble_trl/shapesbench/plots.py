"""The ShapesBench figures from the run records: the training-reward curves (``reward_curves.png``), MARBLE's
coefficient trajectories and the sequential baseline's stage weights (``coefficients.png``), the histogram of the
worst-reward cosine per step (``cosine_hist.png``) and seed 0's held-out images, one row per model (``samples.png``).
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from .bench import eval_images
from .comparison import MULTI_REWARD_ORDER
from .records import _cosine_steps, _method_order, _score_runs
from .scorers import REWARD_NAMES


def _series(run: dict[str, Any], key: str) -> tuple[list[int], list[float]]:
    xs, ys = [], []
    for h in run["log_history"]:
        if key in h and h[key] is not None and "step" in h:
            xs.append(int(h["step"]))
            ys.append(float(h[key]))
    return xs, ys


def _mean_curve(runs: Sequence[dict[str, Any]], key: str, smooth: int = 3) -> tuple[list[int], list[float]]:
    acc: dict[int, list[float]] = defaultdict(list)
    for r in runs:
        for x, y in zip(*_series(r, key)):
            acc[x].append(y)
    xs = sorted(acc)
    ys = [statistics.fmean(acc[x]) for x in xs]
    if smooth > 1 and len(ys) >= smooth:
        ys = [statistics.fmean(ys[max(0, i - smooth + 1) : i + 1]) for i in range(len(ys))]
    return xs, ys


def plots(runs: Sequence[dict[str, Any]], out_dir: Path) -> list[Path]:
    """Reward curves, MARBLE coefficient trajectories and cosine histograms as PNG files."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    runs = _score_runs(runs)
    methods = _method_order(runs)
    multi = [m for m in methods if m in MULTI_REWARD_ORDER]
    by_method = {m: [r for r in runs if r["method"] == m] for m in methods}
    files = []

    fig, axes = plt.subplots(1, len(REWARD_NAMES), figsize=(4 * len(REWARD_NAMES), 3.4), squeeze=False)
    for ax, name in zip(axes[0], REWARD_NAMES):
        for m in [*multi, f"only_{name}"]:
            if m not in by_method:
                continue
            xs, ys = _mean_curve(by_method[m], f"rewards/{name}/mean")
            if xs:
                specialist = m.startswith("only_")
                label = "that reward's specialist (only_*)" if specialist else m
                ax.plot(xs, ys, label=label, linestyle="--" if specialist else "-", color="k" if specialist else None)
        ax.set_title(f"{name} (training batch, mean over seeds)", fontsize=9)
        ax.set_xlabel("step")
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    files.append(out_dir / "reward_curves.png")
    fig.savefig(files[-1], dpi=110)
    plt.close(fig)

    coef_methods = [m for m in ("marble", "marble_every_step", "sequential") if m in by_method]
    fig, axes = plt.subplots(1, max(1, len(coef_methods)), figsize=(5 * max(1, len(coef_methods)), 3.4), squeeze=False)
    for ax, m in zip(axes[0], coef_methods):
        for k, name in enumerate(REWARD_NAMES):
            if m == "sequential":
                hist = by_method[m][0].get("stage_weights") or []
                xs, ys = list(range(len(hist))), [w[k] for w in hist]
            else:
                xs, ys = _mean_curve(by_method[m], f"marble/alpha_bar/{name}", smooth=1)
            if xs:
                ax.plot(xs, ys, marker="o", markersize=3, label=name)
        ax.set_title(f"{m}: {'stage weights' if m == 'sequential' else 'alpha_bar (mean over seeds)'}", fontsize=9)
        ax.set_xlabel("step")
        ax.set_ylim(-0.02, 1.02)
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    files.append(out_dir / "coefficients.png")
    fig.savefig(files[-1], dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6, 3.6))
    bins = [i / 10 for i in range(-10, 11)]
    for m in multi:
        worst = [min(c) for r in by_method[m] for c in _cosine_steps(r)]
        if worst:
            ax.hist(worst, bins=bins, histtype="step", linewidth=1.5, label=f"{m} (n={len(worst)})", density=True)
    ax.axvline(0.0, color="k", linewidth=0.8)
    ax.set_xlabel("worst-reward cosine min_k cos(update, g_k) per step")
    ax.set_ylabel("density")
    ax.legend(fontsize=7)
    fig.tight_layout()
    files.append(out_dir / "cosine_hist.png")
    fig.savefig(files[-1], dpi=110)
    plt.close(fig)
    grid = sample_grid(runs, out_dir)
    if grid is not None:
        files.append(grid)
    return files


def sample_grid(runs: Sequence[dict[str, Any]], out_dir: Path, per_family: int = 4) -> Path | None:
    """``samples.png``: seed 0's held-out images (first image of the first ``per_family`` captions of every family),
    one row per model (base first)."""
    import matplotlib.pyplot as plt
    import torch

    from .world import FAMILIES

    rows: list[tuple[str, Any]] = []
    base = None
    for m in _method_order(runs):
        path = out_dir / "runs" / f"{m}-seed0.images.pt"
        if not path.is_file():
            continue
        data = torch.load(path)
        base = data["base"] if data.get("base") is not None else base
        rows.append((m, data["eval"]))
    if base is not None:
        rows.insert(0, ("base", base))
    if not rows:
        return None
    budget = runs[0]["budget"]
    scenes = eval_images(budget)  # one scene per image; a caption's first image is its first occurrence
    firsts = [i for i, s in enumerate(scenes) if i == 0 or s.prompt != scenes[i - 1].prompt]
    picks = [i for f in FAMILIES for i in [j for j in firsts if scenes[j].family == f][:per_family]]
    fig, axes = plt.subplots(len(rows), len(picks), figsize=(0.9 * len(picks) + 1.6, 0.95 * len(rows) + 0.6))
    axes = np.atleast_2d(axes)
    for r, (name, images) in enumerate(rows):
        for c, i in enumerate(picks):
            ax = axes[r][c]
            ax.imshow(images[i].permute(1, 2, 0).numpy(), interpolation="nearest")
            ax.set_xticks([])
            ax.set_yticks([])
            if r == 0:
                ax.set_title(scenes[i].prompt, fontsize=5)
            if c == 0:
                ax.set_ylabel(name, fontsize=6, rotation=0, ha="right", va="center")
    fig.tight_layout()
    path = out_dir / "samples.png"
    fig.savefig(path, dpi=130)
    plt.close(fig)
    return path
