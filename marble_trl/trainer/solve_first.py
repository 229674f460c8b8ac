"""MARBLE refreshes solved *before* the step's backward passes, their Eq. 7 update formed by Prop. 1 (beyond the paper).

MARBLE (arXiv 2605.06507) forms a refresh step's update ``d_final = sum_k c_k g_k`` from the K per-reward gradients of
the whole step, ``c_k = alpha*_k mean_j ||g_j|| / ||g_k||`` (Eq. 7). Two things make that costly or impossible: the
per-reward pass costs one more backward per (micro-batch, timestep) pair, and a back-end that owns the gradients
(DeepSpeed) cannot take a hand-written ``d_final``. Here the refresh runs in two phases instead:

1. the per-reward gradients of a *subset* of the step's pairs (``marble_refresh_subset``; all pairs under DeepSpeed
   with 0), all-reduced; the QP, the EMA and the counters exactly as on an exact refresh (``MarbleBalancer.solve``);
2. the step's ordinary backward passes with ``A = sum_k (c_k / sum c) A_k`` and the NFT policy term scaled by
   ``sum c``: by Prop. 1 their gradient is ``sum_k c_k g_k`` of the whole step, plus the KL term's.

What is exact: with every pair in the subset, the update is Eq. 7 exactly, up to float rounding and to samples with some
``|A_k| > A_max`` (counted in ``marble/clamp_violations``; none with group normalisation and G <= 26, since
``|A| <= sqrt(G - 1)``). What is estimated with fewer pairs: the Gram, hence ``alpha*`` and the norms in ``c``; the
update then applies the estimated ``c`` to the whole step's gradients. ``marble/grad_norm/*`` are the subset's norms
rescaled by ``pairs / subset`` (the per-pair sums' scale), and the refresh cosines are those of the subset.

Subset pairs are spread over the micro-batches first: pair ``s`` is timestep slot ``s // M`` of micro-batch ``s % M``
(M micro-batches per process), so a micro-batch's pairs are a prefix of its (randomly drawn) training timesteps and
draw the same noise as its ordinary pass does.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from ..balance import GradientEngine, MarbleBalancer, RefreshInfo
from ..policy.nft import advantage_to_r, masked_weights
from .backends import Backend, LossSettings, engine_scale
from .backward import Predict, policy_forward, timestep_inputs
from .step import MicroBatch


def subset_pairs(num_micro: int, num_train: int, subset: int) -> list[int]:
    """How many leading timestep slots of each of the ``num_micro`` micro-batches the subset takes (``subset`` pairs,
    spread over the micro-batches first; 0 or at least ``num_micro x num_train``: all)."""
    total = num_micro * num_train
    subset = total if subset <= 0 else min(subset, total)
    return [subset // num_micro + (m < subset % num_micro) for m in range(num_micro)]


@dataclasses.dataclass(frozen=True)
class SolveFirstResult:
    refresh: RefreshInfo | None  # None: nothing was solved (``skipped`` says why)
    pairs: int  # (micro-batch, timestep) pairs of this process in the estimate
    batches: tuple[MicroBatch, ...]  # the step's micro-batches re-planned for phase 2 (new objects)
    skipped: str | None = None


def subset_gradients(
    batches: list[MicroBatch],
    *,
    transformer: torch.nn.Module,
    predict: Predict,
    sigmas: torch.Tensor,
    settings: LossSettings,
    engine: GradientEngine,
    noise_generator: Callable[[int], torch.Generator],
    autocast: Callable,
    scale: float,
    device: torch.device,
    subset: int,
    backend: Backend,
) -> int:
    """Phase 1's per-reward gradients of ``subset`` pairs of this process's micro-batches of the step, accumulated into
    ``engine.buffers`` (zeroed first) and all-reduced; ``noise_generator(m)``: micro-batch ``m``'s noise stream, as
    its ordinary pass gets it. Returns the number of pairs."""
    engine.reset()
    num_train = batches[0].timestep_index.shape[1]
    counts = subset_pairs(len(batches), num_train, subset)
    pairs = sum(counts)
    for batch, count in zip(batches, counts):
        if not count:
            continue
        x0 = batch.x0.to(device)
        r = advantage_to_r(batch.advantages.to(device), settings.adv_clip_max)
        r_k = advantage_to_r(batch.per_reward_advantages.to(device), settings.adv_clip_max)
        masks = masked_weights(batch.applicable.to(device)) if settings.masked_solve else None
        # The per-pair sums of the whole step, had every pair been in the subset: norms comparable to exact ones.
        weight = engine_scale(settings, scale, batch.x0.shape[0]) * len(batches) * num_train / pairs
        generator = noise_generator(batch.index)
        for j in range(count):
            inputs = timestep_inputs(batch, j, x0, sigmas, generator, transformer, predict, settings, autocast)
            with engine.capture(transformer):
                _, terms, _ = policy_forward(inputs, x0, batch, r, predict, settings, autocast)(transformer)
                engine.accumulate(terms.loss_pos, terms.loss_neg, r_k, scale=weight, weights=masks)
            del terms
    backend.average_buffers(engine.buffers)
    return pairs


def solve_first_refresh(
    batches: list[MicroBatch], *, balancer: MarbleBalancer, log_update_cosines: bool, **gradient_kwargs
) -> SolveFirstResult:
    """Phase 1 (:func:`subset_gradients` with ``gradient_kwargs``) and the QP, then the step's micro-batches re-planned
    for phase 2: new objects, ``batches`` is not modified."""
    plan = batches[0].plan
    pairs = subset_gradients(batches, **gradient_kwargs)
    buffers = gradient_kwargs["engine"].buffers
    if not torch.isfinite(buffers).all():
        bad = [n for n, row in zip(balancer.reward_names, buffers) if not torch.isfinite(row).all()]
        plain = dataclasses.replace(plan, mode="plain")  # the step will be skipped: no refresh, trained as planned
        replanned = tuple(dataclasses.replace(batch, plan=plain) for batch in batches)
        return SolveFirstResult(None, pairs, replanned, f"the per-reward gradients of {bad} are not finite")
    buffers[~plan.has_signal.to(buffers.device)] = 0.0  # rewards without signal stay out of the QP
    coeffs, info = balancer.solve(buffers)
    total = float(coeffs.sum())
    w = torch.as_tensor(coeffs / total if total > 0 else coeffs)
    mode = "cosines" if log_update_cosines else "plain"
    new_plan = dataclasses.replace(plan, mode=mode, policy_scale=total)
    settings = gradient_kwargs["settings"]
    replanned = []
    for batch in batches:
        per_reward = batch.per_reward_advantages
        loss_weights = None
        if settings.masked_solve:  # sum_k c_k g_k of masked losses: per-sample weights (nft_weighted_loss)
            c = torch.as_tensor(coeffs, dtype=per_reward.dtype, device=per_reward.device)[:, None]
            r_k = advantage_to_r(per_reward, settings.adv_clip_max)
            weights = masked_weights(batch.applicable.to(per_reward.device))
            loss_weights = ((c * weights * r_k).sum(dim=0), (c * weights * (1 - r_k)).sum(dim=0))
        replanned.append(
            dataclasses.replace(
                batch,
                reported=(batch.advantages, plan.policy_scale),
                advantages=(w.to(per_reward)[:, None] * per_reward).sum(dim=0),
                plan=new_plan,
                loss_weights=loss_weights,
            )
        )
    return SolveFirstResult(info, pairs, tuple(replanned))
