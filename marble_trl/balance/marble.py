"""MARBLE's gradient balancer: normalise, min-norm QP, rescale, EMA, refresh schedule.

MARBLE, "Multi-Aspect Reward Balance for Diffusion RL" (arXiv 2605.06507); equation numbers refer to that paper.
At a *refresh* step the caller hands over the K per-reward gradients ``g_k`` (Eq. 4, already all-reduced, KL excluded)
and ``MarbleBalancer.combine`` returns the update of Eq. 7; ``advantage_weights`` gives the alpha_bar used on the
N-1 amortised steps in between (Prop. 1: ``A_bar = sum_k alpha_bar_k A_k``, one ordinary backward).

1. Eq. 5  ``gh_k = g_k / ||g_k||``, done in Gram space: ``Mh_ij = M_ij / (||g_i|| ||g_j||)`` with ``M = G G^T``.
2. Eq. 6  ``alpha* = argmin_{alpha in simplex} alpha^T Mh alpha`` (cvxopt, then an exact active-set polish:
   ``qp.solve_min_norm``).
3. Eq. 7  ``d_final = (sum_k alpha*_k gh_k) * mean_k ||g_k||``, formed as one ``[K] x [K, P]`` product.
4. Eq. 12 ``alpha_bar <- rho alpha_bar + (1 - rho) alpha*`` after each successful refresh.

Choices and deviations (all documented where they happen):
- ``alpha_bar_0`` is uniform (the paper does not say).
- A reward with a zero gradient (0/0 in Eq. 5) is excluded from the QP and gets ``alpha*_k = 0``; the mean in Eq. 7
  runs over the rewards *with* signal, so a silent reward does not shrink the step. With no signal at all the
  update is zero and the coefficients are not refreshed.
- The refresh step's update uses ``alpha*`` (the paper's full procedure), not ``alpha_bar``; ``rho`` only affects the
  amortised steps that follow.
- If the QP fails (``ok=False``) the previous coefficients are kept: Eq. 7 is formed with ``alpha_bar`` (renormalised
  over the rewards with signal), ``alpha_bar`` is not updated, and ``num_qp_fallbacks`` counts it. Non-finite
  gradients are not a QP failure: ``combine`` raises ``ValueError`` before touching any state and the caller decides
  (e.g. skip the step).
- The Gram is ONE matmul in the buffers' own dtype (float32 accumulation for float32 buffers, no [K, P] float64 copy);
  only the K x K result is cast to float64. Its entries carry ~1e-7 relative rounding (more for P ~ 2e7), so
  normalised Gram entries (cosines) are accurate to ~1e-6. The QP solves the Gram it is given to float64 rounding
  (see ``qp``), so this rounding, not the solver, limits alpha; pass float64 buffers when that matters.
  float16/bfloat16 buffers are upcast to float32 once (fp16 sums of squares overflow). TF32 is switched off around
  the Gram matmul (and restored): it would make the cosines accurate only to ~1e-3.
- Pareto-stationary gradients (``||sum_k alpha*_k gh_k|| <= 1e-6``, e.g. ``g`` and ``-g``): ``d_final`` is exactly 0
  rather than rounding noise pointing anywhere (the paper's formula gives a vector ~1e-10 of the gradients); the
  cosines are then 0 and no conflict is reported. ``RefreshInfo.direction_norm`` logs ``||sum_k alpha_k gh_k||``.
  The Gram's rounding limits this norm to about the square root of the cosines' accuracy (~1e-3 for float32 Grams,
  ~1e-7 for float64 ones at moderate P), so near-stationary cosines are noisy anyway.
- Silent rewards in the EMA (beyond the paper, ``silent="hold"``): by default a reward without signal at a refresh
  enters Eq. 12 with ``alpha*_k = 0``, so its ``alpha_bar_k`` decays by ``rho`` although the steps that follow may
  hold its prompts. The paper's batches (48 groups) give every reward signal at every refresh, so the choice never
  arises there; with a few prompts per step a specialist is silent at many refreshes. ``"hold"`` keeps a silent
  reward's ``alpha_bar_k`` (and its last gradient norm) and applies Eq. 12 to the active rewards' share:
  ``alpha_bar_S <- rho alpha_bar_S + (1 - rho) (sum_{j in S} alpha_bar_j) alpha*_S``. With every reward active it is
  Eq. 12 exactly.
- Optional final stage (``uniform_final_steps`` out of ``max_steps``): no refreshes, uniform advantage weights.
- Amortised steps (beyond the paper, ``amortised="norm_aware"``): the paper applies ``alpha_bar`` to the batch's
  *un-normalised* gradients, so a reward with a large gradient dominates between refreshes. ``"norm_aware"`` applies
  Eq. 7's own coefficients ``c_k = alpha_bar_k mean_j ||g_j|| / ||g_k||`` with the last refresh's norms instead: by
  Prop. 1 that is still one ordinary backward, with ``A = sum_k (c_k / sum c) A_k`` and the NFT policy term scaled
  by ``sum c`` (:class:`StepWeights`). As on a refresh, rewards without signal this step get ``c_k = 0``.
- Clamp violations (samples with some ``|A_k| > A_max``: only then is an ``r_k`` clipped, which breaks Prop. 1's
  identity; ``|A_k| = A_max`` is still on the affine piece of ``r``) are only counted (not the release's
  ``pareto_fallback_used``: that is the QP fallback); acting on them is the trainer's business.
- Everything is a deterministic function of the Gram: ranks holding bitwise-identical all-reduced buffers get the
  same alpha. If that is not guaranteed, solve on rank 0 and broadcast (``state_dict``/``refresh`` make it easy).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from .diagnostics import cosine_stats, gram_cosines, ieee_fp32_matmul, update_cosines, work_tensor
from .marble_state import BalancerState
from .qp import QPResult, as_float64_matrix, solve_min_norm, solve_normalized_min_norm

__all__ = ["MarbleBalancer", "RefreshInfo", "StepWeights"]

# ||sum_k alpha_k gh_k|| at or below this: the rewards are Pareto-stationary to numerical precision (their unit
# gradients cancel); d_final is then exactly 0 instead of rounding noise, whose cosines would be arbitrary.
PARETO_STATIONARY_TOL = 1e-6

AMORTISED_MODES = ("alpha_bar", "norm_aware")
SILENT_MODES = ("decay", "hold")


@dataclass(frozen=True)
class RefreshInfo:
    """What one refresh did (plain Python values, per reward in ``reward_names`` order).

    ``alpha_star``: the QP's solution (NaN on fallback); ``alpha_used``: the coefficients on the unit gradients actually
    used; ``alpha_bar``: after the EMA; ``active``: the rewards with signal; ``direction_norm``:
    ``||sum_k alpha_k gh_k||`` in [0, 1]; ``pareto_stationary``: the update was set to 0; ``cosines``: cos(update, g_k);
    ``worst_cosine`` / ``mean_cosine`` / ``cosine_var`` / ``conflict``: over the rewards with signal.
    """

    alpha_star: list[float]
    alpha_used: list[float]
    alpha_bar: list[float]
    grad_norms: list[float]
    active: list[bool]
    num_active: int
    direction_norm: float
    pareto_stationary: bool
    cosines: list[float]
    worst_cosine: float
    mean_cosine: float
    cosine_var: float
    conflict: bool
    qp_status: str
    qp_time_s: float
    used_fallback: bool

    def __getitem__(self, key: str) -> Any:  # mapping-style access, as when this was a dict
        return getattr(self, key)


@dataclass(frozen=True)
class StepWeights:
    """MARBLE's plan for one optimizer step (:meth:`MarbleBalancer.plan`)."""

    refresh: bool  # a refresh step: per-reward gradients, the QP, Eq. 7
    advantages: torch.Tensor  # A_bar = sum_k w_k A_k [N]: the single advantage of the step's ordinary backward
    clamp_violations: int  # samples of this step with some |A_k| > A_max (Prop. 1 inexact for them)
    policy_scale: float = 1.0  # sum_k c_k: the factor on the NFT policy term (1 for the paper's alpha_bar; not KL)


class MarbleBalancer(BalancerState):
    """Stateful half of MARBLE: EMA coefficients (Eq. 12), refresh schedule, counters.

    The coefficients, the counters and their checkpoint form (``state_dict``) are inherited from
    :class:`~marble_trl.balance.marble_state.BalancerState`.

    Args:
        num_rewards: K. Give this or ``reward_names`` (or both, consistent).
        reward_names: names used in ``state_dict`` (checked on load) and for the caller's logging.
        rho: EMA factor of Eq. 12 (paper: 0.7). ``rho=0``: alpha_bar = the last alpha*; ``rho=1``: fixed uniform.
        refresh_interval: N; refresh at steps 0, N, 2N, ... (N=1: solve every step).
        uniform_final_steps: length of the optional final stage with uniform weights (needs ``max_steps``, which may
            also be assigned later, once the trainer knows it).
        max_steps: total number of optimizer steps.
        solver: ``Mh (float64 [K', K']) -> QPResult``; default ``qp.solve_min_norm``.
        amortised: ``"alpha_bar"`` (the paper: ``alpha_bar`` on un-normalised gradients) or ``"norm_aware"`` (Eq. 7's
            coefficients with the last refresh's gradient norms; see the module docstring).
        silent: how a reward without signal at a refresh enters the EMA: ``"decay"`` (``alpha*_k = 0``, so
            ``alpha_bar_k`` shrinks by ``rho``) or ``"hold"`` (its ``alpha_bar_k`` and last gradient norm are kept; see
            the module docstring).
    """

    def __init__(
        self,
        num_rewards: int | None = None,
        *,
        reward_names: Sequence[str] | None = None,
        rho: float = 0.7,
        refresh_interval: int = 10,
        uniform_final_steps: int = 0,
        max_steps: int | None = None,
        solver: Callable[[np.ndarray], QPResult] = solve_min_norm,
        amortised: str = "alpha_bar",
        silent: str = "decay",
    ) -> None:
        if reward_names is None:
            if num_rewards is None:
                raise ValueError("give num_rewards or reward_names")
            reward_names = [f"reward_{k}" for k in range(num_rewards)]
        reward_names = [str(n) for n in reward_names]
        if num_rewards is not None and num_rewards != len(reward_names):
            raise ValueError(f"num_rewards={num_rewards} but {len(reward_names)} reward_names")
        if len(reward_names) < 1 or len(set(reward_names)) != len(reward_names):
            raise ValueError(f"need at least one reward and unique names, got {reward_names}")
        if not 0.0 <= rho <= 1.0:
            raise ValueError(f"rho must be in [0, 1], got {rho}")
        if refresh_interval < 1:
            raise ValueError(f"refresh_interval must be >= 1, got {refresh_interval}")
        if amortised not in AMORTISED_MODES:
            raise ValueError(f"amortised must be one of {AMORTISED_MODES}, got {amortised!r}")
        if silent not in SILENT_MODES:
            raise ValueError(f"silent must be one of {SILENT_MODES}, got {silent!r}")
        if uniform_final_steps < 0:
            raise ValueError(f"uniform_final_steps must be >= 0, got {uniform_final_steps}")
        if max_steps is not None and uniform_final_steps > max_steps:
            raise ValueError(f"uniform_final_steps={uniform_final_steps} exceeds max_steps={max_steps}")
        self.reward_names: list[str] = reward_names
        self.rho = float(rho)
        self.refresh_interval = int(refresh_interval)
        self.uniform_final_steps = int(uniform_final_steps)
        self.max_steps = max_steps
        self.solver = solver
        self.amortised = amortised
        self.silent = silent
        self.reset()

    # --------------------------------------------------------------- schedule
    def in_uniform_stage(self, step: int) -> bool:
        """Whether 0-based optimizer step ``step`` lies in the final uniform stage."""
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        if self.uniform_final_steps == 0:
            return False
        if self.max_steps is None:
            raise ValueError("uniform_final_steps > 0 needs max_steps (set balancer.max_steps once known)")
        return step >= self.max_steps - self.uniform_final_steps

    def is_refresh_step(self, step: int) -> bool:
        """Steps 0, N, 2N, ... outside the uniform final stage run the full procedure (``combine``)."""
        return not self.in_uniform_stage(step) and step % self.refresh_interval == 0

    def advantage_weights(
        self, step: int | None = None, *, dtype: torch.dtype = torch.float32, device: torch.device | str | None = None
    ) -> torch.Tensor:
        """Weights w [K] for ``A_bar = sum_k w_k A_k`` on amortised steps: alpha_bar, or uniform in the final stage."""
        if step is not None and self.in_uniform_stage(step):
            w = np.full(self.num_rewards, 1.0 / self.num_rewards)
        else:
            w = self._alpha_bar
        return torch.tensor(w, dtype=dtype, device=device)

    def amortised_coefficients(self, step: int | None, has_signal: torch.Tensor | np.ndarray) -> np.ndarray:
        """The coefficients ``c`` [K] of an amortised step's update ``sum_k c_k g_k`` (float64).

        ``"alpha_bar"`` (the paper): ``c = advantage_weights(step)``, summing to 1, whatever the signal.
        ``"norm_aware"``: ``c_k = w_k mean_j ||g_j|| / ||g_k||`` with the last refresh's norms (the mean over the
        rewards with a gradient then; a reward without one then gets ``c_k = w_k``), and ``c_k = 0`` for rewards
        without signal now (``has_signal`` [K] False), as a refresh does. Before the first refresh: ``w``.
        """
        w = self.advantage_weights(step, dtype=torch.float64).numpy()
        if self.amortised == "alpha_bar" or self._last_grad_norms is None:
            return w
        norms = self._last_grad_norms
        seen = norms > 0
        ratio = np.ones_like(norms)
        if seen.any():
            ratio[seen] = norms[seen].mean() / norms[seen]
        signal = np.asarray(torch.as_tensor(has_signal).cpu(), dtype=bool)
        return np.where(signal, w * ratio, 0.0)

    # ---------------------------------------------------------------- refresh
    def refresh(self, gram: Any, *, min_sq_norm: float = 0.0) -> tuple[np.ndarray, RefreshInfo]:
        """One refresh from the raw K x K Gram ``M_ij = g_i . g_j`` (torch or numpy, any float dtype).

        Returns ``(coeffs, info)`` with ``d_final = sum_k coeffs_k g_k`` (Eq. 7) and a :class:`RefreshInfo` (cosines
        here come from the Gram). Updates alpha_bar (Eq. 12) and the counters. Raises
        ``ValueError`` on NaN/inf before changing any state. Rewards with ``||g_k||^2 <= min_sq_norm`` count as
        having no signal. Useful alone for back-ends that only see the Gram (then use ``advantage_weights``).
        """
        gram64 = as_float64_matrix(gram)
        k = self.num_rewards
        if gram64.shape != (k, k):
            raise ValueError(f"gram must be [{k}, {k}], got {gram64.shape}")
        res, gram_hat, norms, active = solve_normalized_min_norm(gram64, self.solver, min_sq_norm)

        self._num_refreshes += 1
        if res.ok:
            alpha_star = np.array(res.alpha, dtype=np.float64)
            alpha_used = alpha_star
            self._alpha_bar = self._ema(alpha_star, active)
            self._last_alpha_star = alpha_star.copy()
        else:
            # Keep the previous coefficients. Silent rewards contribute no direction, so renormalise over the rest
            # to keep Eq. 7's convex-combination-of-unit-vectors convention.
            self._num_qp_fallbacks += 1
            alpha_star = np.full(k, np.nan)
            w = self._alpha_bar * active
            alpha_used = w / w.sum() if w.sum() > 0 else active / max(active.sum(), 1)
        if active.any():
            kept = self._last_grad_norms if self.silent == "hold" and self._last_grad_norms is not None else 0.0
            self._last_grad_norms = np.where(active, norms, kept)

        coeffs = np.zeros(k)
        a = alpha_used[active]
        direction_norm = math.sqrt(max(float(a @ gram_hat @ a), 0.0)) if active.any() else 0.0
        stationary = direction_norm <= PARETO_STATIONARY_TOL
        if not stationary:
            scale = norms[active].mean()  # Eq. 7: mean ||g_k|| over rewards with signal
            coeffs[active] = a * scale / norms[active]
        cosines = gram_cosines(gram64, coeffs)
        info = RefreshInfo(
            alpha_star=alpha_star.tolist(),
            alpha_used=np.asarray(alpha_used, dtype=np.float64).tolist(),
            alpha_bar=self._alpha_bar.tolist(),
            grad_norms=norms.tolist(),
            active=active.tolist(),
            num_active=int(active.sum()),
            direction_norm=direction_norm,
            pareto_stationary=stationary,
            cosines=cosines.tolist(),
            **cosine_stats(cosines, active),
            qp_status=res.status,
            qp_time_s=res.solve_time_s,
            used_fallback=not res.ok,
        )
        return coeffs, info

    def _ema(self, alpha_star: np.ndarray, active: np.ndarray) -> np.ndarray:
        """Eq. 12 (``silent="decay"``), or Eq. 12 on the active rewards' share of the simplex (``"hold"``)."""
        if self.silent == "hold" and not active.all():
            share = self._alpha_bar[active].sum()
            ema = self._alpha_bar.copy()
            ema[active] = self.rho * self._alpha_bar[active] + (1.0 - self.rho) * share * alpha_star[active]
        else:
            ema = self.rho * self._alpha_bar + (1.0 - self.rho) * alpha_star
        return ema / ema.sum()  # stays on the simplex; renormalising only removes rounding drift

    @torch.no_grad()
    def solve(self, grads: torch.Tensor) -> tuple[np.ndarray, RefreshInfo]:
        """One refresh from K all-reduced gradient buffers ``grads`` [K, P] without forming the update: Eq. 7's
        coefficients ``c`` (``d_final = sum_k c_k g_k``) and the :class:`RefreshInfo` (cosines from the Gram). For
        callers that form the update by Prop. 1 (``policy_scale = sum c``)."""
        k = self.num_rewards
        if grads.ndim != 2 or grads.shape[0] != k:
            raise ValueError(f"grads must be [{k}, P], got shape {tuple(grads.shape)}")
        work = work_tensor(grads)
        with ieee_fp32_matmul():
            gram = torch.mm(work, work.T)  # the only O(K^2 P) work; accumulates in the buffers' dtype
        return self.refresh(gram, min_sq_norm=torch.finfo(work.dtype).tiny)

    @torch.no_grad()
    def combine(self, grads: torch.Tensor) -> tuple[torch.Tensor, RefreshInfo]:
        """The full MARBLE procedure on K all-reduced gradient buffers ``grads`` [K, P] (Eqs. 5-7, 12).

        Returns ``(update [P], info)``; ``update`` has the dtype and device of ``grads``; ``info`` is a
        :class:`RefreshInfo`. Call it on refresh steps (``is_refresh_step``); every call is a refresh.
        """
        coeffs, info = self.solve(grads)
        work = work_tensor(grads)
        c = torch.as_tensor(coeffs, dtype=work.dtype, device=work.device)
        update = c @ work
        # Cosines of the update actually returned (one extra [K, P] x [P] pass), same code as for baselines.
        norms = torch.as_tensor(info.grad_norms, dtype=torch.float64, device=work.device)
        cosines = update_cosines(update, work, grad_norms=norms).tolist()
        info = dataclasses.replace(info, cosines=cosines, **cosine_stats(cosines, info.active))
        return update.to(grads.dtype), info

    # ------------------------------------------------------------ the step API
    def plan(
        self, step: int, per_reward: torch.Tensor, adv_clip_max: float, has_signal: torch.Tensor | None = None
    ) -> StepWeights:
        """Whether 0-based step ``step`` refreshes, and its single advantage ``A = sum_k (c_k / sum c) A_k`` from the
        per-reward advantages ``per_reward`` [K, N], with ``c`` of :meth:`amortised_coefficients` and ``sum c`` as
        ``policy_scale`` (``A_bar = sum_k alpha_bar_k A_k`` and 1 for the paper's ``"alpha_bar"``); counts the clamp
        violations (samples with some ``|A_k| > adv_clip_max``).
        ``has_signal`` [K]: rewards with a non-zero advantage (default: computed from ``per_reward``)."""
        if has_signal is None:
            has_signal = (per_reward != 0).any(dim=1)
        c = self.amortised_coefficients(step, has_signal)
        total = float(c.sum())
        weights = torch.tensor(c / total if total > 0 else c, dtype=per_reward.dtype, device=per_reward.device)
        a_bar = (weights[:, None] * per_reward).sum(dim=0)
        violations = int((per_reward.abs() > adv_clip_max).any(dim=0).sum())
        if violations:
            self.record_clamp_violations(violations)
        return StepWeights(self.is_refresh_step(step), a_bar, violations, policy_scale=total)

    def finish(self, grads: torch.Tensor, has_signal: torch.Tensor) -> tuple[torch.Tensor, RefreshInfo]:
        """A refresh step's update from the all-reduced per-reward gradients [K, P]: the rows of rewards without
        signal this step (``has_signal`` [K] False: all their advantages 0) are zeroed, so the QP leaves them out,
        then :meth:`combine`. The rows of ``grads`` are zeroed in place."""
        grads[~has_signal.to(grads.device)] = 0.0
        return self.combine(grads)
