"""One micro-batch of the released MARBLE (``marble_procedure="released"``): each (micro-batch, timestep) pair is
solved or amortised on its own (:class:`~marble_trl.balance.ReleasedMarble`; aim-uofa/MARBLE train.py 1400-1794).

- **Amortised pair**: one ordinary backward of the NFT loss with ``A = sum_k alpha_bar_{g(k)} / n_g A_k`` (0 where a
  reward does not apply, or where reward dropout removed it), plus KL.
- **Solved pair**: the pair's K per-reward gradients from the gradient engine (one forward through the unwrapped
  transformer; each reward's loss the mean over the micro-batch's samples it applies to), averaged over the processes,
  solved (:meth:`ReleasedMarble.solve`: the QP, Eq. 7's rescale, the EMA), then the update ``d = sum_k c_k g_k`` plus
  the KL gradient as one ordinary backward through the back-end with per-sample weights on ``L_pos`` / ``L_neg``
  (:func:`~marble_trl.policy.nft.nft_weighted_loss`). The release writes ``d + g_KL`` into ``.grad`` instead; the two are
  the same gradient, and this one also runs under DeepSpeed (which owns ``.grad``) and FSDP2.

The logged ``loss`` of a solved pair is the loss of that backward (``sum_k c_k L_k + beta KL``); the release logs one
with the rewards' average advantage there.
"""

from __future__ import annotations

import contextlib
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ..balance import GradientEngine, LayerGramEngine, PairSolve, ReleasedMarble
from ..policy.nft import advantage_to_r, masked_weights, nft_loss_terms
from .backends import Backend, LossSettings, engine_scale
from .backward import MicroBatchResult, Predict, policy_forward, timestep_inputs
from .step import MicroBatch


@dataclass
class PairwiseResult(MicroBatchResult):
    solves: list[PairSolve] = field(default_factory=list)  # this micro-batch's solved pairs, in order
    amortised: int = 0  # its amortised pairs
    skipped: str | None = None  # a solve found non-finite gradients: the step must be skipped


def pairwise_micro_batch_loss(
    batch: MicroBatch,
    *,
    step: int,
    balancer: ReleasedMarble,
    engine: Callable[[], GradientEngine],
    model,
    transformer: torch.nn.Module,
    predict: Predict,
    sigmas: torch.Tensor,
    settings: LossSettings,
    backend: Backend,
    noise_generator: torch.Generator,
    autocast: Callable[[], contextlib.AbstractContextManager],
    scale: float,
    device: torch.device,
) -> PairwiseResult:
    """The released procedure over one micro-batch's training timesteps (``scale``: ``1 / (T x GA)``); ``engine()``
    gives the step's per-reward gradient engine (built on first use)."""
    x0 = batch.x0.to(device)
    per_reward = batch.per_reward_advantages.to(device)
    applicable = batch.applicable.to(device)
    r_k = advantage_to_r(per_reward, settings.adv_clip_max)  # each reward's advantage clipped on its own
    num_train = batch.timestep_index.shape[1]
    result = PairwiseResult(torch.zeros((), device=device), defaultdict(lambda: torch.zeros((), device=device)))
    for j in range(num_train):
        inputs = timestep_inputs(batch, j, x0, sigmas, noise_generator, transformer, predict, settings, autocast)
        masks = balancer.sample_masks(applicable, balancer.dropped(step, j))
        if balancer.solves(step):
            forward, solve = _solved_pair(
                inputs, x0, batch, masks, r_k, engine(), balancer, step, transformer, predict, settings, backend,
                autocast, scale,
            )  # fmt: skip
            if solve is None:
                result.skipped = "the per-reward gradients of a solved pair are not finite"
            else:
                result.solves.append(solve)
        else:
            weights = torch.as_tensor(balancer.amortised_weights(), dtype=per_reward.dtype, device=device)
            advantages = (weights[:, None] * torch.where(masks, per_reward, 0.0)).sum(dim=0)
            r = advantage_to_r(advantages, settings.adv_clip_max)  # the combined advantage clipped (train.py 286)
            forward = policy_forward(inputs, x0, batch, r, predict, settings, autocast)
            result.amortised += 1
        v_theta, terms, loss = backend.ordinary(model, forward, scale, j == num_train - 1)
        result.total += loss.detach()
        result.sums["nft/loss_pos"] += terms.loss_pos.detach().mean()
        result.sums["nft/loss_neg"] += terms.loss_neg.detach().mean()
        result.sums["kl"] += terms.kl.detach().mean()
        result.sums["nft/policy_deviation"] += ((v_theta.detach() - inputs.v_old) ** 2).mean()
    return result


def _solved_pair(
    inputs, x0, batch, masks, r_k, engine, balancer, step, transformer, predict, settings, backend, autocast, scale
):
    """The pair's per-reward gradients (engine), averaged over processes, solved; returns the ordinary forward of the
    update ``sum_k c_k g_k`` (+ KL) and the :class:`PairSolve` (None, and a KL-only update, if not finite)."""
    weights = masked_weights(masks)
    half = torch.full_like(r_k[0], 0.5)  # the engine's forward needs some r; its loss is not used
    engine_weight = engine_scale(settings, scale, x0.shape[0])
    engine.reset()
    if isinstance(engine, LayerGramEngine):  # the Gram alone, averaged slice by slice (no [K, P] rows)
        _layer_gram(inputs, x0, batch, r_k, weights, engine, transformer, predict, settings, autocast, engine_weight)
        gram = engine.gram
        rows = None
    else:
        with engine.capture(transformer):  # the unwrapped module: the engine back-propagates itself
            _, terms, _ = policy_forward(inputs, x0, batch, half, predict, settings, autocast)(transformer)
            engine.accumulate(terms.loss_pos, terms.loss_neg, r_k, scale=engine_weight, weights=weights)
        del terms
        rows = engine.buffers
        backend.average_buffers(rows)
    try:
        solve = balancer.solve(rows, step) if rows is not None else balancer.solve_pair_gram(gram, step)
    except ValueError:  # non-finite: the same on every process (all-reduced); the guard skips the step
        solve = None
    c = torch.zeros(len(r_k), dtype=r_k.dtype, device=r_k.device)
    if solve is not None:
        c = torch.as_tensor(solve.coefficients, dtype=r_k.dtype, device=r_k.device)
    pos = (c[:, None] * weights * r_k).sum(dim=0)
    neg = (c[:, None] * weights * (1.0 - r_k)).sum(dim=0)
    return policy_forward(inputs, x0, batch, half, predict, settings, autocast, weights=(pos, neg)), solve


def _layer_gram(inputs, x0, batch, r_k, weights, engine, transformer, predict, settings, autocast, scale) -> None:
    """The pair's Gram by the ``layer_gram`` engine: the policy's forward on the micro-batch twice (``L_pos`` read
    from the first copy, ``L_neg`` from the second; :mod:`marble_trl.balance.layer_gram`)."""
    twice = torch.arange(x0.shape[0], device=x0.device).repeat(2)
    t, x_t, x0_2 = inputs.t[twice], inputs.x_t[twice], x0[twice]
    with engine.capture(transformer):
        with autocast():
            v_theta = predict(transformer, x_t, t, batch.embeds.index(twice.cpu())).float()
        terms = nft_loss_terms(v_theta, inputs.v_old[twice], x_t, x0_2, t, settings.nft_beta, None)
        engine.accumulate(terms.loss_pos, terms.loss_neg, r_k, scale=scale, weights=weights)
