"""One micro-batch's NFT loss over its training timesteps, and the end of a step that computed per-reward gradients.

For every training timestep ``t`` of a sample (DiffusionNFT, arXiv 2509.16117, Alg. 1): noise the clean latent to
``x_t``, predict ``v_old`` (old-policy adapter) and, with KL on, ``v_ref`` (adapters off) without gradients, then the
policy's ``v_theta`` and the NFT loss, and back-propagate. How the gradient is formed differs per back-end (plain /
DDP, DeepSpeed, FSDP2): :mod:`marble_trl.trainer.backends`.
"""

from __future__ import annotations

import contextlib
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..balance import GradientEngine, MarbleBalancer, RefreshInfo, cosine_stats, make_gradient_engine, update_cosines
from ..policy.nft import add_noise, advantage_to_r, masked_weights, nft_loss, nft_loss_terms, nft_weighted_loss
from ..policy.switch import use_old_weights, use_reference_weights
from .backends import Backend, LossSettings
from .step import MicroBatch

# predict(module, x_t, sigma, embeds) -> velocity: the model family's forward (marble_trl.models)
Predict = Callable[..., torch.Tensor]


@dataclass
class MicroBatchResult:
    total: torch.Tensor  # sum over timesteps of the (unscaled) loss, detached
    sums: dict[str, torch.Tensor]  # per-timestep metric sums, detached


def micro_batch_loss(
    batch: MicroBatch,
    *,
    model,
    transformer: torch.nn.Module,
    predict: Predict,
    sigmas: torch.Tensor,
    settings: LossSettings,
    backend: Backend,
    engine: GradientEngine | None,
    noise_generator: torch.Generator,
    autocast: Callable[[], contextlib.AbstractContextManager],
    scale: float,
    device: torch.device,
) -> MicroBatchResult:
    """The NFT loss of one micro-batch, back-propagated timestep by timestep (``scale``: ``1 / (T x GA)``)."""
    x0 = batch.x0.to(device)
    r = advantage_to_r(batch.advantages.to(device), settings.adv_clip_max)
    r_k = weights = None
    if engine is not None:
        r_k = advantage_to_r(batch.per_reward_advantages.to(device), settings.adv_clip_max)
        r_k = backend.per_reward_r(r_k, r, batch.plan.mode)
        if settings.masked_solve and batch.plan.mode == "refresh":
            weights = masked_weights(batch.applicable.to(device))
    reported = None
    if batch.reported is not None:
        reported = (advantage_to_r(batch.reported[0].to(device), settings.adv_clip_max), batch.reported[1])
    num_train = batch.timestep_index.shape[1]
    total = torch.zeros((), device=device)
    sums: dict[str, torch.Tensor] = defaultdict(lambda: torch.zeros((), device=device))
    for j in range(num_train):
        inputs = timestep_inputs(batch, j, x0, sigmas, noise_generator, transformer, predict, settings, autocast)
        forward = policy_forward(inputs, x0, batch, r, predict, settings, autocast)
        v_theta, terms, loss = backend.timestep(
            model, transformer, forward, engine, batch.plan.mode, settings, r_k, scale, j == num_train - 1, weights
        )
        if reported is not None:  # the loss of the step as planned (a solved-first refresh), for the log
            with torch.no_grad():
                loss = nft_loss(
                    terms, reported[0], settings.nft_beta, settings.adv_clip_max, settings.beta, reported[1]
                )
        total += loss.detach()
        # Detached tensors, read once per micro-batch: no device sync per timestep.
        sums["nft/loss_pos"] += terms.loss_pos.detach().mean()
        sums["nft/loss_neg"] += terms.loss_neg.detach().mean()
        sums["kl"] += terms.kl.detach().mean()
        sums["nft/policy_deviation"] += ((v_theta.detach() - inputs.v_old) ** 2).mean()
    return MicroBatchResult(total, dict(sums))


@dataclass(frozen=True)
class TimestepInputs:
    """One (micro-batch, timestep)'s noised latents and the gradient-free velocities the NFT loss compares with."""

    x_t: torch.Tensor
    t: torch.Tensor
    v_old: torch.Tensor
    v_ref: torch.Tensor | None


def timestep_inputs(batch, j, x0, sigmas, noise_generator, transformer, predict, settings, autocast) -> TimestepInputs:
    """Training timestep ``j`` of ``batch``: draws its noise from ``noise_generator`` (one draw per timestep, in
    order), noises ``x0`` and predicts ``v_old`` (old-policy adapter) and, with KL on, ``v_ref`` without gradients."""
    t = sigmas[batch.timestep_index[:, j]].to(x0.device)
    noise = torch.randn(x0.shape, generator=noise_generator).to(device=x0.device, dtype=x0.dtype)
    x_t = add_noise(x0, noise, t)
    with torch.no_grad(), autocast():
        with use_old_weights(transformer):
            v_old = predict(transformer, x_t, t, batch.embeds).float()
        v_ref = None
        if settings.beta > 0:
            with use_reference_weights(transformer):
                v_ref = predict(transformer, x_t, t, batch.embeds).float()
    return TimestepInputs(x_t, t, v_old, v_ref)


def policy_forward(
    inputs: TimestepInputs, x0, batch, r, predict, settings: LossSettings, autocast, weights=None
) -> Callable:
    """``forward(module) -> (v_theta, terms, loss)``: the policy's forward on ``inputs`` and the step's NFT loss (its
    policy term scaled by the plan's ``policy_scale``), or, with per-sample ``weights`` ``(on L_pos, on L_neg)`` (or
    the micro-batch's ``loss_weights``), :func:`~marble_trl.policy.nft.nft_weighted_loss` (a masked solve's update)."""
    weights = weights if weights is not None else batch.loss_weights

    def forward(module):
        with autocast():
            v_theta = predict(module, inputs.x_t, inputs.t, batch.embeds).float()
        terms = nft_loss_terms(v_theta, inputs.v_old, inputs.x_t, x0, inputs.t, settings.nft_beta, inputs.v_ref)
        if weights is not None:
            loss = nft_weighted_loss(terms, *weights, settings.nft_beta, settings.adv_clip_max, settings.beta)
        else:
            loss = nft_loss(terms, r, settings.nft_beta, settings.adv_clip_max, settings.beta, batch.plan.policy_scale)
        return v_theta, terms, loss

    return forward


def per_reward_engine(
    engine: GradientEngine | None,
    batch: MicroBatch,
    kind: str,
    trainable: Callable[[], dict[str, torch.nn.Parameter]],
    num_rewards: int,
    backend: Backend,
    module: torch.nn.Module,
) -> GradientEngine:
    """The step's per-reward gradient engine: ``engine``, or a new one of ``kind`` (``marble_gradient_engine``) over
    the parameters ``trainable()`` returns, built on first use (and again when the row count changes: a cosine step
    of a back-end owning the gradients has one more); its buffers are zeroed at the step's first micro-batch."""
    # Where the update's gradient is not in .grad (DeepSpeed), the cosine diagnostics get it as one more row.
    rows = num_rewards + int(backend.update_row_in_engine and batch.plan.mode == "cosines")
    if engine is None or engine.num_rewards != rows:
        # Sized from the whole shapes: ZeRO-3 / FSDP2 parameters are not gathered for it (a gather between a rollout and
        # the training passes fails under ZeRO-3: the rollout leaves parameters in use).
        engine = make_gradient_engine(kind, list(trainable().values()), rows, module, backend.average_buffers)
    if batch.index == 0:
        engine.reset()
    return engine


@dataclass(frozen=True)
class EngineStepResult:
    """What the end of a step with per-reward gradients produced (at most one of the two)."""

    refresh: RefreshInfo | None = None  # a MARBLE refresh
    cosines: list[float] | None = None  # the diagnostic's cos(update, g_k), per reward
    cosine_stats: dict | None = None
    skipped: bool = False  # nothing was computed: the step is skipped (non-finite buffers, a flagged step)
    reason: str | None = None  # why, when this process's guard has not recorded it yet


def finish_engine_step(
    engine: GradientEngine,
    plan_mode: str,
    has_signal: torch.Tensor,
    backend: Backend,
    balancer: MarbleBalancer | None,
    refresh_update: str,
    flagged: bool,
    reward_names: list[str],
) -> EngineStepResult:
    """After the step's last micro-batch: all-reduce, then MARBLE's QP and Eq. 7 (or the baseline's cosines).

    ``flagged``: this process's non-finite guard flagged the step; every process decides alike (all-reduced).
    """
    buffers, params = engine.buffers, engine.params
    backend.all_reduce(buffers, params)
    if not torch.isfinite(buffers).all():
        bad = [n for n, row in zip(reward_names, buffers) if not torch.isfinite(row).all()]
        return EngineStepResult(skipped=True, reason=f"the per-reward gradients of {bad} are not finite")
    flag = torch.tensor([float(flagged)], device=buffers.device)
    if backend.accelerator.num_processes > 1:
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
    if plan_mode == "refresh":
        if flag.item():  # the step will be skipped: the coefficients must not move either
            return EngineStepResult(skipped=True, reason=None if flagged else "another process's loss is not finite")
        update, info = balancer.finish(buffers, has_signal)
        if refresh_update == "gradient":
            backend.apply_update(update, params)
        return EngineStepResult(refresh=info)
    flat, rows = backend.update_and_rows(buffers, params)
    cosines = update_cosines(flat, rows.float())
    return EngineStepResult(cosines=cosines.tolist(), cosine_stats=cosine_stats(cosines, has_signal.cpu().numpy()))
