"""MARBLE's released update written out from the authors' code (aim-uofa/MARBLE @ 1bf9543: train.py 1400-1794,
flow_grpo/pareto_balancer/balancer.py, mgda.py), for the tests: explicit ``torch.autograd.grad`` per reward and per
(micro-batch, timestep) pair, scipy's SLSQP for the QP, the EMA without a prior. Nothing here calls marble_trl's
balancer, gradient engine or loss code; it reads the step's inputs (latents, advantages, timesteps, the noise
generator) from the trainer's micro-batches and differentiates the trainer's transformer.

The old policy's velocity comes from the trainer's old-policy adapter (the step's input, like the rollouts); expects
SGD without clipping or weight decay, so that the expected parameters after a step are ``p - lr * grad``.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist
from scipy.optimize import minimize

from marble_trl.policy.switch import use_old_weights, use_reference_weights

A_MAX = 5.0
EPS = 1e-12


def _mean_over_processes(flat: torch.Tensor) -> torch.Tensor:
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        flat = flat.clone()
        dist.all_reduce(flat)  # ddp_ops.py: SUM, then / world size
        flat /= dist.get_world_size()
    return flat


def _slsqp_min_norm(gram: np.ndarray) -> np.ndarray:
    """mgda.py: min 1/2 a^T G a, a >= 0, sum a = 1, SLSQP from the uniform point; clipped and renormalised (ftol
    tightened from the release's 1e-8 so that the reference is the QP's minimiser to ~1e-10)."""
    k = gram.shape[0]
    res = minimize(
        lambda a: 0.5 * a @ gram @ a,
        np.full(k, 1.0 / k),
        jac=lambda a: gram @ a,
        bounds=[(0.0, None)] * k,
        constraints=[{"type": "eq", "fun": lambda a: a.sum() - 1.0, "jac": lambda a: np.ones(k)}],
        method="SLSQP",
        options={"ftol": 1e-14, "maxiter": 500},
    )
    a = np.clip(res.x, 0.0, None)
    return a / max(a.sum(), 1e-12)


class ReleasedReference:
    """The release's coefficient state (``cached_pareto_alphas``, ``last_full_mgda_step``) and its step gradient."""

    def __init__(self, num_rewards: int, refresh_interval: int, warmup: int, rho: float) -> None:
        self.k, self.n, self.warmup, self.rho = num_rewards, refresh_interval, warmup, rho
        self.alpha_bar: np.ndarray | None = None
        self.last_full = -1
        self.solves: list[int] = []  # the step of every solved pair
        self.fallbacks: list[str] = []

    def _use_cached(self, step: int) -> bool:  # train.py 1482-1492
        return self.alpha_bar is not None and step >= self.warmup and step - self.last_full < self.n

    def step_gradient(self, trainer, batches, step: int) -> list[torch.Tensor]:
        """The gradient the released code accumulates in ``.grad`` over this process's micro-batches of ``step``,
        averaged over the processes (DDP / the hand all-reduce)."""
        args = trainer.args
        transformer = trainer.transformer
        params = list(trainer.trainable_parameters().values())
        num_train = batches[0].timestep_index.shape[1]
        pairs = len(batches) * num_train  # effective_grad_accum_steps (192 in the release)
        nft_beta, kl_weight = args.nft_beta, args.beta
        total = torch.zeros(sum(p.numel() for p in params), dtype=torch.float64)

        def flat(loss: torch.Tensor, retain: bool) -> torch.Tensor:
            grads = torch.autograd.grad(loss, params, retain_graph=retain, allow_unused=True)
            return torch.cat(
                [(g if g is not None else torch.zeros_like(p)).reshape(-1).double() for g, p in zip(grads, params)]
            )

        for mb in batches:
            generator = trainer._generator(2, trainer._global_batch_index(mb.index))  # the step's noise stream
            x0 = mb.x0.float()
            advantages, valid = mb.per_reward_advantages.double(), mb.applicable
            for j in range(num_train):
                t = trainer.train_sigmas[mb.timestep_index[:, j]]
                noise = torch.randn(x0.shape, generator=generator)  # train.py 1437: fresh noise per pair
                tb = t.view(-1, 1, 1, 1)
                x_t = (1 - tb) * x0 + tb * noise
                predict = trainer.model_adapter.predict
                with torch.no_grad():
                    with use_old_weights(transformer):
                        v_old = predict(transformer, x_t, t, mb.embeds).float()
                    with use_reference_weights(transformer):
                        v_ref = predict(transformer, x_t, t, mb.embeds).float()
                v = predict(transformer, x_t, t, mb.embeds).float()
                # compute_policy_and_kl_terms (train.py 318-352)
                losses = []
                for v_pm in (nft_beta * v + (1 - nft_beta) * v_old, (1 + nft_beta) * v_old - nft_beta * v):
                    x0_hat = x_t - tb * v_pm
                    w = (x0_hat.double() - x0.double()).abs().mean(dim=(1, 2, 3)).clamp(min=1e-5).detach()
                    losses.append(((x0_hat - x0) ** 2).mean(dim=(1, 2, 3)) / w.float())
                loss_pos, loss_neg = losses
                kl = ((v - v_ref) ** 2).mean(dim=(1, 2, 3)).mean()

                def per_sample(a: torch.Tensor, pos=loss_pos, neg=loss_neg) -> torch.Tensor:
                    r = (a.clamp(-A_MAX, A_MAX) / A_MAX / 2 + 0.5).clamp(0, 1).float()
                    return r * pos / nft_beta + (1 - r) * neg / nft_beta

                if self._use_cached(step):  # amortised pair (1521-1550)
                    combined = (torch.as_tensor(self.alpha_bar)[:, None] * advantages).sum(dim=0)
                    loss = (A_MAX * per_sample(combined).mean() + kl_weight * kl) / pairs
                    total += _mean_over_processes(flat(loss, retain=False))
                    continue
                # solved pair (1562-1794): masked per-reward losses, KL apart, all-reduced, balanced
                rows = []
                for k in range(self.k):
                    m = valid[k].float()
                    loss_k = A_MAX * (m * per_sample(advantages[k])).sum() / m.sum().clamp(min=1) / pairs
                    rows.append(_mean_over_processes(flat(loss_k, retain=True)))
                g_kl = _mean_over_processes(flat(kl_weight * kl / pairs, retain=False))
                total += self._balance(torch.stack(rows), step) + g_kl
        return [chunk.view_as(p) for chunk, p in zip(total.split([p.numel() for p in params]), params)]

    def _balance(self, grads: torch.Tensor, step: int) -> torch.Tensor:
        """balancer.py: validity, normalisation, the QP, Eq. 7's rescale, fallbacks; then the EMA (1714-1727)."""
        norms = grads.norm(dim=1)
        valid = torch.isfinite(grads).all(dim=1) & (norms > EPS)
        alpha = np.zeros(self.k)
        if not valid.any():
            update, reason = torch.zeros_like(grads[0]), "all_zero"
        elif valid.sum() == 1:
            v = int(valid.nonzero()[0])
            update, reason = grads[v], "single_valid"
            alpha[v] = 1.0
        else:
            idx = valid.nonzero().flatten()
            unit = grads[idx] / norms[idx, None].clamp(min=EPS)
            a = _slsqp_min_norm((unit @ unit.T).numpy())
            alpha[idx.numpy()] = a
            update, reason = (torch.as_tensor(a)[:, None] * unit).sum(dim=0) * norms[idx].mean(), "none"
        if self.alpha_bar is not None and self.rho > 0:
            self.alpha_bar = self.rho * self.alpha_bar + (1 - self.rho) * alpha
        else:
            self.alpha_bar = alpha
        self.last_full = step
        self.solves.append(step)
        self.fallbacks.append(reason)
        return update
