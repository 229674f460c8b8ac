"""MARBLE as its authors released it: the balancer of aim-uofa/MARBLE @ 1bf9543 (``train.py``,
``flow_grpo/pareto_balancer/balancer.py`` and ``mgda.py``), which differs from the paper's text
(:class:`~marble_trl.balance.marble.MarbleBalancer`) in what a refresh is.

The released step loops over its (micro-batch, timestep) *pairs* (micro-batches outer). Each pair is either

- **solved** (``use_cached`` false: no coefficients yet, ``step < warmup_steps``, or ``step - last_full >= N``): the
  pair's K per-reward gradients (non-applicable samples masked out of each reward's mean), all-reduced (mean over
  processes), go through :meth:`ReleasedMarble.solve`: validity (finite, ``||g|| > 1e-12``), normalisation, the
  min-norm QP over the valid ones, Eq. 7's rescale by their mean norm; the pair's update is ``d + g_KL``. Then the
  EMA ``alpha_bar <- rho alpha_bar + (1 - rho) alpha*`` (the first solve *sets* ``alpha_bar = alpha*``; fallbacks
  enter it too; no renormalisation) and ``last_full = step``;
- or **amortised**: one ordinary backward with ``A = sum_k alpha_bar_{g(k)} / n_g * A_k`` (non-applicable: 0).

So every pair of step 0 is solved (192 solves and EMA updates in the 5-reward recipe), and at steps N, 2N, ... only the
step's first pair is; the step's other pairs are amortised with the coefficients that pair just refreshed.

Every released update is linear in the per-reward gradients, ``d = sum_k c_k g_k`` (:attr:`PairSolve.coefficients`):
the trainer applies it as one ordinary backward with per-sample weights (Prop. 1 with masks), which is what lets it
run through DeepSpeed and FSDP2 as well.

Fallbacks (balancer.py): no valid gradient: ``d = 0``, ``alpha = 0``; one valid: its raw gradient, ``alpha`` one-hot;
the QP fails: the mean of the unit gradients, ``alpha`` uniform over the valid ones. The optional knobs of the release
(all off there): ``alpha_floor`` (``alpha >= floor``, capped at ``1 / K_valid``), ``groups`` (the QP sees each group's
*mean* gradient; amortised pairs give each member ``alpha_bar_g / n_g``), ``mgda_weights`` (unit gradients scaled by
``w_g`` before the QP and in the update; not in amortised pairs), ``normalize=False`` (no Eq. 5/7), and reward dropout
(:meth:`ReleasedMarble.dropped`).

Deviations from the release (documented in docs/marble.md):
- The QP is solved by :func:`~marble_trl.balance.qp.solve_min_norm` (cvxopt, then an exact active-set polish) instead
  of scipy's SLSQP (``ftol 1e-8``): the same minimiser to ~1e-8; where the Gram is singular the minimiser's weights are
  not unique and the two may pick different ones (the update ``d`` is the same). A floor uses cvxopt directly.
- The Gram is formed in float32 without TF32 (the release's TF32 Gram carries ~1e-3 relative error).
- Non-finite per-reward gradients skip the step (the trainer's guard) where the release zeroes the entries.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from .qp import as_float64_matrix, solve_min_norm

GRAD_EPS = 1e-12  # pareto.grad_eps: a gradient at or below this norm is not valid
FALLBACKS = ("none", "all_zero", "single_valid", "solver_failed")
_STATE_KEYS = ("reward_names", "qp_names", "alpha_bar", "last_full", "num_solves", "num_fallbacks")


@dataclass(frozen=True)
class PairSolve:
    """One solved pair. Per QP input (a group, or a reward of its own; :attr:`ReleasedMarble.qp_names` order):
    ``alpha`` (0 for invalid ones), ``grad_norms`` (of the raw, possibly group-mean, gradients), ``valid``; per
    reward: ``coefficients`` ``c`` of the pair's update ``d = sum_k c_k g_k``."""

    coefficients: np.ndarray
    alpha: np.ndarray
    grad_norms: np.ndarray
    valid: np.ndarray
    rescale: float  # pareto_rescale_factor: mean ||g|| over the valid inputs (0 without; ||g_v|| with one)
    fallback: str  # one of FALLBACKS ("none": the QP's solution)
    qp_status: str
    qp_time_s: float


class ReleasedMarble:
    """The released MARBLE's coefficients: per-pair solves, the EMA of Eq. 12 without a prior, the cached schedule.

    Args:
        reward_names: the K rewards, in the trainer's order.
        rho: ``alpha_ema_decay`` (0.7; 0: ``alpha_bar`` is the latest ``alpha*``).
        refresh_interval: ``amortize_every_n`` N (10).
        warmup_steps: ``amortize_warmup`` (1): steps before it solve every pair.
        alpha_floor: ``alpha_k >= floor`` in the QP (0).
        groups: ``{group: [reward, ...]}`` averaged before the QP (none).
        mgda_weights: ``{group or reward: w}`` on the unit gradients (none: 1).
        normalize: Eq. 5 / Eq. 7 (True).
        dropout_targets, dropout_prob, dropout_warmup_steps: reward dropout (off).
    """

    def __init__(
        self,
        reward_names: Sequence[str],
        *,
        rho: float = 0.7,
        refresh_interval: int = 10,
        warmup_steps: int = 1,
        alpha_floor: float = 0.0,
        groups: dict[str, Sequence[str]] | None = None,
        mgda_weights: dict[str, float] | None = None,
        normalize: bool = True,
        dropout_targets: Sequence[str] = (),
        dropout_prob: float = 0.0,
        dropout_warmup_steps: int = 0,
    ) -> None:
        self.reward_names = [str(n) for n in reward_names]
        if not self.reward_names or len(set(self.reward_names)) != len(self.reward_names):
            raise ValueError(f"need at least one reward and unique names, got {self.reward_names}")
        if not 0.0 <= rho < 1.0:
            raise ValueError(f"rho must be in [0, 1), got {rho}")
        if refresh_interval < 1 or warmup_steps < 0:
            raise ValueError(
                f"refresh_interval must be >= 1 and warmup_steps >= 0, got {refresh_interval}, {warmup_steps}"
            )
        if alpha_floor < 0:
            raise ValueError(f"alpha_floor must be >= 0, got {alpha_floor}")
        self.rho, self.refresh_interval, self.warmup_steps = float(rho), int(refresh_interval), int(warmup_steps)
        self.alpha_floor, self.normalize = float(alpha_floor), bool(normalize)
        self.qp_names, self.members = _qp_inputs(self.reward_names, groups or {})
        unknown = sorted(set(mgda_weights or {}) - set(self.qp_names))
        if unknown:
            raise ValueError(
                f"marble_mgda_weights names {unknown}, which are neither a reward nor a group ({self.qp_names})."
            )
        self.mgda_weights = np.array([float((mgda_weights or {}).get(n, 1.0)) for n in self.qp_names])
        unknown = sorted(set(dropout_targets) - set(self.reward_names))
        if unknown:
            raise ValueError(
                f"marble_reward_dropout_targets names {unknown}, which are not rewards ({self.reward_names})."
            )
        self.dropout_targets = [n for n in self.reward_names if n in set(dropout_targets)]
        self.dropout_prob, self.dropout_warmup_steps = float(dropout_prob), int(dropout_warmup_steps)
        # [G, K]: row g averages its members' gradients (the QP input of group g)
        self._mean = np.zeros((len(self.qp_names), len(self.reward_names)))
        for g, members in enumerate(self.members):
            self._mean[g, members] = 1.0 / len(members)
        self.reset()

    # ------------------------------------------------------------------ state
    @property
    def num_rewards(self) -> int:
        return len(self.reward_names)

    @property
    def alpha_bar(self) -> np.ndarray | None:
        """``alpha_bar`` per QP input (a copy), or None before the first solve."""
        return None if self._alpha_bar is None else self._alpha_bar.copy()

    @property
    def last_full(self) -> int:
        """The step of the latest solve (-1 before the first)."""
        return self._last_full

    def reset(self) -> None:
        self._alpha_bar: np.ndarray | None = None
        self._last_full = -1
        self.num_solves = 0
        self.num_fallbacks = {reason: 0 for reason in FALLBACKS[1:]}

    def state_dict(self) -> dict[str, Any]:
        return {
            "reward_names": list(self.reward_names),
            "qp_names": list(self.qp_names),
            "alpha_bar": None if self._alpha_bar is None else self._alpha_bar.tolist(),
            "last_full": self._last_full,
            "num_solves": self.num_solves,
            "num_fallbacks": dict(self.num_fallbacks),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        missing = [key for key in _STATE_KEYS if key not in state]
        if missing:
            raise KeyError(f"released MARBLE state is missing {missing}")
        if list(state["reward_names"]) != self.reward_names or list(state["qp_names"]) != self.qp_names:
            raise ValueError(
                f"state is for rewards {list(state['reward_names'])} (QP inputs {list(state['qp_names'])}), this run "
                f"has {self.reward_names} ({self.qp_names})"
            )
        alpha = state["alpha_bar"]
        self._alpha_bar = None if alpha is None else np.asarray(alpha, dtype=np.float64)
        self._last_full = int(state["last_full"])
        self.num_solves = int(state["num_solves"])
        self.num_fallbacks = {reason: int(state["num_fallbacks"].get(reason, 0)) for reason in FALLBACKS[1:]}

    # --------------------------------------------------------------- schedule
    def solves(self, step: int) -> bool:
        """Whether a pair of 0-based optimizer step ``step`` is solved (train.py's ``not use_cached``)."""
        cached = self._alpha_bar is not None and step >= self.warmup_steps
        return not (cached and step - self._last_full < self.refresh_interval)

    def amortised_weights(self) -> np.ndarray:
        """Each reward's weight on its advantage in an amortised pair: ``alpha_bar_{g(k)} / n_g`` (float64 [K])."""
        if self._alpha_bar is None:
            raise RuntimeError("no coefficients yet: the first pair of a run is always solved")
        return self._alpha_bar @ self._mean

    def dropped(self, step: int, slot: int) -> np.ndarray:
        """Reward dropout of slot ``slot`` of step ``step`` (the same on every micro-batch and process): [K] bool.

        ``p = min(step / warmup, 1) prob`` (``prob`` without warmup); one ``torch.rand`` per target reward in order
        from a generator seeded ``1000 step + slot``. A dropped reward loses the samples where a non-target reward
        applies (its mask in a solve, its advantage in an amortised pair)."""
        out = np.zeros(self.num_rewards, dtype=bool)
        if not self.dropout_targets or self.dropout_prob <= 0:
            return out
        warm = self.dropout_warmup_steps
        prob = self.dropout_prob * (min(step / warm, 1.0) if warm > 0 else 1.0)
        generator = torch.Generator().manual_seed(1000 * step + slot)
        for name in self.dropout_targets:
            out[self.reward_names.index(name)] = torch.rand(1, generator=generator).item() < prob
        return out

    def sample_masks(self, applicable: torch.Tensor, dropped: np.ndarray) -> torch.Tensor:
        """[K, B] bool: where each reward counts in this pair (applicable, minus a dropped reward's samples where a
        non-target reward applies)."""
        masks = applicable.clone()
        if dropped.any():
            targets = torch.tensor([n in self.dropout_targets for n in self.reward_names], device=applicable.device)
            non_target = applicable[~targets].any(dim=0)
            masks[torch.as_tensor(dropped, device=applicable.device)] &= ~non_target
        return masks

    # ------------------------------------------------------------------ solve
    def solve(self, grads: torch.Tensor, step: int) -> PairSolve:
        """A solved pair from its all-reduced per-reward gradients ``grads`` [K, P]: the update's coefficients, then
        the EMA and ``last_full = step``. Raises ``ValueError`` on non-finite gradients before changing any state."""
        if grads.ndim != 2 or grads.shape[0] != self.num_rewards:
            raise ValueError(f"grads must be [{self.num_rewards}, P], got {tuple(grads.shape)}")
        work = grads.float() if grads.dtype in (torch.float16, torch.bfloat16) else grads
        if not torch.isfinite(work).all():
            raise ValueError("the per-reward gradients are not finite")
        from .diagnostics import ieee_fp32_matmul

        with torch.no_grad(), ieee_fp32_matmul():
            gram = as_float64_matrix(torch.mm(work, work.T))
        return self.solve_pair_gram(gram, step)

    def solve_pair_gram(self, gram_rewards: np.ndarray | torch.Tensor, step: int) -> PairSolve:
        """:meth:`solve` from the pair's per-reward Gram ``M_kl = g_k . g_l`` [K, K] (of the all-reduced gradients;
        the ``layer_gram`` engine's), then the EMA and ``last_full = step``. Raises ``ValueError`` on a non-finite
        Gram before changing any state."""
        gram = as_float64_matrix(gram_rewards)
        if gram.shape != (self.num_rewards, self.num_rewards):
            raise ValueError(f"the Gram must be [{self.num_rewards}, {self.num_rewards}], got {gram.shape}")
        if not np.isfinite(gram).all():
            raise ValueError("the per-reward gradients are not finite")
        result = self.solve_gram(gram)
        self._update(result.alpha, step)
        if result.fallback != "none":
            self.num_fallbacks[result.fallback] += 1
        return result

    def solve_gram(self, gram_rewards: np.ndarray) -> PairSolve:
        """:meth:`solve` on the per-reward Gram ``M_kl = g_k . g_l`` [K, K], without touching the state."""
        import time

        start = time.perf_counter()
        gram = self._mean @ as_float64_matrix(gram_rewards) @ self._mean.T  # Gram of the QP inputs
        norms = np.sqrt(np.clip(np.diag(gram), 0.0, None))
        valid = norms > GRAD_EPS
        n_in = len(self.qp_names)
        alpha, c_in = np.zeros(n_in), np.zeros(n_in)  # c_in: the update's coefficient on each QP input's gradient
        status, rescale = "", 0.0
        if not valid.any():
            fallback = "all_zero"
        elif valid.sum() == 1:
            fallback = "single_valid"
            alpha[valid], c_in[valid] = 1.0, 1.0  # the raw gradient: not normalised, not weighted
            rescale = float(norms[valid][0])
        else:
            idx = np.flatnonzero(valid)
            unit = 1.0 / np.maximum(norms[idx], GRAD_EPS) if self.normalize else np.ones(len(idx))
            scale = unit * self.mgda_weights[idx]  # g_hat_g = w_g g_g / ||g_g||
            gram_hat = gram[np.ix_(idx, idx)] * np.outer(scale, scale)
            a, ok, status = self._qp(gram_hat)
            fallback = "none" if ok else "solver_failed"
            if not ok:
                a = np.full(len(idx), 1.0 / len(idx))
            rescale = float(norms[idx].mean()) if self.normalize else 1.0
            alpha[idx] = a
            c_in[idx] = a * scale * rescale
        coefficients = c_in @ self._mean  # d = sum_g c_g mean_{k in g} g_k
        return PairSolve(coefficients, alpha, norms, valid, rescale, fallback, status, time.perf_counter() - start)

    def _qp(self, gram_hat: np.ndarray) -> tuple[np.ndarray, bool, str]:
        k = gram_hat.shape[0]
        floor = min(self.alpha_floor, 1.0 / k)  # mgda.py caps an infeasible floor at 1 / K_valid
        if floor <= 0:
            res = solve_min_norm(gram_hat)
            return np.asarray(res.alpha, dtype=np.float64), res.ok, res.status
        return _solve_with_floor(gram_hat, floor)

    def _update(self, alpha: np.ndarray, step: int) -> None:
        if self.rho > 0 and self._alpha_bar is not None:
            self._alpha_bar = self.rho * self._alpha_bar + (1.0 - self.rho) * alpha
        else:
            self._alpha_bar = alpha.astype(np.float64).copy()
        self._last_full = int(step)
        self.num_solves += 1


def _qp_inputs(reward_names: list[str], groups: dict[str, Sequence[str]]) -> tuple[list[str], list[list[int]]]:
    """The QP's inputs (train.py 816-845): the groups with a member among the rewards, in the dict's order, then the
    rewards of no group, in order; and each input's reward indices."""
    names, members, seen = [], [], set()
    for group, rewards in groups.items():
        if group in reward_names:
            raise ValueError(f"marble_reward_groups: group {group!r} has the name of a reward; name it otherwise.")
        idx = [reward_names.index(r) for r in rewards if r in reward_names]
        unknown = [r for r in rewards if r not in reward_names]
        if unknown:
            raise ValueError(
                f"marble_reward_groups: group {group!r} names {unknown}, which are not rewards ({reward_names})."
            )
        twice = [reward_names[i] for i in idx if i in seen]
        if twice:
            raise ValueError(f"marble_reward_groups: rewards {twice} are in two groups.")
        if idx:
            names.append(group)
            members.append(idx)
            seen.update(idx)
    for i, name in enumerate(reward_names):
        if i not in seen:
            names.append(name)
            members.append([i])
    return names, members


def _solve_with_floor(gram_hat: np.ndarray, floor: float) -> tuple[np.ndarray, bool, str]:
    """``argmin a^T G a`` over ``a >= floor``, ``sum a = 1`` (cvxopt), clipped at the floor and renormalised as
    mgda.py does."""
    import cvxopt

    k = gram_hat.shape[0]
    scale = max(float(np.max(np.diag(gram_hat))), 1e-300)
    p = cvxopt.matrix(gram_hat / scale + 1e-12 * np.eye(k))
    sol = cvxopt.solvers.qp(
        p, cvxopt.matrix(np.zeros(k)), cvxopt.matrix(-np.eye(k)), cvxopt.matrix(np.full(k, -floor)),
        cvxopt.matrix(np.ones((1, k))), cvxopt.matrix(1.0),
        options={"show_progress": False, "abstol": 1e-12, "reltol": 1e-12, "feastol": 1e-12},
    )  # fmt: skip
    a = np.clip(np.array(sol["x"], dtype=np.float64).ravel(), floor, None)
    ok = str(sol["status"]) == "optimal" and np.isfinite(a).all()
    return a / max(a.sum(), 1e-12), ok, str(sol["status"])
