"""The MGDA min-norm QP on the simplex (MARBLE Eq. 6), solved with cvxopt.

``alpha* = argmin_{alpha >= 0, sum alpha = 1} alpha^T M alpha`` where ``M`` is the K x K Gram matrix of the
(normalised) per-reward gradients. Everything here is float64 numpy: no torch autograd is ever touched, so the
solver can run on any rank (or on rank 0 and be broadcast) without side effects.

Choices (see ``solve_min_norm``):
- scale: ``M`` is divided by its largest diagonal entry, so every entry lies in [-1, 1] (Cauchy-Schwarz). cvxopt's
  absolute tolerances misbehave on raw Grams with entries near 1e12 or 1e-16 (status "unknown" or a silently
  uniform answer); after scaling the answer is scale-invariant.
- a ridge ``1e-6 * I`` (on the scaled matrix) makes rank-deficient Grams (duplicated or collinear gradients, K > P)
  strictly convex. It moves the optimum by O(ridge) and, when the Gram is singular, picks the min-||alpha|| solution
  among the many minimisers (e.g. uniform over duplicated gradients).
- tolerances are tighter than cvxopt's defaults (1e-10 instead of 1e-7): the KKT residual drops from ~1e-7 to ~1e-10
  for ~2 extra interior-point iterations (still well under 1 ms for K <= 16).
- options are passed per call (``options=...``); cvxopt's global ``solvers.options`` is never modified.

Zero gradients: ``normalized_gram`` / ``solve_normalized_min_norm`` apply Eq. 5 in Gram space. A reward whose gradient
has zero norm has no direction (``g / ||g||`` would be 0/0); it is **excluded** from the QP and receives alpha 0. It
cannot contribute to the update direction anyway, and giving it weight would only shrink the step.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
from cvxopt import matrix, solvers

__all__ = ["QPResult", "as_float64_matrix", "normalized_gram", "solve_min_norm", "solve_normalized_min_norm"]

# Interior-point tolerances; see the module docstring.
_CVXOPT_OPTIONS = {"show_progress": False, "abstol": 1e-10, "reltol": 1e-10, "feastol": 1e-10, "maxiters": 100}
# How far outside the simplex the raw solver output may be before we call the solve failed.
_FEASIBILITY_TOL = 1e-6


@dataclass(frozen=True)
class QPResult:
    """Result of one min-norm solve.

    ``alpha`` is a read-only float64 array on the simplex. When ``ok`` is False the caller must not use ``alpha``
    (it is a best-effort point, uniform if nothing finite came back) and should keep its previous coefficients.
    """

    alpha: np.ndarray
    status: str
    ok: bool
    solve_time_s: float


def _result(alpha: np.ndarray, status: str, ok: bool, t0: float) -> QPResult:
    alpha = np.ascontiguousarray(alpha, dtype=np.float64)
    alpha.flags.writeable = False
    return QPResult(alpha=alpha, status=status, ok=ok, solve_time_s=time.perf_counter() - t0)


@functools.lru_cache(maxsize=64)
def _constraints(k: int) -> tuple[Any, Any, Any, Any, Any]:
    """q, G, h, A, b for the simplex (``-alpha <= 0``, ``1^T alpha = 1``); cvxopt does not mutate them."""
    return (
        matrix(0.0, (k, 1)),
        matrix(-np.eye(k)),
        matrix(0.0, (k, 1)),
        matrix(1.0, (1, k)),
        matrix(1.0),
    )


def as_float64_matrix(gram: Any) -> np.ndarray:
    """A float64 numpy copy of a square matrix given as a torch tensor, numpy array or nested sequence."""
    if hasattr(gram, "detach"):  # torch.Tensor, without importing torch here
        gram = gram.detach().to("cpu").double().numpy()
    m = np.array(gram, dtype=np.float64, copy=True)
    if m.ndim != 2 or m.shape[0] != m.shape[1] or m.shape[0] == 0:
        raise ValueError(f"gram must be a non-empty square matrix, got shape {m.shape}")
    return m


def _check_finite(m: np.ndarray, what: str) -> None:
    if not np.isfinite(m).all():
        bad = "NaN" if np.isnan(m).any() else "inf"
        raise ValueError(f"{what} contains {bad} entries; refusing to solve (skip the step or fix the gradients)")


def solve_min_norm(gram: Any, *, ridge: float = 1e-6) -> QPResult:
    """Solve ``min alpha^T M alpha`` over the simplex for a PSD ``M`` (K x K, torch or numpy, any float dtype).

    Raises ``ValueError`` for a non-square/empty matrix, NaN/inf entries or a negative diagonal (not a Gram).
    Solver trouble is *not* an exception: it returns ``ok=False`` so the caller can keep its previous coefficients.
    """
    t0 = time.perf_counter()
    m = as_float64_matrix(gram)
    _check_finite(m, "gram")
    k = m.shape[0]
    if k == 1:
        return _result(np.ones(1), "trivial", True, t0)
    diag = np.diag(m)
    if (diag < 0).any():
        raise ValueError(f"gram has a negative diagonal entry ({diag.min():.3g}); it is not a Gram matrix")
    scale = diag.max()
    if scale == 0.0:  # all gradients zero: every alpha is optimal, uniform is the natural one
        return _result(np.full(k, 1.0 / k), "zero_gram", True, t0)
    m = (m + m.T) / (2.0 * scale)
    if not np.isfinite(m).all():  # possible only for a non-PSD input with a denormal diagonal
        return _result(np.full(k, 1.0 / k), "scaling_overflow", False, t0)
    m[np.diag_indices(k)] += ridge

    q, g, h, a, b = _constraints(k)
    try:
        sol = solvers.qp(matrix(m), q, g, h, a, b, options=_CVXOPT_OPTIONS)
    except (ValueError, ArithmeticError) as e:  # singular KKT system, domain error
        return _result(np.full(k, 1.0 / k), f"error: {e}", False, t0)

    x = np.array(sol["x"], dtype=np.float64).ravel()
    status = str(sol["status"])
    if not np.isfinite(x).all():
        return _result(np.full(k, 1.0 / k), f"{status} (non-finite)", False, t0)
    feasible = x.min() >= -_FEASIBILITY_TOL and abs(x.sum() - 1.0) <= _FEASIBILITY_TOL
    # Interior-point iterates can sit a hair outside the simplex: clip tiny negatives, renormalise.
    x = np.clip(x, 0.0, None)
    total = x.sum()
    x = x / total if total > 0 else np.full(k, 1.0 / k)
    if status != "optimal":
        return _result(x, status, False, t0)
    if not feasible:
        return _result(x, "infeasible", False, t0)
    return _result(x, status, True, t0)


def normalized_gram(gram: Any, min_sq_norm: float = 0.0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Eq. 5 in Gram space: ``Mh_ij = M_ij / (||g_i|| ||g_j||)`` restricted to rewards with signal.

    Returns ``(gram_hat [K', K'], norms [K], active [K] bool)`` where ``norms = sqrt(diag M)`` and ``active`` marks
    rewards with ``||g_k||^2 > min_sq_norm`` (K' = active.sum()). Entries of ``gram_hat`` are cosines: they are
    clipped to [-1, 1] and the diagonal is set to exactly 1 (rounding in a float32 Gram can leave 1 +- 1e-7).
    Raises ``ValueError`` on NaN/inf or a negative diagonal.
    """
    m = as_float64_matrix(gram)
    _check_finite(m, "gram")
    sq = np.diag(m).copy()
    if (sq < 0).any():
        raise ValueError(f"gram has a negative diagonal entry ({sq.min():.3g}); it is not a Gram matrix")
    active = sq > max(min_sq_norm, 0.0)
    norms = np.sqrt(sq)
    n = norms[active]
    mh = m[np.ix_(active, active)] / np.outer(n, n)  # no 0/0: inactive rows are dropped first
    mh = np.clip(0.5 * (mh + mh.T), -1.0, 1.0)
    mh[np.diag_indices(mh.shape[0])] = 1.0
    return mh, norms, active


def solve_normalized_min_norm(
    gram: Any,
    solver: Callable[[np.ndarray], QPResult] = solve_min_norm,
    min_sq_norm: float = 0.0,
) -> tuple[QPResult, np.ndarray, np.ndarray, np.ndarray]:
    """Normalise a raw Gram (Eq. 5), drop zero-gradient rewards, solve Eq. 6 on the rest.

    Returns ``(result, gram_hat, norms, active)``; ``result.alpha`` has length K with zeros at inactive rewards.
    With no active reward the result is ``ok=False, status="no_signal"`` (nothing to balance).
    """
    t0 = time.perf_counter()
    mh, norms, active = normalized_gram(gram, min_sq_norm)
    k = active.shape[0]
    if not active.any():
        return _result(np.full(k, 1.0 / k), "no_signal", False, t0), mh, norms, active
    res = solver(mh)
    alpha = np.zeros(k)
    alpha[active] = res.alpha
    alpha.flags.writeable = False
    return QPResult(alpha, res.status, res.ok, res.solve_time_s), mh, norms, active
