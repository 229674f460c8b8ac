"""Property tests for the min-norm QP on the simplex (MARBLE Eq. 6).

Tolerances are derived, not tuned: ``solve_min_norm`` states a KKT certificate for a polished answer
(``|(M a)_i - a^T M a| <= 16 K eps sigma (s_i + sigma)`` on the support, ``>= -that`` off it, with
``s_i = sqrt(M_ii)`` and ``sigma = sum_j s_j a_j``; see marble_trl/balance/qp.py). Everything here follows from that
certificate, float64 rounding (``eps``) and the rounding of the Gram itself, and is checked against an exact
(rational arithmetic) solution of the QP for K <= 6.
"""

from __future__ import annotations

import dataclasses
import itertools
from fractions import Fraction

import numpy as np
import pytest
import torch
from cvxopt import solvers

from marble_trl.balance import qp as qp_module
from marble_trl.balance.qp import QPResult, normalized_gram, solve_min_norm, solve_normalized_min_norm

EPS = float(np.finfo(np.float64).eps)
EPS32 = float(np.finfo(np.float32).eps)


def gamma(n: int) -> float:
    """Higham's gamma_n = n u / (1 - n u), u = eps / 2: an n-term float64 dot product errs by at most gamma_n
    sum_i |x_i y_i|, whatever the summation order (any BLAS, FMA or not)."""
    u = EPS / 2
    return n * u / (1 - n * u)


def unit_rows(g: np.ndarray) -> np.ndarray:
    return g / np.linalg.norm(g, axis=1, keepdims=True)


def random_gram(rng: np.random.Generator, k: int, p: int, normalise: bool = True) -> np.ndarray:
    g = rng.standard_normal((k, p))
    if normalise:
        g = unit_rows(g)
    else:
        g *= rng.uniform(0.1, 10.0, size=(k, 1))
    return g @ g.T


# ------------------------------------------------------------------ exact reference and derived tolerances
def _solve_rational(a: list[list[Fraction]], b: list[Fraction]) -> list[Fraction] | None:
    """Gauss-Jordan elimination over the rationals; None when the system is singular."""
    n = len(b)
    rows = [[*r, v] for r, v in zip(a, b)]
    for col in range(n):
        piv = next((r for r in range(col, n) if rows[r][col] != 0), None)
        if piv is None:
            return None
        rows[col], rows[piv] = rows[piv], rows[col]
        p = rows[col][col]
        rows[col] = [v / p for v in rows[col]]
        for r in range(n):
            if r != col and rows[r][col] != 0:
                f = rows[r][col]
                rows[r] = [v - f * w for v, w in zip(rows[r], rows[col])]
    return [rows[r][n] for r in range(n)]


def exact_min_norm(m: np.ndarray) -> tuple[list[Fraction], Fraction]:
    """The exact minimiser of ``a^T M a`` on the simplex for the float64 matrix ``m`` as stored (K <= 6).

    Enumerates supports S; on each solves the KKT system ``M_S a = lam 1, 1^T a = 1`` in rational arithmetic (no
    rounding at all) and keeps the points with ``a >= 0`` and ``(M a)_i >= lam`` off S; returns the least objective
    (``= lam``). Singular faces are skipped: for a PSD ``M`` the optimal set is a polytope whose vertices have supports
    with affinely independent gradients, and there the KKT matrix is nonsingular.
    """
    k = m.shape[0]
    mm = [[Fraction(float(m[i, j])) for j in range(k)] for i in range(k)]
    best: tuple[list[Fraction], Fraction] | None = None
    for size in range(1, k + 1):
        for support in itertools.combinations(range(k), size):
            kkt = [[mm[i][j] for j in support] + [Fraction(-1)] for i in support]
            kkt.append([Fraction(1)] * size + [Fraction(0)])
            sol = _solve_rational(kkt, [Fraction(0)] * size + [Fraction(1)])
            if sol is None or min(sol[:size]) < 0:
                continue
            lam = sol[size]
            a = [Fraction(0)] * k
            for i, v in zip(support, sol[:size]):
                a[i] = v
            if any(sum(mm[i][j] * a[j] for j in support) < lam for i in range(k) if i not in support):
                continue
            if best is None or lam < best[1]:
                best = (a, lam)
    assert best is not None
    return best


def exact_value(m: np.ndarray, alpha: np.ndarray) -> Fraction:
    """``alpha^T M alpha`` in rational arithmetic (no evaluation rounding)."""
    a = [Fraction(float(x)) for x in alpha]
    k = len(a)
    return sum(a[i] * Fraction(float(m[i, j])) * a[j] for i in range(k) for j in range(k))


def certified_tol(m: np.ndarray, alpha: np.ndarray) -> np.ndarray:
    """How far this test may see a polished alpha's KKT multipliers ``(M a)_i - a^T M a`` from 0 (sign-wise).

    The solver certifies ``_KKT_RTOL K eps sigma (s_i + sigma)`` on its own (scaled, symmetrised) float64
    evaluation; the solver's and this test's evaluation rounding and the scaling add ``<= 2 K eps sigma (s_i + sigma)``
    each (``|M_ij| <= s_i s_j``), hence ``_KKT_RTOL + 4``.
    """
    k = m.shape[0]
    s = np.sqrt(np.clip(np.diag(m), 0.0, None))
    sigma = float(s @ alpha)
    return (qp_module._KKT_RTOL + 4) * k * EPS * sigma * (s + sigma)


def assert_kkt(m: np.ndarray, alpha: np.ndarray) -> None:
    """alpha on the simplex and ``(M a)_i >= a^T M a`` with equality on the support, to ``certified_tol``."""
    k = m.shape[0]
    assert alpha.shape == (k,)
    assert (alpha >= 0).all()
    assert abs(alpha.sum() - 1.0) <= gamma(k)
    mu = m @ alpha - alpha @ m @ alpha
    tol = certified_tol(m, alpha)
    assert (mu >= -tol).all(), (mu / tol, alpha)
    support = alpha > 0
    assert (np.abs(mu[support]) <= tol[support]).all(), (mu / tol, alpha)


def assert_matches_exact(m: np.ndarray, res: QPResult, p: int) -> tuple[float, float]:
    """The objective gap to the exact optimum is within what the KKT certificate implies; returns (gap, f*).

    With ``mu_i`` the exact multipliers of alpha and ``sum a*_i = 1``, for a quadratic
    ``f(alpha) - f* = -2 sum_i a*_i mu_i - (a* - alpha)^T M (a* - alpha)``. The first term is at most
    ``2 sum_i a*_i tol_i``. The second is <= 0 for a PSD ``M``; the stored ``m = fl(G G^T)`` is PSD only up to
    ``|E_ij| <= gamma_p s_i s_j`` (p = the gradients' length), which bounds it by ``gamma_p (sigma + sigma*)^2``.
    From below, ``alpha / sum(alpha)`` is feasible and ``sum(alpha) = 1`` to ``gamma_K``.
    """
    assert res.ok and res.polished, res
    k = m.shape[0]
    a_star, f_star = exact_min_norm(m)
    s = np.sqrt(np.diag(m))
    sigma = float(s @ res.alpha)
    sigma_star = float(sum(float(a) * si for a, si in zip(a_star, s)))
    tol = certified_tol(m, res.alpha)
    non_psd = gamma(p) * (sigma + sigma_star) ** 2
    upper = 2 * float(sum(float(a) * t for a, t in zip(a_star, tol))) + non_psd
    lower = -(2 * gamma(k) * float(f_star) + non_psd)
    gap = float(exact_value(m, res.alpha) - f_star)
    assert lower <= gap <= upper, (gap, lower, upper, float(f_star))
    return gap, float(f_star)


def tangent_curvature(m: np.ndarray) -> float:
    """Smallest eigenvalue of ``M`` on sum-zero vectors: ``f(a) - f* >= that * ||a - a*||^2`` on the simplex."""
    k = m.shape[0]
    q = np.linalg.svd(np.eye(k) - 1.0 / k)[0][:, : k - 1]
    return float(np.linalg.eigvalsh(q.T @ m @ q).min())


def alpha_radius(m_ref: np.ndarray, alpha: np.ndarray, delta: float) -> float:
    """How far a polished alpha can be from the (unique) minimiser a* of ``m_ref``.

    alpha was solved on a matrix within ``delta * s_i s_j`` of ``m_ref`` entrywise (Gram rounding, scaling, float32
    casts). Its gap on that matrix is ``<= 2 max_i tol_i`` (certificate, ``sum a* = 1``), the perturbation moves both
    objectives by ``<= delta (sigma + max s)^2``, and ``f(a) - f* >= lambda_t ||a - a*||^2 - 2 gamma_K f*``.
    """
    k = m_ref.shape[0]
    lam = tangent_curvature(m_ref)
    assert lam > 0, "the minimiser is not unique: no radius"
    s = np.sqrt(np.diag(m_ref))
    f = float(alpha @ m_ref @ alpha)
    gap = 2 * certified_tol(m_ref, alpha).max() + 2 * delta * (float(s @ alpha) + s.max()) ** 2 + 2 * gamma(k) * f
    return float(np.sqrt(gap / lam))


# ------------------------------------------------------------------ Gram families
def scaled_gram(rng: np.random.Generator, k: int, lo: float, hi: float) -> tuple[np.ndarray, int]:
    """Gradients whose squared norms (the diagonal) span [lo, hi], log-uniformly; returns (Gram, p)."""
    p = int(rng.integers(k, 2 * k + 3))
    sq = np.exp(rng.uniform(np.log(lo), np.log(hi), k))
    sq[:2] = [lo, hi]
    g = unit_rows(rng.standard_normal((k, p))) * np.sqrt(sq)[:, None]
    return g @ g.T, p


def near_opposite_gram(rng: np.random.Generator, k: int, e: float, normalise: bool) -> tuple[np.ndarray, int]:
    """g_1 = -c g_0 + e v: an optimum of order e^2 (the unit gradients nearly cancel), plus k - 2 others."""
    p = k + 4
    g = rng.standard_normal((k, p))
    g[1] = -rng.uniform(0.3, 3.0) * g[0] + e * np.linalg.norm(g[0]) * unit_rows(rng.standard_normal((1, p)))[0]
    if normalise:
        g = unit_rows(g)
    return g @ g.T, p


def duplicated_gram(rng: np.random.Generator, k: int) -> tuple[np.ndarray, int]:
    """k gradients drawn with repetition from fewer distinct ones, copied bitwise at the Gram level."""
    distinct = int(rng.integers(1, k))
    m0, p = scaled_gram(rng, distinct, 0.1, 10.0) if distinct > 1 else (np.array([[2.0]]), 1)
    idx = rng.integers(0, distinct, k)
    idx[:distinct] = np.arange(distinct)
    return m0[np.ix_(idx, idx)], p


def rank_deficient_gram(rng: np.random.Generator, k: int, normalise: bool) -> tuple[np.ndarray, int]:
    r = int(rng.integers(1, k))
    p = r + 5
    g = rng.standard_normal((k, r)) @ rng.standard_normal((r, p))
    if normalise:
        g = unit_rows(g)
    return g @ g.T, p


def gram_family(rng: np.random.Generator, k: int, kind: str) -> tuple[np.ndarray, int]:
    if kind == "span1e8":
        return scaled_gram(rng, k, 1.0, 1e8)
    if kind == "span1e12":
        return scaled_gram(rng, k, 1e-6, 1e6)
    if kind == "diag1e-8..1e12":
        return scaled_gram(rng, k, 1e-8, 1e12)
    if kind == "near_opposite":
        return near_opposite_gram(rng, k, 10.0 ** rng.uniform(-8, -2), normalise=bool(rng.integers(2)))
    if kind == "duplicated":
        return duplicated_gram(rng, k)
    if kind == "rank_deficient":
        return rank_deficient_gram(rng, k, normalise=bool(rng.integers(2)))
    raise AssertionError(kind)


KINDS = ["span1e8", "span1e12", "diag1e-8..1e12", "near_opposite", "duplicated", "rank_deficient"]


# ------------------------------------------------------------------ tests
@pytest.mark.parametrize("k", range(2, 17))
def test_kkt_random(k: int) -> None:
    rng = np.random.default_rng(k)
    for trial in range(4):
        # Full-rank and rank-deficient (p < k), normalised and raw Grams.
        p = [k + 3, max(1, k // 2), 2 * k, 1][trial]
        m = random_gram(rng, k, p, normalise=trial % 2 == 0)
        res = solve_min_norm(m)
        assert res.ok and res.status == "optimal" and res.polished
        assert_kkt(m, res.alpha)


@pytest.mark.parametrize("k", [2, 3, 4, 5, 6])
def test_agrees_with_exact_solver(k: int) -> None:
    rng = np.random.default_rng(100 + k)
    for trial in range(6):
        p = [1, 2, k, k + 4, 3 * k, 2][trial]
        m = random_gram(rng, k, p, normalise=trial % 2 == 1)
        res = solve_min_norm(m)
        assert_matches_exact(m, res, p)
        if tangent_curvature(m) > 1e-2 * np.diag(m).max():  # unique minimiser: the points agree too
            a_star = np.array([float(a) for a in exact_min_norm(m)[0]])
            assert np.linalg.norm(res.alpha - a_star) <= alpha_radius(m, res.alpha, 0.0)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("k", [2, 3, 4, 6])
def test_badly_scaled_and_degenerate_grams_match_exact(kind: str, k: int) -> None:
    # The cases where cvxopt's ridge used to dominate: small diagonal entries next to large ones, optima far below
    # the largest diagonal (near-opposite gradients), singular Grams. The bound in assert_matches_exact is relative
    # to the optimum's own scale: ~80 K eps sigma^2 / f*, float64 rounding unless the gradients cancel.
    rng = np.random.default_rng([k, KINDS.index(kind)])
    for _ in range(2):
        m, p = gram_family(rng, k, kind)
        m *= 10.0 ** rng.uniform(-100, 100)  # and at any absolute scale
        res = solve_min_norm(m)
        assert_kkt(m, res.alpha)
        assert_matches_exact(m, res, p)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("k", [7, 8])
def test_badly_scaled_and_degenerate_grams_kkt(kind: str, k: int) -> None:
    rng = np.random.default_rng([k, KINDS.index(kind), 1])
    for _ in range(3):
        m, _ = gram_family(rng, k, kind)
        res = solve_min_norm(m)
        assert res.ok and res.polished
        assert_kkt(m, res.alpha)


def test_small_gradient_is_not_swamped_by_the_ridge() -> None:
    # Diagonal ratio 1e12. The exact optimum mixes in the large gradient at weight ~1e-6, which cancels most of the
    # small one: f* = 0.01 against M_11 = 1.01. cvxopt's ridge (1e-6 of the largest diagonal, i.e. 1e6 >> f*) put
    # that weight at ~7e-6, a relative gap of ~3.5e3; the polished answer is exact to rounding.
    g = np.array([[1e6, 0.0], [-1.0, 0.1]])
    m = g @ g.T
    res = solve_min_norm(m)
    assert_matches_exact(m, res, 2)
    # K = 2, both weights positive: f'(t) along alpha = (t, 1 - t) is 2 ((M a)_0 - (M a)_1), f'' = 2 ||g_0 - g_1||^2,
    # so the certificate pins t to (tol_0 + tol_1) / ||g_0 - g_1||^2 (~2e-20 here, against t* ~ 1e-6); storing
    # alpha and a* in float64 adds u relative each.
    a_star = np.array([float(a) for a in exact_min_norm(m)[0]])
    t_tol = certified_tol(m, res.alpha).sum() / (m[0, 0] - 2 * m[0, 1] + m[1, 1])
    np.testing.assert_allclose(res.alpha, a_star, rtol=EPS, atol=t_tol)


def test_min_norm_point_conflicts_with_no_gradient() -> None:
    # g_k . d >= ||d||^2 - tol_k for d = sum alpha_j g_j: the certificate's multipliers, seen from the gradients.
    rng = np.random.default_rng(7)
    for k in (2, 3, 6, 12):
        gh = unit_rows(rng.standard_normal((k, 5)))
        m = gh @ gh.T
        alpha = solve_min_norm(m).alpha
        d = alpha @ gh
        # + gamma: d and gh @ d are formed from the gradients (length 5), not from the Gram.
        slack = certified_tol(m, alpha) + 2 * gamma(k + 5)
        assert (gh @ d >= d @ d - slack).all()


def test_opposite_gradients() -> None:
    g = np.random.default_rng(0).standard_normal(10)
    gh = unit_rows(np.stack([g, -g]))
    m = gh @ gh.T
    res = solve_min_norm(m)
    # f(t) = (2t - 1)^2 (1 - m_01) + O(rounding of m): curvature lambda_t = 2 (1 - m_01) = 4 pins alpha.
    assert np.abs(res.alpha - 0.5).max() <= alpha_radius(m, res.alpha, gamma(10))
    # gh_1 = -gh_0 bitwise, so d = alpha_0 gh_0 - alpha_1 gh_0: its size is |alpha_0 - alpha_1| ||gh_0|| + rounding.
    d = res.alpha @ gh
    assert np.linalg.norm(d) <= np.abs(res.alpha[0] - res.alpha[1]) + 4 * EPS


def test_duplicated_gradients_split_weight() -> None:
    rng = np.random.default_rng(1)
    g, h = rng.standard_normal((2, 8))
    gh2 = unit_rows(np.stack([g, h]))
    m2 = gh2 @ gh2.T
    m3 = m2[np.ix_([0, 0, 1], [0, 0, 1])]  # g given twice: identical rows, whatever the BLAS
    a3 = solve_min_norm(m3).alpha
    a2 = solve_min_norm(m2).alpha
    # Duplicates are merged and share the weight equally (the min-||alpha|| minimiser): exactly equal halves.
    assert a3[0] == a3[1]
    # The merged problem is m2 itself: same answer up to the certificate's radius (cvxopt's start may differ).
    assert abs(a3[0] + a3[1] - a2[0]) <= 2 * alpha_radius(m2, a2, 0.0)
    # All K copies of one gradient: uniform, exactly.
    gh = unit_rows(np.stack([g] * 5))
    m5 = np.full((5, 5), float(gh[0] @ gh[0]))
    assert solve_min_norm(m5).alpha.tolist() == [0.2] * 5
    # From the BLAS the rows are equal, or differ by <= gamma_8 per entry: the cosine matrix's small eigenvalues then
    # stay below the polish's null threshold (5 gamma_8 << 8 K eps lambda_max = 200 eps), alpha is the top
    # eigenvector's split, uniform to the eigenvector rounding (~K eps / eigengap, gap 5), far below 1e3 eps.
    res = solve_min_norm(gh @ gh.T)
    np.testing.assert_allclose(res.alpha, np.full(5, 0.2), atol=1e3 * EPS)


def test_singular_face_takes_min_norm_minimiser() -> None:
    # e1, -e1, e2, -e2 (unit): every (t/2, t/2, (1-t)/2, (1-t)/2) gives d = 0. The least ||alpha|| one is uniform.
    # It is w = 1 projected on the null space of M; the eigenvectors' rounding (K eps / eigengap, gap 2) moves it.
    gh = np.array([[1.0, 0.0], [-1.0, 0.0], [0.0, 1.0], [0.0, -1.0]])
    res = solve_min_norm(gh @ gh.T)
    assert res.polished
    np.testing.assert_allclose(res.alpha, np.full(4, 0.25), atol=1e2 * EPS)


def test_rank_deficient_gram() -> None:
    rng = np.random.default_rng(2)
    gh = unit_rows(rng.standard_normal((16, 2)) @ rng.standard_normal((2, 30)))
    m = gh @ gh.T
    assert np.linalg.matrix_rank(m) == 2
    res = solve_min_norm(m)
    assert res.ok and res.polished
    assert_kkt(m, res.alpha)


def test_k1_and_zero_gram() -> None:
    res = solve_min_norm(np.array([[3.0]]))
    assert res.ok and res.status == "trivial" and res.alpha.tolist() == [1.0]
    res = solve_min_norm(np.zeros((1, 1)))
    assert res.ok and res.alpha.tolist() == [1.0]
    res = solve_min_norm(np.zeros((4, 4)))
    assert res.ok and res.status == "zero_gram"
    np.testing.assert_allclose(res.alpha, np.full(4, 0.25))


@pytest.mark.parametrize("scale", [1e12, 1e-16, 1e-300, 1e300])
def test_scale_invariance(scale: float) -> None:
    rng = np.random.default_rng(3)
    for k in (2, 5, 9):
        m = random_gram(rng, k, k + 1, normalise=False)
        ref = solve_min_norm(m).alpha
        res = solve_min_norm(m * scale)
        assert res.ok and res.polished, res.status
        assert_kkt(m * scale, res.alpha)
        # m * scale / (scale * max diag) differs from m / max diag by <= 2 eps relative per entry.
        radius = alpha_radius(m, res.alpha, 2 * EPS) + alpha_radius(m, ref, 0.0)
        assert np.linalg.norm(res.alpha - ref) <= radius


def test_mixed_scales_raw_gram() -> None:
    # Gradients of wildly different sizes: the raw min-norm point avoids the huge one. The two small ones lie 1e-12
    # and 1e-28 below the largest diagonal: invisible under cvxopt's ridge, exact after the polish.
    rng = np.random.default_rng(4)
    g = rng.standard_normal((3, 6)) * np.array([[1e6], [1.0], [1e-8]])
    m = g @ g.T
    res = solve_min_norm(m)
    assert_kkt(m, res.alpha)
    assert_matches_exact(m, res, 6)
    assert res.alpha[0] < 1e-4


def test_permutation_invariance() -> None:
    rng = np.random.default_rng(5)
    for k, kind in [(3, None), (7, None), (16, None), (6, "diag1e-8..1e12"), (8, "near_opposite"), (8, "duplicated")]:
        m = random_gram(rng, k, k + 2) if kind is None else gram_family(rng, k, kind)[0]
        perm = rng.permutation(k)
        a = solve_min_norm(m).alpha
        mp = m[np.ix_(perm, perm)]
        a_perm = solve_min_norm(mp).alpha
        assert_kkt(mp, a_perm)
        # Both are certified: each objective lies within 2 max_i tol_i (+ 2 gamma_K f) above the common optimum.
        f, f_perm = a @ m @ a, a_perm @ mp @ a_perm
        slack = 2 * (certified_tol(m, a).max() + certified_tol(mp, a_perm).max()) + 4 * gamma(k) * max(f, f_perm)
        assert abs(f - f_perm) <= slack
        # A unique minimiser, with curvature above eigvalsh's rounding (~K eps ||M||; a permuted copy's smallest
        # eigenvalue near 0 can come out with either sign): the points agree too.
        if min(tangent_curvature(m), tangent_curvature(mp)) > 8 * k * EPS * np.abs(m).max():
            assert np.linalg.norm(a_perm - a[perm]) <= alpha_radius(mp, a_perm, 0.0) + alpha_radius(m, a, 0.0)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_input_raises(bad: float) -> None:
    m = np.eye(3)
    m[1, 2] = bad
    word = "NaN" if np.isnan(bad) else "inf"
    with pytest.raises(ValueError, match=word):
        solve_min_norm(m)
    with pytest.raises(ValueError, match=word):
        normalized_gram(m)
    with pytest.raises(ValueError, match=word):
        solve_min_norm(np.array([[bad]]))  # even K=1 checks


def test_invalid_shapes_and_diagonal() -> None:
    with pytest.raises(ValueError, match="square"):
        solve_min_norm(np.ones((2, 3)))
    with pytest.raises(ValueError, match="square"):
        solve_min_norm(np.ones((0, 0)))
    with pytest.raises(ValueError, match="negative diagonal"):
        solve_min_norm(np.diag([1.0, -1.0]))


def test_torch_input_and_no_autograd() -> None:
    rng = np.random.default_rng(6)
    m = random_gram(rng, 4, 6)
    t = torch.tensor(m, dtype=torch.float32, requires_grad=True)
    res = solve_min_norm(t)
    assert res.ok and res.alpha.dtype == np.float64
    # The float32 cast moves each entry by <= eps32/2 relative (|M_ij| <= s_i s_j).
    ref = solve_min_norm(m).alpha
    assert np.linalg.norm(res.alpha - ref) <= alpha_radius(m, res.alpha, EPS32 / 2) + alpha_radius(m, ref, 0.0)
    assert t.grad is None


def test_result_is_frozen_and_options_not_leaked() -> None:
    before = dict(solvers.options)
    res = solve_min_norm(np.eye(3))
    assert dict(solvers.options) == before
    np.testing.assert_allclose(res.alpha, np.full(3, 1 / 3), atol=alpha_radius(np.eye(3), res.alpha, 0.0))
    assert isinstance(res, QPResult) and res.solve_time_s >= 0
    with pytest.raises(dataclasses.FrozenInstanceError):
        res.ok = False  # type: ignore[misc]
    with pytest.raises(ValueError):
        res.alpha[0] = 1.0


def test_cvxopt_stage_alone_is_ridge_accurate() -> None:
    # polish=False (and any polish that cannot certify) returns cvxopt's point: its objective is off by at most
    # the ridge (f_ridge(x) <= f_ridge(a*) gives f(x) - f* <= ridge (||a*||^2 - ||x||^2) <= ridge, scaled units)
    # plus cvxopt's duality gap and feasibility slack (abstol = feastol = 1e-10 on (1/2) x^T P x: <= 1e-9 all told).
    rng = np.random.default_rng(9)
    for kind in KINDS:
        m, _ = gram_family(rng, 4, kind)
        res = solve_min_norm(m, polish=False)
        assert res.ok and not res.polished
        gap = float(exact_value(m, res.alpha) - exact_min_norm(m)[1])
        assert -gamma(4) * np.diag(m).max() <= gap <= (1e-6 + 1e-9) * np.diag(m).max()


def test_uncertified_polish_falls_back_to_cvxopt(monkeypatch: pytest.MonkeyPatch) -> None:
    rng = np.random.default_rng(10)
    m = random_gram(rng, 5, 3)
    plain = solve_min_norm(m, polish=False)
    monkeypatch.setattr(qp_module, "_polish", lambda *args: None)
    res = solve_min_norm(m)
    assert res.ok and not res.polished and res.status == "optimal"
    np.testing.assert_array_equal(res.alpha, plain.alpha)


def test_solver_failure_is_reported_not_raised(monkeypatch: pytest.MonkeyPatch) -> None:
    m = np.eye(3)
    real_qp = solvers.qp

    def unknown(*args, **kwargs):
        sol = real_qp(*args, **kwargs)
        return {**sol, "status": "unknown"}

    monkeypatch.setattr(qp_module.solvers, "qp", unknown)
    res = solve_min_norm(m)
    assert not res.ok and res.status == "unknown" and not res.polished  # no polish on a failed solve
    assert res.alpha.sum() == pytest.approx(1.0)

    def broken(*args, **kwargs):
        raise ArithmeticError("singular KKT matrix")

    monkeypatch.setattr(qp_module.solvers, "qp", broken)
    res = solve_min_norm(m)
    assert not res.ok and "singular" in res.status

    def off_simplex(*args, **kwargs):
        sol = real_qp(*args, **kwargs)
        from cvxopt import matrix

        return {**sol, "x": matrix([0.9, 0.9, -0.8])}

    monkeypatch.setattr(qp_module.solvers, "qp", off_simplex)
    res = solve_min_norm(m)
    assert not res.ok and res.status == "infeasible"


def test_normalized_gram_excludes_zero_gradients() -> None:
    rng = np.random.default_rng(8)
    g = rng.standard_normal((4, 7)) * np.array([[3.0], [0.0], [1e-3], [5.0]])
    mh, norms, active = normalized_gram(g @ g.T)
    assert active.tolist() == [True, False, True, True]
    np.testing.assert_allclose(norms, np.linalg.norm(g, axis=1), rtol=1e-12)
    gh = unit_rows(g[active])
    np.testing.assert_allclose(mh, gh @ gh.T, atol=1e-12)
    assert np.diag(mh).tolist() == [1.0, 1.0, 1.0]

    res, _, _, active = solve_normalized_min_norm(g @ g.T)
    assert res.ok and res.polished and res.alpha[1] == 0.0 and res.alpha.shape == (4,)
    # mh and gh @ gh.T differ by <= 1e-12 (asserted above; entries are cosines, s_i = 1).
    ref = solve_min_norm(gh @ gh.T).alpha
    assert np.linalg.norm(res.alpha[active] - ref) <= alpha_radius(mh, res.alpha[active], 1e-12) + alpha_radius(
        mh, ref, 1e-12
    )
    # Eq. 6 on the normalised Gram is invariant to the gradients' sizes (up to the Gram's rounding, p = 7).
    g2 = g * np.array([[10.0], [1.0], [1e4], [0.1]])
    alpha2 = solve_normalized_min_norm(g2 @ g2.T)[0].alpha[active]
    delta = 4 * gamma(7)  # each normalised Gram within ~2 gamma_7 of the exact cosines
    radius = alpha_radius(mh, alpha2, delta) + alpha_radius(mh, res.alpha[active], delta)
    assert np.linalg.norm(alpha2 - res.alpha[active]) <= radius


def test_normalized_all_zero_and_single_active() -> None:
    res, _, norms, active = solve_normalized_min_norm(np.zeros((3, 3)))
    assert not res.ok and res.status == "no_signal" and not active.any() and (norms == 0).all()
    g = np.zeros((3, 4))
    g[2] = [1.0, 2.0, 0.0, -1.0]
    res, _, _, _ = solve_normalized_min_norm(g @ g.T)
    assert res.ok and res.alpha.tolist() == [0.0, 0.0, 1.0]
    # A raw Gram with a zero row: the plain min-norm point is the zero gradient (why the balancer excludes it).
    res = solve_min_norm(g @ g.T + np.diag([0.0, 1.0, 0.0]))
    assert res.polished and res.alpha.tolist() == [1.0, 0.0, 0.0]


def test_min_sq_norm_threshold() -> None:
    g = np.array([[1.0, 0.0], [0.0, 1e-21], [0.0, 1.0]])
    _, _, active = normalized_gram(g @ g.T, min_sq_norm=float(np.finfo(np.float32).tiny))
    assert active.tolist() == [True, False, True]
    _, _, active = normalized_gram(g @ g.T)
    assert active.tolist() == [True, True, True]
