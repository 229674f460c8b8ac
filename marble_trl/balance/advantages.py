"""The multi-reward advantage collator: rewards ``[K, B]`` + groups -> advantages.

Samples come in groups of ``G = num_generations`` consecutive samples that share one prompt. Per reward and per group
(MARBLE Eq. 3)::

    A_k = (R_k - mean_group(R_k)) / (std + 1e-4)

with ``std`` chosen by ``scale_rewards``: ``"group"`` (per-prompt std, MARBLE Eq. 3), ``"batch"`` (one std over the
whole batch, DiffusionNFT's ``global_std=True``) or ``"none"`` (no division). Means and stds skip samples where the
reward does not apply (NaN), and those samples get ``A_k = 0`` (i.e. ``r_k = 0.5``, no push either way). A group whose
rewards are all equal gets ``A_k = 0``, never NaN.

Stds are population stds (``ddof=0``) as in the DiffusionNFT reference code (numpy ``std``); TRL's GRPO uses the
unbiased one. The difference is a factor ``sqrt(G / (G - 1))``.

The single-advantage baselines for several rewards mirror TRL's GRPO ``multi_objective_aggregation``:
``"sum_then_normalize"`` (DiffusionNFT's weighted sum) and ``"normalize_then_sum"`` (GDPO).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

SCALE_REWARDS = ("group", "batch", "none")
STD_EPS = 1e-4


def _nanmean(x: torch.Tensor, dim: int | None = None, keepdim: bool = False) -> torch.Tensor:
    mask = ~torch.isnan(x)
    count = mask.sum(dim=dim, keepdim=keepdim) if dim is not None else mask.sum()
    total = torch.where(mask, x, torch.zeros_like(x)).sum(dim=dim, keepdim=keepdim) if dim is not None else x.nansum()
    return torch.where(count > 0, total / count.clamp(min=1), torch.zeros_like(total))


def _nanstd(x: torch.Tensor, dim: int | None = None, keepdim: bool = False) -> torch.Tensor:
    """Population std over non-NaN entries (0 where fewer than two entries apply)."""
    mean = _nanmean(x, dim=dim, keepdim=True) if dim is not None else _nanmean(x)
    var = _nanmean((x - mean) ** 2, dim=dim, keepdim=keepdim) if dim is not None else _nanmean((x - mean) ** 2)
    return var.clamp(min=0).sqrt()


def normalize_rewards(rewards: torch.Tensor, num_generations: int, scale_rewards: str = "group") -> torch.Tensor:
    """Group advantages of one or several rewards.

    Args:
        rewards: ``[..., B]`` (e.g. ``[K, B]``) with NaN where a reward does not apply; ``B`` is a multiple of
            ``num_generations`` and groups are consecutive.
        num_generations: group size ``G``.
        scale_rewards: ``"group"``, ``"batch"`` or ``"none"``.

    Returns:
        Advantages of the same shape, 0 where the reward does not apply; computed in float64, returned as float32.
    """
    if scale_rewards not in SCALE_REWARDS:
        raise ValueError(f"scale_rewards must be one of {SCALE_REWARDS}, got {scale_rewards!r}.")
    batch = rewards.shape[-1]
    if batch % num_generations:
        raise ValueError(f"The batch ({batch} samples) is not a whole number of groups of {num_generations}.")
    r = rewards.double()
    grouped = r.reshape(*r.shape[:-1], batch // num_generations, num_generations)
    centred = grouped - _nanmean(grouped, dim=-1, keepdim=True)
    if scale_rewards == "group":
        centred = centred / (_nanstd(grouped, dim=-1, keepdim=True) + STD_EPS)
    elif scale_rewards == "batch":
        centred = centred / (_nanstd(r, dim=-1, keepdim=True).unsqueeze(-1) + STD_EPS)
    # A group whose applicable rewards all coincide carries no signal: exactly 0 (its float mean need not be exact).
    lo = torch.where(torch.isnan(grouped), torch.inf, grouped).amin(dim=-1, keepdim=True)
    hi = torch.where(torch.isnan(grouped), -torch.inf, grouped).amax(dim=-1, keepdim=True)
    centred = torch.where(hi <= lo, torch.zeros_like(centred), centred)
    adv = centred.reshape(r.shape)
    return torch.nan_to_num(adv, nan=0.0).float()


def group_std(rewards: torch.Tensor, num_generations: int) -> torch.Tensor:
    """``[..., num_groups]`` population stds of each group's applicable rewards (float64)."""
    grouped = rewards.double().reshape(*rewards.shape[:-1], -1, num_generations)
    return _nanstd(grouped, dim=-1)


def group_std_is_zero(rewards: torch.Tensor, num_generations: int) -> torch.Tensor:
    """``[..., num_groups]`` booleans: groups whose applicable rewards all coincide (no learning signal)."""
    return torch.isclose(group_std(rewards, num_generations), torch.zeros((), dtype=torch.float64))


@dataclass
class Advantages:
    """What the collator hands to the loss.

    ``per_reward`` (``[K, B]``) feeds MARBLE's per-reward estimators; ``combined`` (``[B]``) is the single advantage
    of the weighted-sum baselines (or MARBLE's amortised ``A_bar``, formed later from ``per_reward``).
    """

    per_reward: torch.Tensor
    combined: torch.Tensor


def collate_advantages(
    rewards: torch.Tensor,
    num_generations: int,
    scale_rewards: str = "group",
    reward_weights: torch.Tensor | None = None,
    aggregation: str = "sum_then_normalize",
) -> Advantages:
    """Per-reward advantages ``[K, B]`` and the single baseline advantage ``[B]``.

    - ``"sum_then_normalize"``: weighted sum of the raw rewards (n/a counts as 0, NaN if no reward applies), then
      group normalisation with ``scale_rewards`` (DiffusionNFT's multi-reward recipe; TRL GRPO's default).
    - ``"normalize_then_sum"`` (GDPO, as in TRL GRPO): each reward normalised within its group, weighted sum, then
      normalised over the batch.
    - anything else (e.g. ``"marble"``): ``combined`` is the weighted sum of the per-reward advantages (the amortised
      ``A_bar`` uses the balancer's weights instead).
    """
    num_rewards = rewards.shape[0]
    weights = (
        torch.ones(num_rewards) if reward_weights is None else torch.as_tensor(reward_weights, dtype=torch.float32)
    )
    weights = weights.to(torch.float64)
    per_reward = normalize_rewards(rewards, num_generations, scale_rewards)
    all_nan = torch.isnan(rewards).all(dim=0)
    if aggregation == "sum_then_normalize":
        summed = (rewards.double() * weights[:, None]).nansum(dim=0)
        summed[all_nan] = float("nan")
        combined = normalize_rewards(summed, num_generations, scale_rewards)
    elif aggregation == "normalize_then_sum":
        group_norm = normalize_rewards(rewards, num_generations, "group").double()
        summed = (group_norm * weights[:, None]).sum(dim=0)
        summed[all_nan] = float("nan")
        combined = torch.nan_to_num((summed - _nanmean(summed)) / (_nanstd(summed) + STD_EPS), nan=0.0).float()
    else:
        combined = (per_reward.double() * weights[:, None]).sum(dim=0).float()
    return Advantages(per_reward=per_reward, combined=combined)
