"""The MGDA min-norm QP on the simplex (MARBLE Eq. 6): cvxopt, then an exact active-set polish.

``alpha* = argmin_{alpha >= 0, sum alpha = 1} f(alpha)``, ``f(alpha) = alpha^T M alpha``, where ``M`` is the K x K Gram
matrix of the (normalised) per-reward gradients ``g_k``. Everything here is float64 numpy: no torch autograd is ever
touched, so the solver can run on any rank (or on rank 0 and be broadcast) without side effects.

Stage 1, cvxopt (``solve_min_norm``):
- scale: ``M`` is divided by its largest diagonal entry, so every entry lies in [-1, 1] (Cauchy-Schwarz). cvxopt's
  absolute tolerances misbehave on raw Grams with entries near 1e12 or 1e-16 (status "unknown" or a silently
  uniform answer); cvxopt only ever sees the scaled matrix.
- a ridge ``ridge * I`` (default 1e-6, on the scaled matrix) makes rank-deficient Grams (duplicated or collinear
  gradients, K > P) strictly convex for the interior-point method. It perturbs the problem: cvxopt's point is off
  by up to ``ridge * max_k M_kk`` in objective, plus its ``abstol`` (1e-10 of ``max_k M_kk``). That is small against
  the largest gradient but not against the optimum: gradients whose ``M_kk`` lie below ~1e-6 of the largest look
  alike under the ridge, and an optimum ``f* << 1e-6 max_k M_kk`` (nearly cancelling gradients) is swamped by it.
  Measured against an exact solution (tests/test_qp.py families): relative objective gaps up to 7e5 for diagonals
  spanning 1e12, 2e13 for diagonals from 1e-8 to 1e12, 1e6 for nearly opposite gradients.
- tolerances are tighter than cvxopt's defaults (1e-10 instead of 1e-7); options are passed per call
  (``options=...``); cvxopt's global ``solvers.options`` is never modified.

Stage 2, polish (``polish=True``, the default): cvxopt's point only seeds a primal active-set method on the
un-regularised scaled Gram (``_polish``):
- exact duplicates (identical rows of ``M``: the same gradient twice) are merged into one variable whose weight is
  split equally afterwards, so duplicates always get the uniform, min-||alpha|| split;
- each face ``{alpha_i = 0 off a support S}`` is minimised exactly in Jacobi-scaled coordinates (the cosine matrix
  ``D^-1/2 M D^-1/2``, ``D = diag M``), so a diagonal spanning any range loses no accuracy; eigenvalues at rounding
  level (``8 |S| eps lambda_max``) count as zero, which is how rank-deficient faces are solved. Among several
  minimisers the one of least ``sum_k M_kk alpha_k^2`` is taken (for unit-norm gradients: least ||alpha||).
- the point is accepted (``result.polished = True``) only if it passes a KKT certificate at the rounding level of
  evaluating ``(M alpha)_i``: with ``s_i = sqrt(M_ii) = ||g_i||``, ``sigma = sum_j s_j alpha_j`` and
  ``tol_i = 16 K eps sigma (s_i + sigma)`` (homogeneous in ``M``, so the same on the raw and the scaled Gram):
  ``alpha >= 0``, ``sum alpha = 1``, ``|(M alpha)_i - f(alpha)| <= tol_i`` where ``alpha_i > 0`` and
  ``(M alpha)_i >= f(alpha) - tol_i`` elsewhere; and its objective must not exceed cvxopt's point's.

What the result guarantees:
- ``polished``: for a PSD ``M``, convexity turns the certificate into ``f(alpha) - f* <= 2 sum_i alpha*_i tol_i
  = 32 K eps sigma (sigma + sigma*)`` (``sigma* = sum_i alpha*_i s_i``; plus ``2 K eps f`` because ``sum alpha = 1``
  holds to rounding). Relative to the optimum that is about ``64 K eps sigma^2 / f*``: float64 rounding unless the
  gradients cancel (``f* << sigma^2``), where no float64 solver can do better, since the Gram's own entries carry
  rounding of order ``eps sigma^2`` near the optimum. Independent of ``ridge`` and of cvxopt's tolerances. The
  no-conflict property holds to the same level: ``g_i . d >= ||d||^2 - tol_i`` for ``d = sum_k alpha_k g_k``.
- not ``polished`` but ``ok`` (the refinement could not certify: degenerate cycling, or a Gram that is not PSD):
  cvxopt's point, with stage 1's accuracy ``f(alpha) - f* <~ (ridge + 1e-10) max_k M_kk``.
- ``solve_time_s`` covers both stages: about 1-1.5 ms for K <= 16 on one CPU core, the polish 0.3-0.5 ms of it.

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

# Interior-point tolerances (stage 1); see the module docstring.
_CVXOPT_OPTIONS = {"show_progress": False, "abstol": 1e-10, "reltol": 1e-10, "feastol": 1e-10, "maxiters": 100}
# How far outside the simplex the raw solver output may be before we call the solve failed.
_FEASIBILITY_TOL = 1e-6
_EPS = float(np.finfo(np.float64).eps)
# Polish (``_polish``): eigenvalues of the cosine matrix below _NULL_RTOL * n * eps * lambda_max count as zero;
# KKT multipliers are certified to _KKT_RTOL * K * eps * sigma * (s_i + sigma) (see ``_kkt_tolerance``).
_NULL_RTOL = 8.0
_KKT_RTOL = 16.0


@dataclass(frozen=True)
class QPResult:
    """Result of one min-norm solve.

    ``alpha`` is a read-only float64 array on the simplex. When ``ok`` is False the caller must not use ``alpha``
    (it is a best-effort point, uniform if nothing finite came back) and should keep its previous coefficients.
    ``polished``: ``alpha`` passed the polish's KKT certificate (see the module docstring for what that guarantees);
    False for cvxopt's own point and for the trivial cases (K = 1, all-zero Gram), which are exact anyway.
    """

    alpha: np.ndarray
    status: str
    ok: bool
    solve_time_s: float
    polished: bool = False


def _result(alpha: np.ndarray, status: str, ok: bool, t0: float, polished: bool = False) -> QPResult:
    alpha = np.ascontiguousarray(alpha, dtype=np.float64)
    alpha.flags.writeable = False
    return QPResult(alpha=alpha, status=status, ok=ok, solve_time_s=time.perf_counter() - t0, polished=polished)


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


def _duplicate_groups(m: np.ndarray) -> list[list[int]]:
    """Indices grouped by identical rows, in order of first appearance. For a symmetric ``m`` equal rows i, j
    mean ``M_ii = M_ij = M_jj``, i.e. ``||g_i - g_j||^2 = 0``: the same gradient given twice."""
    same = (m[:, None, :] == m[None, :, :]).all(axis=2)
    first = same.argmax(axis=1)  # the lowest index with the same row
    return [np.flatnonzero(first == i).tolist() for i in np.unique(first)]


def _face_minimiser(m: np.ndarray, idx: np.ndarray, s: np.ndarray) -> np.ndarray | None:
    """``argmin a^T M a`` over ``{a : a_i = 0 off idx, 1^T a = 1}`` (no sign constraint), as weights on ``idx``.

    ``s = sqrt(diag M)``. A face holding zero gradients (``M_ii = 0``) has minimum 0 there (for a PSD ``M`` their
    rows are 0): uniform weight on them. Otherwise the face is solved in Jacobi-scaled coordinates ``b = D^(1/2) a``
    (``D = diag M``): ``C = D^(-1/2) M D^(-1/2)`` is the cosine matrix, whose entries carry the same absolute
    rounding whatever the gradients' sizes, so a Gram whose diagonal spans 1e-20 loses nothing to the scaling. With
    ``w = D^(-1/2) 1`` the minimiser is ``b ~ C^+ w``, or ``b ~ P_null(C) w`` when ``w`` has a component in the
    null space (minimum 0). Eigenvalues of ``C`` at or below ``tau = _NULL_RTOL * n * eps * lambda_max`` (rounding
    level) count as zero; ``w``'s null component is used when it dominates the regularised solution
    ``(C + tau I)^-1 w``, i.e. ``||P_null w||^2 / tau > w^T C^+ w``. Among several minimisers (a singular face)
    this is the one of least ``||b||^2 = sum_k M_kk a_k^2``.
    """
    sj = s[idx]
    zero = sj == 0.0
    if zero.any():
        return zero / zero.sum()
    w = 1.0 / sj
    w = w / w.max()  # a ~ w * b is invariant to scaling w
    c = m[np.ix_(idx, idx)] / sj[:, None] / sj[None, :]  # |M_ij| <= s_i s_j: no overflow even for denormal s
    lam, vec = np.linalg.eigh(0.5 * (c + c.T))
    lmax = lam.max()
    if not lmax > 0.0:  # not a Gram (positive diagonal, no positive eigenvalue)
        return None
    tau = _NULL_RTOL * len(idx) * _EPS * lmax
    null = lam <= tau
    coef = vec.T @ w
    q = float(np.sum(coef[~null] ** 2 / lam[~null]))
    vn2 = float(np.sum(coef[null] ** 2))
    if vn2 > tau * q:
        b = vec[:, null] @ coef[null]
    else:
        b = vec[:, ~null] @ (coef[~null] / lam[~null])
    a = w * b
    total = a.sum()
    if not (np.isfinite(total) and total > 0.0):
        return None
    return a / total


def _kkt_tolerance(a: np.ndarray, s: np.ndarray, k: int) -> np.ndarray:
    """Rounding level of ``(M a)_i - a^T M a`` for each i: ``|M_ij| <= s_i s_j`` (``s = sqrt diag M``), so
    computing ``(M a)_i`` errs by ``<= K eps s_i sigma`` and ``a^T M a`` by ``<= K eps sigma^2``, with
    ``sigma = sum_j s_j a_j = sum_j a_j ||g_j||``. ``_KKT_RTOL`` covers the face solve's backward error too."""
    sigma = float(s @ a)
    return _KKT_RTOL * k * _EPS * sigma * (s + sigma)


def _polish(m: np.ndarray, x0: np.ndarray, support0: np.ndarray) -> np.ndarray | None:
    """Primal active-set method for the un-regularised QP, started from cvxopt's point; None if it cannot certify.

    ``m`` is the scaled symmetric Gram without ridge, ``x0`` a point of the simplex and ``support0`` the indices
    it treats as free. Each iteration minimises exactly on the current face (``_face_minimiser``); a face minimiser
    with negative weights is approached until the first weight reaches 0, which then leaves the face; a KKT
    multiplier ``(M a)_i - a^T M a`` below ``-_kkt_tolerance`` brings index i in. The returned point satisfies
    ``a >= 0``, ``1^T a = 1`` and ``|(M a)_i - a^T M a| <= tol_i`` on its support, ``>= -tol_i`` elsewhere.
    """
    k = m.shape[0]
    diag = np.clip(np.diag(m), 0.0, None)
    s = np.sqrt(diag)
    support = support0.copy()
    a = np.where(support, x0, 0.0)
    a = a / a.sum()
    last_added = -1
    for _ in range(4 * k + 8):
        idx = np.flatnonzero(support)
        y = _face_minimiser(m, idx, s)
        if y is None:
            return None
        if (y < 0.0).any():  # walk from a towards y until the first weight hits 0; it leaves the face
            ai = a[idx]
            neg = y < 0.0
            ratios = ai[neg] / (ai[neg] - y[neg])
            block = idx[neg][np.argmin(ratios)]
            if block == last_added and ratios.min() == 0.0:
                return None  # the index just brought in cannot enter: degenerate, leave it to cvxopt's point
            new = ai + ratios.min() * (y - ai)
            a = np.zeros(k)
            a[idx] = np.clip(new, 0.0, None)
            a[block] = 0.0
            a = a / a.sum()
            support = a > 0.0
            last_added = -1
            continue
        a = np.zeros(k)
        a[idx] = y
        mu = m @ a - a @ m @ a
        tol = _kkt_tolerance(a, s, k)
        if (np.abs(mu[support]) > tol[support]).any():
            return None  # the face solve did not reach rounding-level stationarity
        viol = ~support & (mu < -tol)
        if not viol.any():
            return a
        last_added = int(np.argmin(np.where(viol, mu, np.inf)))
        support[last_added] = True
    return None


def solve_min_norm(gram: Any, *, ridge: float = 1e-6, polish: bool = True) -> QPResult:
    """Solve ``min alpha^T M alpha`` over the simplex for a PSD ``M`` (K x K, torch or numpy, any float dtype).

    Two stages (see the module docstring): cvxopt on ``M / max_k M_kk + ridge * I``, then (``polish=True``) an
    active-set refinement of cvxopt's point on the un-regularised ``M``. When the refinement certifies the KKT
    conditions to rounding level (``result.polished``) the answer is that point; otherwise cvxopt's.

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
    p = m.copy()
    p[np.diag_indices(k)] += ridge

    q, g, h, a, b = _constraints(k)
    try:
        sol = solvers.qp(matrix(p), q, g, h, a, b, options=_CVXOPT_OPTIONS)
    except (ValueError, ArithmeticError) as e:  # singular KKT system, domain error
        return _result(np.full(k, 1.0 / k), f"error: {e}", False, t0)

    x = np.array(sol["x"], dtype=np.float64).ravel()
    status = str(sol["status"])
    if not np.isfinite(x).all():
        return _result(np.full(k, 1.0 / k), f"{status} (non-finite)", False, t0)
    feasible = x.min() >= -_FEASIBILITY_TOL and abs(x.sum() - 1.0) <= _FEASIBILITY_TOL
    # Interior-point iterates can sit a hair outside the simplex: clip tiny negatives, renormalise.
    z = np.array(sol["z"], dtype=np.float64).ravel()
    x = np.clip(x, 0.0, None)
    total = x.sum()
    x = x / total if total > 0 else np.full(k, 1.0 / k)
    if status != "optimal":
        return _result(x, status, False, t0)
    if not feasible:
        return _result(x, "infeasible", False, t0)
    if polish:
        refined = _polish_merged(m, x, z)
        if refined is not None:
            return _result(refined, status, True, t0, polished=True)
    return _result(x, status, True, t0)


def _polish_merged(m: np.ndarray, x: np.ndarray, z: np.ndarray) -> np.ndarray | None:
    """``_polish`` with duplicated gradients merged into one variable, whose weight is then split equally (the
    min-||alpha|| split); None unless the result is certified and no worse than cvxopt's point ``x``."""
    k = m.shape[0]
    groups = _duplicate_groups(m)
    reps = np.array([grp[0] for grp in groups])
    mr = m[np.ix_(reps, reps)]
    xr = np.array([x[grp].sum() for grp in groups])
    # Free at the start: the weights cvxopt's slack/dual pair marks as inactive constraints (x_i > z_i).
    free = np.array([bool((x[grp] > z[grp]).any()) for grp in groups])
    if not free.any() or not (xr[free] > 0).any():
        free = xr == xr.max()
    free &= xr > 0
    beta = _polish(mr, xr, free)
    if beta is None:
        return None
    alpha = np.zeros(k)
    for grp, weight in zip(groups, beta, strict=True):
        alpha[grp] = weight / len(grp)
    s = np.sqrt(np.clip(np.diag(m), 0.0, None))
    f_new, f_old = alpha @ m @ alpha, x @ m @ x
    slack = _KKT_RTOL * k * _EPS * max(float(s @ alpha), float(s @ x)) ** 2
    if not f_new <= f_old + slack:  # only for a Gram that is not PSD (then the KKT point need not be the minimum)
        return None
    return alpha


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
    return QPResult(alpha, res.status, res.ok, res.solve_time_s, res.polished), mh, norms, active
