"""The step's reward metrics (GRPO's names: ``reward``, ``reward_std``, ``rewards/{name}/mean``, ...) and what the
reward functions logged themselves (``log_metric`` / ``log_extra``), averaged over every process."""

from __future__ import annotations

import math
import os
from typing import Any

import torch
from accelerate.utils import gather_object

from ..balance import RefreshInfo
from ..balance.advantages import group_std, group_std_is_zero
from ..evaluation.samples import write_video
from ..rewards import RewardLogs, finite_numbers
from .trackers import rollout_grid


def reward_metrics(
    rewards: torch.Tensor, names: list[str], weights: torch.Tensor, g: int, sources: list[Any] | None = None
) -> dict[str, float]:
    """Metrics of the step's gathered rewards [K, N] (NaN: not applicable), groups of ``g``; per source too."""
    metrics: dict[str, float] = {}
    source_names = sorted({str(s) for s in sources if s is not None}) if sources is not None else []
    source_masks = {n: torch.tensor([str(s) == n for s in sources]) for n in source_names}
    for k, name in enumerate(names):
        values = rewards[k]
        ok = ~torch.isnan(values)
        applicable = values[ok]
        if applicable.numel():
            metrics[f"rewards/{name}/mean"] = applicable.mean().item()
            metrics[f"rewards/{name}/std"] = applicable.std(unbiased=False).item()
        for source, in_source in source_masks.items():
            mask = ok & in_source
            if mask.any():  # a reward that informs no sample of this source logs nothing for it
                metrics[f"rewards/{name}/{source}/mean"] = values[mask].mean().item()
        metrics[f"rewards/{name}/frac_not_applicable"] = 1.0 - ok.float().mean().item()
        metrics[f"rewards/{name}/frac_zero_std"] = group_std_is_zero(values, g).float().mean().item()
    weighted = (rewards * weights[:, None]).nansum(dim=0)
    weighted[torch.isnan(rewards).all(dim=0)] = float("nan")
    metrics["reward"] = torch.nanmean(weighted).item()
    metrics["reward_std"] = group_std(weighted, g).mean().item()
    metrics["frac_reward_zero_std"] = group_std_is_zero(weighted, g).float().mean().item()
    return metrics


def flush_reward_logs(accelerator, logs: RewardLogs, batch: int) -> tuple[dict[str, float], dict[str, list[Any]]]:
    """What the rewards logged (GRPO's flush): each ``log_metric`` name averaged over all processes' values; for each
    ``log_extra`` column, the mean of its finite numbers (all processes) as ``extra/{column}``. Returns those metrics
    and this process's extra columns. Names are gathered and sorted so that every process gathers the same metrics in
    the same order."""
    device = accelerator.device

    def mean_over_processes(values: list[float]) -> float | None:
        local = torch.tensor([sum(values), len(values)], dtype=torch.float64, device=device)
        total, count = accelerator.gather(local).view(-1, 2).sum(dim=0).tolist()
        return total / count if count else None

    metrics: dict[str, float] = {}
    for name in sorted(set(gather_object(list(logs.metrics)))):
        value = mean_over_processes(logs.metrics.get(name, []))
        if value is not None:
            metrics[name] = value
    extras: dict[str, list[Any]] = {}
    for column in sorted(set(gather_object(list(logs.extras)))):
        values = logs.extras.get(column, [None] * batch)
        extras[column] = values
        value = mean_over_processes(finite_numbers(values))
        if value is not None:
            metrics[f"extra/{column}"] = value  # a user's column: documented as extra/{column} in coming-from-grpo.md
    return metrics, extras


def marble_metrics(info: RefreshInfo, names: list[str], num_refreshes: int) -> dict[str, float]:
    """A MARBLE refresh's ``marble/*`` metrics (docs/metrics.md)."""
    metrics: dict[str, float] = {}
    for k, name in enumerate(names):
        metrics[f"marble/alpha/{name}"] = float(info.alpha_used[k])
        metrics[f"marble/alpha_bar/{name}"] = float(info.alpha_bar[k])
        metrics[f"marble/grad_norm/{name}"] = float(info.grad_norms[k])
        metrics[f"marble/cos/{name}"] = float(info.cosines[k])
    metrics["marble/worst_cos"] = float(info.worst_cosine)
    metrics["marble/mean_cos"] = float(info.mean_cosine)
    metrics["marble/conflict"] = float(info.conflict)
    metrics["marble/qp_time"] = float(info.qp_time_s)
    metrics["marble/qp_fallback"] = float(info.used_fallback)
    metrics["marble/refreshes"] = float(num_refreshes)
    # The release's names for the same quantities (its pareto_fallback_used is this QP-fallback flag).
    metrics["pareto_fallback_used"] = metrics["marble/qp_fallback"]
    for k, name in enumerate(names):
        metrics[f"pareto_alpha_{name}"] = metrics[f"marble/alpha/{name}"]
        metrics[f"pareto_raw_grad_norm_{name}"] = metrics[f"marble/grad_norm/{name}"]
        metrics[f"pareto_valid_{name}"] = float(info.active[k])
    active = [n for n, on in zip(info.grad_norms, info.active) if on]
    metrics["pareto_rescale_factor"] = sum(active) / len(active) if active else 0.0
    return metrics


def pair_metrics(result, balancer, step: int, last: bool) -> list[dict[str, float]]:
    """The released MARBLE's metrics of one micro-batch, one dict per pair (so each is averaged over the pairs that
    log it, as the release does), under marble_trl's names and the release's own (``pareto_*``, ``amortized_step``,
    ``alpha_staleness``; docs/metrics.md)."""
    names = balancer.qp_names
    rows: list[dict[str, float]] = []
    for solve in result.solves:
        row = {"amortized_step": 0.0, "marble/qp_time": float(solve.qp_time_s)}
        fallback = float(solve.fallback != "none")
        row["marble/qp_fallback"] = row["pareto_fallback_used"] = fallback
        row["marble/rescale"] = row["pareto_rescale_factor"] = float(solve.rescale)
        for g, name in enumerate(names):
            row[f"marble/alpha/{name}"] = row[f"pareto_alpha_{name}"] = float(solve.alpha[g])
            row[f"marble/grad_norm/{name}"] = row[f"pareto_raw_grad_norm_{name}"] = float(solve.grad_norms[g])
            row[f"pareto_valid_{name}"] = float(solve.valid[g])
        rows.append(row)
    if result.amortised:
        alpha_bar = balancer.alpha_bar
        row = {"amortized_step": 1.0, "alpha_staleness": float(step - balancer.last_full)}
        row |= {f"pareto_alpha_{n}": float(a) for n, a in zip(names, alpha_bar)}
        rows.extend([row] * result.amortised)
    if last and balancer.alpha_bar is not None:  # after the step
        row = {f"marble/alpha_bar/{n}": float(a) for n, a in zip(names, balancer.alpha_bar)}
        row["marble/refreshes"] = float(balancer.num_solves)  # solved pairs so far
        rows.append(row)
    return rows


def cosine_metrics(cosines: list[float], stats: dict, names: list[str], has_signal: torch.Tensor) -> dict[str, float]:
    """The per-step diagnostic's ``update_cos/*`` metrics; NaN for a reward without signal (not averaged)."""
    metrics = {f"update_cos/{n}": (c if on else math.nan) for n, c, on in zip(names, cosines, has_signal.tolist())}
    metrics["update_cos/worst"] = float(stats["worst_cosine"])
    metrics["update_cos/conflict"] = float(stats["conflict"])
    return metrics


def save_rollout_grid(images, prompts, rewards, names, groups: torch.Tensor, step: int, output_dir: str):
    """A captioned grid of rollouts (prompts, per-image rewards) written to ``output_dir/rollouts/step-{N}.png`` (for
    videos: their middle frames, and the first video as ``step-{N}.mp4`` or ``.gif``); returns the grid, its caption
    and the video's path (``None`` for images)."""
    grid, caption = rollout_grid(images, prompts, rewards, names, groups.tolist(), title=f"step {step}: rollouts")
    folder = os.path.join(output_dir, "rollouts")
    os.makedirs(folder, exist_ok=True)
    grid.save(os.path.join(folder, f"step-{step}.png"))
    video = write_video(images[0], os.path.join(folder, f"step-{step}")) if images.ndim == 5 else None
    return grid, caption, video
