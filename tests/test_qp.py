"""Property tests for the min-norm QP on the simplex (MARBLE Eq. 6)."""

from __future__ import annotations

import dataclasses
import itertools

import numpy as np
import pytest
import torch
from cvxopt import solvers

from marble_trl.balance import qp as qp_module
from marble_trl.balance.qp import QPResult, normalized_gram, solve_min_norm, solve_normalized_min_norm

TOL = 1e-5  # the ridge (1e-6 of the largest diagonal) moves the optimum by O(1e-6)


def unit_rows(g: np.ndarray) -> np.ndarray:
    return g / np.linalg.norm(g, axis=1, keepdims=True)


def random_gram(rng: np.random.Generator, k: int, p: int, normalise: bool = True) -> np.ndarray:
    g = rng.standard_normal((k, p))
    if normalise:
        g = unit_rows(g)
    else:
        g *= rng.uniform(0.1, 10.0, size=(k, 1))
    return g @ g.T


def assert_kkt(m: np.ndarray, alpha: np.ndarray, tol: float = TOL) -> None:
    """alpha on the simplex and (M alpha)_k >= alpha^T M alpha, with equality on the support."""
    scale = np.diag(m).max()
    assert alpha.shape == (m.shape[0],)
    assert (alpha >= 0).all()
    assert alpha.sum() == pytest.approx(1.0, abs=1e-12)
    grad = m @ alpha
    value = alpha @ grad
    assert (grad >= value - tol * scale).all(), (grad - value, alpha)
    support = alpha > 1e-4
    assert np.abs(grad[support] - value).max() <= tol * scale


def brute_force(m: np.ndarray) -> tuple[np.ndarray, float]:
    """Enumerate supports; on each solve the equality-constrained QP via its KKT system; keep the feasible min."""
    k = m.shape[0]
    best, best_val = None, np.inf
    for size in range(1, k + 1):
        for support in itertools.combinations(range(k), size):
            s = list(support)
            kkt = np.zeros((size + 1, size + 1))
            kkt[:size, :size] = 2 * m[np.ix_(s, s)]
            kkt[:size, size] = 1.0
            kkt[size, :size] = 1.0
            rhs = np.zeros(size + 1)
            rhs[size] = 1.0
            sol = np.linalg.lstsq(kkt, rhs, rcond=None)[0][:size]
            if (sol < -1e-12).any() or abs(sol.sum() - 1) > 1e-9:
                continue
            alpha = np.zeros(k)
            alpha[s] = np.clip(sol, 0, None)
            val = alpha @ m @ alpha
            if val < best_val - 1e-15:
                best, best_val = alpha, val
    assert best is not None
    return best, best_val


@pytest.mark.parametrize("k", range(2, 17))
def test_kkt_random(k: int) -> None:
    rng = np.random.default_rng(k)
    for trial in range(4):
        # Full-rank and rank-deficient (p < k), normalised and raw Grams.
        p = [k + 3, max(1, k // 2), 2 * k, 1][trial]
        m = random_gram(rng, k, p, normalise=trial % 2 == 0)
        res = solve_min_norm(m)
        assert res.ok and res.status == "optimal"
        assert_kkt(m, res.alpha)


@pytest.mark.parametrize("k", [2, 3, 4, 5])
def test_agrees_with_brute_force(k: int) -> None:
    rng = np.random.default_rng(100 + k)
    for trial in range(6):
        m = random_gram(rng, k, [1, 2, k, k + 4, 3 * k, 2][trial], normalise=trial % 2 == 1)
        res = solve_min_norm(m)
        alpha_bf, val_bf = brute_force(m)
        val = res.alpha @ m @ res.alpha
        assert val == pytest.approx(val_bf, abs=TOL * np.diag(m).max())
        if np.linalg.eigvalsh(m / np.diag(m).max()).min() > 1e-2:  # unique minimiser: the points agree too
            np.testing.assert_allclose(res.alpha, alpha_bf, atol=1e-4)


def test_min_norm_point_conflicts_with_no_gradient() -> None:
    rng = np.random.default_rng(7)
    for k in (2, 3, 6, 12):
        gh = unit_rows(rng.standard_normal((k, 5)))
        alpha = solve_min_norm(gh @ gh.T).alpha
        d = alpha @ gh
        assert (gh @ d >= d @ d - TOL).all()


def test_opposite_gradients() -> None:
    g = np.random.default_rng(0).standard_normal(10)
    gh = unit_rows(np.stack([g, -g]))
    res = solve_min_norm(gh @ gh.T)
    np.testing.assert_allclose(res.alpha, [0.5, 0.5], atol=1e-8)
    assert np.linalg.norm(res.alpha @ gh) < 1e-7


def test_duplicated_gradients_split_weight() -> None:
    rng = np.random.default_rng(1)
    g, h = rng.standard_normal((2, 8))
    gh3 = unit_rows(np.stack([g, g, h]))
    gh2 = unit_rows(np.stack([g, h]))
    a3 = solve_min_norm(gh3 @ gh3.T).alpha
    a2 = solve_min_norm(gh2 @ gh2.T).alpha
    # The ridge picks the min-||alpha|| minimiser: duplicates share the weight equally; same direction as K=2.
    assert a3[0] == pytest.approx(a3[1], abs=1e-6)
    assert a3[0] + a3[1] == pytest.approx(a2[0], abs=1e-5)
    np.testing.assert_allclose(a3 @ gh3, a2 @ gh2, atol=1e-5)
    # All K copies of one gradient: uniform.
    gh = unit_rows(np.stack([g] * 5))
    np.testing.assert_allclose(solve_min_norm(gh @ gh.T).alpha, np.full(5, 0.2), atol=1e-6)


def test_rank_deficient_gram() -> None:
    rng = np.random.default_rng(2)
    gh = unit_rows(rng.standard_normal((16, 2)) @ rng.standard_normal((2, 30)))
    m = gh @ gh.T
    assert np.linalg.matrix_rank(m) == 2
    res = solve_min_norm(m)
    assert res.ok
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
        assert res.ok, res.status
        np.testing.assert_allclose(res.alpha, ref, atol=1e-9)


def test_mixed_scales_raw_gram() -> None:
    # Gradients of wildly different sizes: the raw min-norm point avoids the huge one; still a KKT point (to the
    # ridge's resolution: both small gradients sit below 1e-6 of the largest diagonal, so they look alike).
    rng = np.random.default_rng(4)
    g = rng.standard_normal((3, 6)) * np.array([[1e6], [1.0], [1e-8]])
    m = g @ g.T
    res = solve_min_norm(m)
    assert res.ok
    assert_kkt(m, res.alpha)
    assert res.alpha[0] < 1e-4


def test_permutation_invariance() -> None:
    rng = np.random.default_rng(5)
    for k in (3, 7, 16):
        m = random_gram(rng, k, k + 2)
        perm = rng.permutation(k)
        a = solve_min_norm(m).alpha
        a_perm = solve_min_norm(m[np.ix_(perm, perm)]).alpha
        np.testing.assert_allclose(a_perm, a[perm], atol=1e-7)


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
    np.testing.assert_allclose(res.alpha, solve_min_norm(m).alpha, atol=1e-5)
    assert t.grad is None


def test_result_is_frozen_and_options_not_leaked() -> None:
    before = dict(solvers.options)
    res = solve_min_norm(np.eye(3))
    assert dict(solvers.options) == before
    np.testing.assert_allclose(res.alpha, np.full(3, 1 / 3), atol=1e-8)
    assert isinstance(res, QPResult) and res.solve_time_s >= 0
    with pytest.raises(dataclasses.FrozenInstanceError):
        res.ok = False  # type: ignore[misc]
    with pytest.raises(ValueError):
        res.alpha[0] = 1.0


def test_solver_failure_is_reported_not_raised(monkeypatch: pytest.MonkeyPatch) -> None:
    m = np.eye(3)
    real_qp = solvers.qp

    def unknown(*args, **kwargs):
        sol = real_qp(*args, **kwargs)
        return {**sol, "status": "unknown"}

    monkeypatch.setattr(qp_module.solvers, "qp", unknown)
    res = solve_min_norm(m)
    assert not res.ok and res.status == "unknown"
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
    assert res.ok and res.alpha[1] == 0.0 and res.alpha.shape == (4,)
    np.testing.assert_allclose(res.alpha[active], solve_min_norm(gh @ gh.T).alpha, atol=1e-12)
    # Eq. 6 on the normalised Gram is invariant to the gradients' sizes.
    g2 = g * np.array([[10.0], [1.0], [1e4], [0.1]])
    np.testing.assert_allclose(solve_normalized_min_norm(g2 @ g2.T)[0].alpha, res.alpha, atol=1e-7)


def test_normalized_all_zero_and_single_active() -> None:
    res, _, norms, active = solve_normalized_min_norm(np.zeros((3, 3)))
    assert not res.ok and res.status == "no_signal" and not active.any() and (norms == 0).all()
    g = np.zeros((3, 4))
    g[2] = [1.0, 2.0, 0.0, -1.0]
    res, _, _, _ = solve_normalized_min_norm(g @ g.T)
    assert res.ok and res.alpha.tolist() == [0.0, 0.0, 1.0]
    # A raw Gram with a zero row: the plain min-norm point is the zero gradient (why the balancer excludes it).
    assert solve_min_norm(g @ g.T + np.diag([0.0, 1.0, 0.0])).alpha[0] > 0.99


def test_min_sq_norm_threshold() -> None:
    g = np.array([[1.0, 0.0], [0.0, 1e-21], [0.0, 1.0]])
    _, _, active = normalized_gram(g @ g.T, min_sq_norm=float(np.finfo(np.float32).tiny))
    assert active.tolist() == [True, False, True]
    _, _, active = normalized_gram(g @ g.T)
    assert active.tolist() == [True, True, True]
