"""The DiffusionNFT pieces: the forward-process loss, the advantage -> r map, the old-policy decay.

DiffusionNFT: "Online Diffusion Reinforcement with Forward Process", Zheng et al., arXiv 2509.16117 (ICLR 2026).
Rectified flow conventions (diffusers SD3): ``x_t = (1 - t) x0 + t eps``, the model predicts ``v = eps - x0`` and
``x0_hat = x_t - t v_hat`` with ``t = sigma = timestep / 1000``.

The reward enters the loss only through the affine map ``A -> r`` (:func:`advantage_to_r`); the per-sample pieces
:func:`nft_loss_terms` (``L_pos``, ``L_neg``) do not depend on it. MARBLE's per-reward gradients and its amortisation
(MARBLE, arXiv 2605.06507, Prop. 1) rest on that property.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

DECAY_TYPES = ("on_policy", "linear", "delayed", "marble")


def advantage_to_r(advantages: torch.Tensor, adv_clip_max: float) -> torch.Tensor:
    """``r = clamp(0.5 + clip(A, +-A_max) / (2 A_max), 0, 1)`` (DiffusionNFT; MARBLE Eq. 3).

    The reference code clips ``A`` to ``[-A_max, A_max]`` first, which makes the final clamp a no-op; both are kept so
    the map is exactly the reference's.
    """
    clipped = advantages.clamp(-adv_clip_max, adv_clip_max)
    return (0.5 + clipped / (2.0 * adv_clip_max)).clamp(0.0, 1.0)


def _per_sample_mean(x: torch.Tensor) -> torch.Tensor:
    return x.mean(dim=tuple(range(1, x.ndim)))


@dataclass
class NFTTerms:
    """Per-sample pieces of the NFT objective for one (micro-batch, timestep)."""

    loss_pos: torch.Tensor  # [B], L_pos with its stop-gradient weight
    loss_neg: torch.Tensor  # [B], L_neg with its stop-gradient weight
    kl: torch.Tensor  # [B], mean ||v_theta - v_ref||^2 (zeros when no reference was given)


def nft_loss_terms(
    v_theta: torch.Tensor,
    v_old: torch.Tensor,
    x_t: torch.Tensor,
    x0: torch.Tensor,
    t: torch.Tensor,
    nft_beta: float,
    v_ref: torch.Tensor | None = None,
    weight_floor: float = 1e-5,
) -> NFTTerms:
    """Per-sample ``L_pos``, ``L_neg`` and KL of DiffusionNFT (METHOD.md section 1, step 3).

    ``v_pos = (1 - b) v_old + b v_theta`` and ``v_neg = (1 + b) v_old - b v_theta`` are the implicit positive and
    negative policies. Each loss is the squared x0 error divided by a stop-gradient "self-normalised" weight, the
    per-sample mean absolute x0 error (computed in float64 as the reference does, floored at ``weight_floor``).

    Args:
        v_theta: trainable policy's velocity, ``[B, ...]`` (carries the graph).
        v_old: old policy's velocity (no graph), same shape.
        x_t: noised latents, same shape.
        x0: clean latents from the rollout, same shape.
        t: ``[B]`` flow times in ``[0, 1]``.
        nft_beta: the guidance strength ``beta`` of NFT (not the KL weight).
        v_ref: reference (LoRA-disabled) velocity for the KL term, or ``None``.
    """
    v_old = v_old.detach()
    t_b = t.view(-1, *([1] * (x0.ndim - 1))).to(v_theta.dtype)
    v_pos = (1.0 - nft_beta) * v_old + nft_beta * v_theta
    v_neg = (1.0 + nft_beta) * v_old - nft_beta * v_theta
    x0_pos = x_t - t_b * v_pos
    x0_neg = x_t - t_b * v_neg
    with torch.no_grad():
        w_pos = _per_sample_mean((x0_pos.double() - x0.double()).abs()).clamp(min=weight_floor)
        w_neg = _per_sample_mean((x0_neg.double() - x0.double()).abs()).clamp(min=weight_floor)
    loss_pos = _per_sample_mean((x0_pos - x0) ** 2) / w_pos.to(v_theta.dtype)
    loss_neg = _per_sample_mean((x0_neg - x0) ** 2) / w_neg.to(v_theta.dtype)
    if v_ref is None:
        kl = torch.zeros_like(loss_pos)
    else:
        kl = _per_sample_mean((v_theta - v_ref.detach()) ** 2)
    return NFTTerms(loss_pos=loss_pos, loss_neg=loss_neg, kl=kl)


def nft_policy_loss(terms: NFTTerms, r: torch.Tensor, nft_beta: float, adv_clip_max: float) -> torch.Tensor:
    """Per-sample policy loss ``A_max / b * (r L_pos + (1 - r) L_neg)`` (``[B]``; mean it over the batch)."""
    return adv_clip_max / nft_beta * (r * terms.loss_pos + (1.0 - r) * terms.loss_neg)


def nft_weighted_loss(
    terms: NFTTerms, pos_weight: torch.Tensor, neg_weight: torch.Tensor, nft_beta: float, adv_clip_max: float,
    beta: float,
) -> torch.Tensor:  # fmt: skip
    """The NFT loss with per-sample weights on the two terms, ``A_max / b * mean_i(a_i L_pos_i + n_i L_neg_i) + beta
    KL``: the update ``sum_k c_k g_k`` of per-reward gradients whose losses weight their samples ``w_ki`` (a masked
    solve) is its gradient with ``a_i = sum_k c_k w_ki r_ki`` and ``n_i = sum_k c_k w_ki (1 - r_ki)`` (MARBLE's Prop. 1
    with per-sample weights; exact whatever the clamps of the ``r_k``)."""
    loss = (adv_clip_max / nft_beta * (pos_weight * terms.loss_pos + neg_weight * terms.loss_neg)).mean()
    if beta > 0:
        loss = loss + beta * terms.kl.mean()
    return loss


def masked_weights(masks: torch.Tensor) -> torch.Tensor:
    """[K, B] sample weights of a masked solve: reward k's loss is the mean over its ``n_k`` applicable samples of the
    micro-batch, ``w_ki = B m_ki / max(n_k, 1)`` against the NFT loss's mean over all ``B`` (train.py 341-345)."""
    b = masks.shape[1]
    return masks.float() * b / masks.sum(dim=1, keepdim=True).clamp(min=1)


def nft_loss(
    terms: NFTTerms, r: torch.Tensor, nft_beta: float, adv_clip_max: float, beta: float, policy_scale: float = 1.0
) -> torch.Tensor:
    """The scalar DiffusionNFT loss of one (micro-batch, timestep): policy term plus ``beta`` times the KL.

    ``policy_scale`` multiplies the policy term only: MARBLE's Prop. 1 updates ``sum_k c_k g_k`` with ``sum c != 1``
    are ``sum c`` times the gradient of the policy term with ``A = sum_k (c_k / sum c) A_k``, plus the KL's."""
    loss = nft_policy_loss(terms, r, nft_beta, adv_clip_max).mean()
    if policy_scale != 1.0:
        loss = policy_scale * loss
    if beta > 0:
        loss = loss + beta * terms.kl.mean()
    return loss


def old_policy_decay(step: int, decay_type: str) -> float:
    """The old-policy EMA decay ``eta`` after optimizer step ``step`` (the reference's three schedules).

    - ``"on_policy"``: ``eta = 0``, the old policy is the current one;
    - ``"linear"`` (default): ``eta = min(0.001 * step, 0.5)``;
    - ``"delayed"`` (the reference's OCR schedule): 0 for 75 steps, then ``min(0.0075 * (step - 75), 0.999)``;
    - ``"marble"`` (MARBLE's released code): ``min(0.001 * (step + 1), 0.95)``.
    """
    if decay_type == "on_policy":
        return 0.0
    if decay_type == "marble":  # MARBLE's release: steps counted from 1 (the one just taken), capped at 0.95
        return min(0.001 * (step + 1), 0.95)
    if decay_type == "linear":
        flat, rate, cap = 0, 0.001, 0.5
    elif decay_type == "delayed":
        flat, rate, cap = 75, 0.0075, 0.999
    else:
        raise ValueError(f"Unknown old-policy decay type {decay_type!r}; choose one of {DECAY_TYPES}.")
    if step < flat:
        return 0.0
    return min((step - flat) * rate, cap)


def param_ema_decay(step: int, max_decay: float = 0.9) -> float:
    """Decay of the evaluation-only parameter EMA: ``min((1 + s) / (10 + s), max_decay)`` (DiffusionNFT)."""
    return min((1.0 + step) / (10.0 + step), max_decay)


def add_noise(x0: torch.Tensor, noise: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """Forward process ``x_t = (1 - t) x0 + t eps`` of rectified flow."""
    t_b = t.view(-1, *([1] * (x0.ndim - 1))).to(x0.dtype)
    return (1.0 - t_b) * x0 + t_b * noise
