"""The state of MARBLE's balancer (:class:`~marble_trl.balance.marble.MarbleBalancer`), which it inherits from
:class:`BalancerState`: the EMA coefficients alpha_bar (uniform at first), the last refresh's alpha* and gradient norms,
and the counters (refreshes, QP fallbacks, clamp violations); their reset, and their checkpoint form
(``state_dict`` / ``load_state_dict``: plain Python values, float64 exact, checked on load).
"""

from __future__ import annotations

from typing import Any

import numpy as np

_STATE_KEYS = (
    "reward_names",
    "alpha_bar",
    "last_alpha_star",
    "num_refreshes",
    "num_qp_fallbacks",
    "num_clamp_violations",
)


class BalancerState:
    """The balancer's coefficients and counters, and their checkpoint form; ``reward_names`` is set by the subclass."""

    reward_names: list[str]

    @property
    def num_rewards(self) -> int:
        return len(self.reward_names)

    @property
    def alpha_bar(self) -> np.ndarray:
        """Current EMA coefficients (a copy, float64 [K], on the simplex)."""
        return self._alpha_bar.copy()

    @property
    def last_alpha_star(self) -> np.ndarray | None:
        """alpha* of the last successful refresh, or None."""
        return None if self._last_alpha_star is None else self._last_alpha_star.copy()

    @property
    def last_grad_norms(self) -> np.ndarray | None:
        """``||g_k||`` of the last refresh (0 for rewards without signal then), or None before the first."""
        return None if self._last_grad_norms is None else self._last_grad_norms.copy()

    @property
    def num_refreshes(self) -> int:
        return self._num_refreshes

    @property
    def num_qp_fallbacks(self) -> int:
        """Refreshes that kept the previous coefficients (QP not ok, or no reward with signal)."""
        return self._num_qp_fallbacks

    @property
    def num_clamp_violations(self) -> int:
        """Samples with some ``|A_k| > adv_clip_max`` (not the release's ``pareto_fallback_used``, which is the QP
        fallback: :attr:`num_qp_fallbacks`); see ``record_clamp_violations``."""
        return self._num_clamp_violations

    def reset(self) -> None:
        """Uniform alpha_bar, no alpha*, all counters zero."""
        k = self.num_rewards
        self._alpha_bar = np.full(k, 1.0 / k)
        self._last_alpha_star: np.ndarray | None = None
        self._last_grad_norms: np.ndarray | None = None
        self._num_refreshes = 0
        self._num_qp_fallbacks = 0
        self._num_clamp_violations = 0

    def state_dict(self) -> dict[str, Any]:
        """Plain Python types only (JSON- and ``torch.load(weights_only=True)``-friendly), float64 exact."""
        return {
            "reward_names": list(self.reward_names),
            "alpha_bar": self._alpha_bar.tolist(),
            "last_alpha_star": None if self._last_alpha_star is None else self._last_alpha_star.tolist(),
            "last_grad_norms": None if self._last_grad_norms is None else self._last_grad_norms.tolist(),
            "num_refreshes": self._num_refreshes,
            "num_qp_fallbacks": self._num_qp_fallbacks,
            "num_clamp_violations": self._num_clamp_violations,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        missing = [key for key in _STATE_KEYS if key not in state]
        if missing:
            raise KeyError(f"balancer state is missing {missing}")
        if list(state["reward_names"]) != self.reward_names:
            raise ValueError(f"state is for rewards {list(state['reward_names'])}, balancer has {self.reward_names}")
        alpha_bar = self._check_simplex(state["alpha_bar"], "alpha_bar")
        star = state["last_alpha_star"]
        self._alpha_bar = alpha_bar
        self._last_alpha_star = None if star is None else self._check_simplex(star, "last_alpha_star")
        norms = state.get("last_grad_norms")  # absent in checkpoints written before norm-aware amortisation
        if norms is not None:
            norms = np.asarray(norms, dtype=np.float64).reshape(-1)
            if norms.shape != (self.num_rewards,) or not np.isfinite(norms).all() or (norms < 0).any():
                raise ValueError(f"last_grad_norms must be {self.num_rewards} finite values >= 0, got {norms}")
        self._last_grad_norms = norms
        self._num_refreshes = int(state["num_refreshes"])
        self._num_qp_fallbacks = int(state["num_qp_fallbacks"])
        self._num_clamp_violations = int(state["num_clamp_violations"])

    def _check_simplex(self, values: Any, name: str) -> np.ndarray:
        a = np.asarray(values, dtype=np.float64).reshape(-1)
        if a.shape != (self.num_rewards,) or not np.isfinite(a).all() or (a < 0).any() or abs(a.sum() - 1) > 1e-6:
            raise ValueError(f"{name} must be {self.num_rewards} non-negative finite values summing to 1, got {a}")
        return a  # as saved: renormalising would change the last bits, and a resumed run must continue bit-exactly

    def record_clamp_violations(self, n: int) -> None:
        """Count samples where some ``|A_k| > A_max`` (Prop. 1's identity is then inexact on amortised steps;
        ``|A_k| = A_max`` exactly is not a violation: ``r`` is affine on the closed interval)."""
        if n < 0:
            raise ValueError(f"n must be >= 0, got {n}")
        self._num_clamp_violations += int(n)
