"""Tests for the stateful MARBLE balancer (Eqs. 5-7, 12; refresh schedule; counters; state)."""

from __future__ import annotations

import io
import json

import numpy as np
import pytest
import torch

from marble_trl.balance import (
    MarbleBalancer,
    QPResult,
    cosine_stats,
    gram_cosines,
    normalized_gram,
    solve_min_norm,
    solve_normalized_min_norm,
    update_cosines,
)
from marble_trl.balance import qp as qp_module
from marble_trl.policy.nft import advantage_to_r

U64 = 2.0**-53  # unit roundoff of float64 (eps / 2)
U32 = 2.0**-24


def gamma(n: int, u: float = U64) -> float:
    """Higham's gamma_n: an n-term dot product errs by <= gamma_n sum_i |x_i y_i|, in any summation order."""
    return n * u / (1 - n * u)


def cosine_rounding(p: int, u: float = U64) -> float:
    """Entrywise error bound of a normalised Gram computed from a rounded Gram of length-p gradients: the dot product
    errs by gamma_p ||g_i|| ||g_j||, the two norms by gamma_p / 2 each (relative), sqrt/product/division by 3 u."""
    return 2 * gamma(p, u) + 6 * u


def alpha_sensitivity(grads: torch.Tensor, alpha: np.ndarray, delta: float) -> float:
    """How far (2-norm) alpha* can move when the normalised Gram moves by <= delta per entry.

    First order, for a nondegenerate optimum (same support S): ``||d alpha|| <= ||dM alpha||_S / lambda_S`` with
    ``||dM alpha||_S <= delta sqrt(|S|)`` (alpha on the simplex) and ``lambda_S`` the smallest eigenvalue of
    ``Mh_S`` on sum-zero vectors; doubled for second-order terms. Plus the solver's certificate: on the support
    its multipliers are within ``_KKT_RTOL K eps sigma (1 + sigma) <= 2 _KKT_RTOL K eps`` of equal (unit gradients,
    sigma <= 1), which moves alpha by at most that / lambda_S.
    """
    g = grads.double()
    mh, _, active = normalized_gram((g @ g.T).numpy())
    a = np.asarray(alpha)[active]
    s = a > 0
    n = int(s.sum())
    if n == 1:
        return 2 * delta  # a vertex: only the rounding of the returned weights
    q = np.linalg.svd(np.eye(n) - 1.0 / n)[0][:, : n - 1]
    lam = float(np.linalg.eigvalsh(q.T @ mh[np.ix_(s, s)] @ q).min())
    assert lam > 0.1, lam  # these tests use well-conditioned gradients; the bound is not meant for near-singular ones
    certificate = 2 * qp_module._KKT_RTOL * mh.shape[0] * 2 * U64
    return (2 * delta * np.sqrt(n) + certificate) / lam


def make_grads(seed: int, k: int = 4, p: int = 64, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    scales = torch.logspace(-2, 2, k, dtype=torch.float64)[:, None]
    return (torch.randn(k, p, generator=gen, dtype=torch.float64) * scales).to(dtype)


def bare_alpha(grads: torch.Tensor) -> np.ndarray:
    g = grads.double()
    return solve_normalized_min_norm((g @ g.T).numpy())[0].alpha


def failing_solver(gram: np.ndarray) -> QPResult:
    k = gram.shape[0]
    return QPResult(alpha=np.full(k, 1.0 / k), status="unknown", ok=False, solve_time_s=0.0)


def test_rho_zero_gives_bare_qp() -> None:
    bal = MarbleBalancer(4, rho=0.0)
    for seed in range(3):
        grads = make_grads(seed)
        _, info = bal.combine(grads)
        expected = bare_alpha(grads)
        # The same Gram computed twice: equal, unless a BLAS rounds the two calls differently (each within
        # cosine_rounding of the exact cosines).
        atol = alpha_sensitivity(grads, expected, 2 * cosine_rounding(grads.shape[1]))
        np.testing.assert_allclose(info["alpha_star"], expected, atol=atol)
        np.testing.assert_allclose(bal.alpha_bar, info["alpha_star"], atol=4 * U64)  # rho = 0: EMA renormalises
        np.testing.assert_allclose(bal.advantage_weights(dtype=torch.float64).numpy(), bal.alpha_bar, rtol=0, atol=0)


def test_ema_matches_hand_computation() -> None:
    rho = 0.7
    bal = MarbleBalancer(reward_names=["a", "b", "c", "d"], rho=rho)
    expected = np.full(4, 0.25)
    for seed in range(3):
        grads = make_grads(10 + seed)
        _, info = bal.combine(grads)
        bare = bare_alpha(grads)
        np.testing.assert_allclose(
            info["alpha_star"], bare, atol=alpha_sensitivity(grads, bare, 2 * cosine_rounding(grads.shape[1]))
        )
        # The hand EMA on the balancer's own alpha*: a few roundings of numbers <= 1 (and the renormalisation).
        star = np.array(info["alpha_star"])
        expected = rho * expected + (1 - rho) * star
        np.testing.assert_allclose(bal.alpha_bar, expected, atol=1e-12)
        np.testing.assert_allclose(info["alpha_bar"], expected, atol=1e-12)
        np.testing.assert_array_equal(bal.last_alpha_star, star)
    assert bal.num_refreshes == 3 and bal.num_qp_fallbacks == 0
    # Explicit: alpha_bar_3 = rho^3 u + (1-rho)(rho^2 s1 + rho s2 + s3).
    assert bal.alpha_bar.sum() == pytest.approx(1.0, abs=1e-15)


def test_reset_restores_uniform_and_zeroes_counters() -> None:
    bal = MarbleBalancer(3, rho=0.2)
    bal.combine(make_grads(0, k=3))
    bal.record_clamp_violations(4)
    bal.solver = failing_solver
    bal.combine(make_grads(1, k=3))
    assert bal.num_refreshes == 2 and bal.num_qp_fallbacks == 1 and bal.num_clamp_violations == 4
    bal.reset()
    np.testing.assert_array_equal(bal.alpha_bar, np.full(3, 1 / 3))
    assert bal.last_alpha_star is None
    assert (bal.num_refreshes, bal.num_qp_fallbacks, bal.num_clamp_violations) == (0, 0, 0)


def test_state_dict_round_trip() -> None:
    bal = MarbleBalancer(reward_names=["pick", "ocr", "clip"], rho=0.5)
    bal.combine(make_grads(3, k=3))
    bal.combine(make_grads(4, k=3))
    bal.record_clamp_violations(2)
    state = bal.state_dict()
    # JSON and torch.load(weights_only=True) safe.
    state_json = json.loads(json.dumps(state))
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    state_torch = torch.load(buf, weights_only=True)
    for loaded in (state_json, state_torch):
        other = MarbleBalancer(reward_names=["pick", "ocr", "clip"], rho=0.5)
        other.load_state_dict(loaded)
        assert other.state_dict() == state
        np.testing.assert_array_equal(other.alpha_bar, bal.alpha_bar)  # float64-exact
    # Continuing from a restored state gives identical results.
    other = MarbleBalancer(reward_names=["pick", "ocr", "clip"], rho=0.5)
    other.load_state_dict(state_torch)
    grads = make_grads(5, k=3)
    u1, i1 = bal.combine(grads)
    u2, i2 = other.combine(grads)
    torch.testing.assert_close(u1, u2, rtol=0, atol=0)
    assert i1["alpha_bar"] == i2["alpha_bar"] and bal.state_dict() == other.state_dict()
    with pytest.raises(ValueError, match="rewards"):
        MarbleBalancer(reward_names=["a", "b", "c"]).load_state_dict(state)
    with pytest.raises(KeyError):
        MarbleBalancer(reward_names=["pick", "ocr", "clip"]).load_state_dict({"alpha_bar": [1.0, 0.0, 0.0]})
    bad = dict(state, alpha_bar=[0.5, 0.5, 0.5])
    with pytest.raises(ValueError, match="alpha_bar"):
        MarbleBalancer(reward_names=["pick", "ocr", "clip"]).load_state_dict(bad)


def test_refresh_schedule() -> None:
    every = MarbleBalancer(2, refresh_interval=1)
    assert all(every.is_refresh_step(s) for s in range(30))
    ten = MarbleBalancer(2, refresh_interval=10)
    assert [s for s in range(35) if ten.is_refresh_step(s)] == [0, 10, 20, 30]
    staged = MarbleBalancer(2, refresh_interval=10, uniform_final_steps=5, max_steps=35)
    assert [s for s in range(35) if staged.is_refresh_step(s)] == [0, 10, 20]
    assert [s for s in range(35) if staged.in_uniform_stage(s)] == list(range(30, 35))
    with pytest.raises(ValueError):
        staged.is_refresh_step(-1)


def test_uniform_final_stage_weights() -> None:
    bal = MarbleBalancer(3, rho=0.0, uniform_final_steps=2)  # max_steps assigned later, as the trainer would
    with pytest.raises(ValueError, match="max_steps"):
        bal.is_refresh_step(0)
    bal.max_steps = 10
    bal.combine(make_grads(0, k=3))
    alpha_bar = bal.alpha_bar
    assert not np.allclose(alpha_bar, 1 / 3)
    for step in range(10):
        w = bal.advantage_weights(step)
        assert w.dtype == torch.float32 and w.shape == (3,)
        expected = np.full(3, 1 / 3) if step >= 8 else alpha_bar
        np.testing.assert_allclose(w.numpy(), expected, atol=1e-7)
    np.testing.assert_allclose(bal.advantage_weights().numpy(), alpha_bar, atol=1e-7)
    # No max_steps needed without a final stage.
    assert MarbleBalancer(3).is_refresh_step(0)


def test_qp_failure_keeps_previous_coefficients() -> None:
    bal = MarbleBalancer(4, rho=0.3)
    bal.combine(make_grads(0))
    before = bal.alpha_bar
    bal.solver = failing_solver
    grads = make_grads(1)
    update, info = bal.combine(grads)
    assert info["used_fallback"] and info["qp_status"] == "unknown"
    assert all(np.isnan(info["alpha_star"]))
    np.testing.assert_array_equal(bal.alpha_bar, before)
    np.testing.assert_allclose(info["alpha_used"], before, atol=1e-15)
    assert bal.num_qp_fallbacks == 1 and bal.num_refreshes == 2
    # Eq. 7 with the previous alpha_bar.
    norms = grads.norm(dim=1, keepdim=True)
    expected = (torch.as_tensor(before)[:, None] * grads / norms).sum(0) * norms.mean()
    torch.testing.assert_close(update, expected)


def test_fallback_renormalises_over_rewards_with_signal() -> None:
    bal = MarbleBalancer(3, solver=failing_solver)
    grads = make_grads(2, k=3)
    grads[1] = 0
    update, info = bal.combine(grads)
    np.testing.assert_allclose(info["alpha_used"], [0.5, 0.0, 0.5])
    norms = grads.norm(dim=1)
    expected = 0.5 * (grads[0] / norms[0] + grads[2] / norms[2]) * (norms[0] + norms[2]) / 2
    torch.testing.assert_close(update, expected)


@pytest.mark.parametrize("k", [2, 3, 5, 8])
def test_eq7_magnitude_and_no_conflict(k: int) -> None:
    for seed in range(3):
        grads = make_grads(100 * k + seed, k=k, p=40)
        bal = MarbleBalancer(k, rho=0.9)  # rho must not matter for the refresh update
        update, info = bal.combine(grads)
        norms = grads.norm(dim=1)
        gh = grads / norms[:, None]
        alpha = torch.as_tensor(info["alpha_star"], dtype=torch.float64)
        direction = alpha @ gh
        torch.testing.assert_close(update, direction * norms.mean())
        assert update.norm().item() == pytest.approx(direction.norm().item() * norms.mean().item(), rel=1e-12)
        assert update.norm() <= norms.mean() * (1 + 1e-12)  # convex combination of unit vectors
        cos = update_cosines(update, grads)
        assert (cos >= -1e-6).all(), cos
        np.testing.assert_allclose(info["cosines"], cos.numpy(), atol=1e-12)
        assert info["worst_cosine"] >= -1e-6 and not info["conflict"] and not info["pareto_stationary"]
        assert info["direction_norm"] == pytest.approx(direction.norm().item(), rel=1e-9)
        # Gram-only cosines agree with the pass over the parameters.
        coeffs = alpha.numpy() * norms.mean().item() / norms.numpy()
        np.testing.assert_allclose(gram_cosines((grads @ grads.T).numpy(), coeffs), cos.numpy(), atol=1e-9)


def test_weighted_sum_conflicts_marble_does_not() -> None:
    # One reward with a large gradient opposing the others: the plain mean conflicts (Table S1's failure mode).
    g = torch.tensor([[1.0, 0.1, 0.0], [1.0, -0.1, 0.0], [-30.0, 0.0, 1.0]], dtype=torch.float64)
    stats = cosine_stats(update_cosines(g.mean(0), g))
    assert stats["conflict"] and stats["worst_cosine"] < 0
    _, info = MarbleBalancer(3).combine(g)
    assert not info["conflict"] and info["worst_cosine"] >= -1e-6


def test_zero_gradient_reward_is_excluded() -> None:
    grads = make_grads(7, k=4)
    grads[2] = 0
    bal = MarbleBalancer(4, rho=0.0)
    update, info = bal.combine(grads)
    assert torch.isfinite(update).all()
    assert info["alpha_star"][2] == 0.0 and info["active"] == [True, True, False, True]
    assert info["num_active"] == 3 and info["cosines"][2] == 0.0
    kept = grads[[0, 1, 3]]
    _, ref = MarbleBalancer(3, rho=0.0).combine(kept)
    # A [4, P] and a [3, P] matmul may block (and so round) differently: each Gram within cosine_rounding.
    atol = alpha_sensitivity(kept, np.array(ref["alpha_star"]), 2 * cosine_rounding(grads.shape[1]))
    np.testing.assert_allclose(np.delete(info["alpha_star"], 2), ref["alpha_star"], atol=atol)
    # Eq. 7's mean runs over the rewards with signal only.
    norms = kept.norm(dim=1)
    assert update.norm().item() == pytest.approx(
        (torch.as_tensor(ref["alpha_star"], dtype=torch.float64) @ (kept / norms[:, None])).norm().item()
        * norms.mean().item(),
        rel=1e-9,
    )


def test_all_zero_gradients() -> None:
    bal = MarbleBalancer(3)
    update, info = bal.combine(torch.zeros(3, 10))
    assert (update == 0).all() and info["used_fallback"] and info["qp_status"] == "no_signal"
    assert info["worst_cosine"] == 0.0 and not info["conflict"]
    np.testing.assert_array_equal(bal.alpha_bar, np.full(3, 1 / 3))


def test_opposite_gradients_cancel() -> None:
    g = make_grads(8, k=1)[0]
    p = g.shape[0]
    update, info = MarbleBalancer(2).combine(torch.stack([g, -3 * g]))
    # The float64 Gram of g and fl(-3 g) (parallel to O(u^2)) gives a cosine c in [-1, -1 + delta] (clipped below),
    # delta = cosine_rounding(p) ~ 1.5e-14 for p = 64. The QP on [[1, c], [c, 1]]: alpha* = (1/2, 1/2),
    # f* = (1 + c) / 2. alpha: the certificate bounds the multipliers by tol = (_KKT_RTOL + 4) K eps sigma (1 + sigma)
    # (K = 2, unit gradients, sigma = 1; + 4 for the evaluation rounding, as test_qp.certified_tol), and
    # (M alpha)_0 - (M alpha)_1 = (alpha_0 - alpha_1)(1 - c) with 1 - c >= 2 - delta, so
    # |alpha_k - 1/2| <= tol / (2 - delta).
    delta = cosine_rounding(p)
    tol = (qp_module._KKT_RTOL + 4) * 2 * (2 * U64) * 2
    t_max = tol / (2 - delta)
    np.testing.assert_allclose(info["alpha_star"], [0.5, 0.5], rtol=0, atol=t_max)
    # direction_norm = sqrt(alpha^T Mh alpha) = sqrt((1 + c) / 2 + 2 (1 - c) t^2 + evaluation rounding) <=
    # sqrt(delta / 2 + 4 t_max^2 + 2 gamma_2), about 1e-7. That is the Gram's rounding, not the QP's: the old
    # 1e-8 limit sat below sqrt(u) and failed whenever the cosine came out a few ulps above -1 (here -1 + 3.3e-16,
    # direction_norm 1.29e-8, with alpha exactly 1/2). Far below PARETO_STATIONARY_TOL (1e-6).
    bound = np.sqrt(delta / 2 + 4 * t_max**2 + 2 * gamma(2))
    assert info["pareto_stationary"] and info["direction_norm"] <= bound, (info["direction_norm"], bound)
    # Pareto-stationary: the update is exactly zero, cosines 0, no conflict reported.
    assert (update == 0).all() and info["cosines"] == [0.0, 0.0] and not info["conflict"]


def test_pareto_stationary_convex_hull_contains_zero() -> None:
    # Three unit directions at 120 degrees (different lengths): 0 = their centroid, MGDA finds it.
    angles = torch.tensor([0.0, 2.0, 4.0], dtype=torch.float64) * torch.pi / 3
    g = torch.stack([angles.cos(), angles.sin(), torch.zeros(3, dtype=torch.float64)], dim=1)
    g = g * torch.tensor([[1.0], [5.0], [0.2]], dtype=torch.float64)
    bal = MarbleBalancer(3, rho=0.0)
    update, info = bal.combine(g)
    # The cosines are -1/2 up to the rounding of cos/sin and of the Gram (p = 3); lambda_S = 3/2.
    atol = alpha_sensitivity(g, np.full(3, 1 / 3), cosine_rounding(3) + 4 * U64)
    np.testing.assert_allclose(info["alpha_star"], np.full(3, 1 / 3), atol=atol)
    assert info["pareto_stationary"] and (update == 0).all() and not info["conflict"]
    coeffs, info_gram = MarbleBalancer(3).refresh(g @ g.T)
    assert (coeffs == 0).all() and info_gram["pareto_stationary"] and info_gram["cosines"] == [0.0] * 3


def test_single_reward() -> None:
    g = make_grads(9, k=1)
    bal = MarbleBalancer(1)
    update, info = bal.combine(g)
    torch.testing.assert_close(update, g[0])
    assert info["alpha_star"] == [1.0] and info["qp_status"] == "trivial"
    assert info["cosines"] == pytest.approx([1.0])


def test_non_finite_grads_raise_without_state_change() -> None:
    bal = MarbleBalancer(3)
    grads = make_grads(0, k=3)
    grads[1, 5] = float("nan")
    with pytest.raises(ValueError, match="NaN"):
        bal.combine(grads)
    grads[1, 5] = float("inf")
    with pytest.raises(ValueError):
        bal.combine(grads)
    assert bal.num_refreshes == 0 and bal.num_qp_fallbacks == 0
    np.testing.assert_array_equal(bal.alpha_bar, np.full(3, 1 / 3))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
def test_dtypes(dtype: torch.dtype) -> None:
    grads = make_grads(11, k=3, p=256).to(dtype)
    update, info = MarbleBalancer(3).combine(grads)
    assert update.dtype == dtype and update.shape == (256,) and update.device == grads.device
    # ref: float64 Gram of the same (already rounded) values. The balancer's Gram is float64 for float64 buffers
    # and float32 otherwise (fp16/bf16 are upcast exactly): worst-case cosine rounding ~2 gamma_256(u32) ~ 3e-5,
    # which bounds alpha to ~1e-4 here (lambda_S ~ 0.94; typical errors are far smaller, ~5e-9).
    ref = bare_alpha(grads.double())
    u = U64 if dtype == torch.float64 else U32
    atol = alpha_sensitivity(grads, ref, cosine_rounding(256, u) + cosine_rounding(256))
    np.testing.assert_allclose(info["alpha_star"], ref, atol=atol)
    # The update's cosines: the certificate's -tol on the solver's Gram, then the Gram's and the [K, P] pass's
    # rounding relative to ||d|| (~0.54 here): <= 3 cosine_rounding(256, u) / ||d||.
    assert info["worst_cosine"] >= -3 * cosine_rounding(256, u) / info["direction_norm"]


def test_matmul_precision_restored() -> None:
    prev = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("high")
        MarbleBalancer(3).combine(make_grads(0, k=3, dtype=torch.float32))
        assert torch.get_float32_matmul_precision() == "high"
    finally:
        torch.set_float32_matmul_precision(prev)


def test_refresh_from_gram_only() -> None:
    grads = make_grads(12, k=4)
    a, b = MarbleBalancer(4, rho=0.6), MarbleBalancer(4, rho=0.6)
    update, info_a = a.combine(grads)
    coeffs, info_b = b.refresh(torch.mm(grads, grads.T))
    torch.testing.assert_close(torch.as_tensor(coeffs) @ grads, update)
    assert info_a["alpha_bar"] == info_b["alpha_bar"]
    np.testing.assert_allclose(info_a["cosines"], info_b["cosines"], atol=1e-9)
    with pytest.raises(ValueError, match="gram"):
        b.refresh(np.eye(3))


def test_update_cosines_zero_safe() -> None:
    grads = torch.tensor([[1.0, 0.0], [0.0, 0.0], [-2.0, 0.0], [1.0, 1.0]])
    cos = update_cosines(torch.tensor([3.0, 0.0]), grads)
    assert cos.dtype == torch.float64
    np.testing.assert_allclose(cos.numpy(), [1.0, 0.0, -1.0, 2**-0.5], atol=1e-7)
    assert (update_cosines(torch.zeros(2), grads) == 0).all()
    with pytest.raises(ValueError):
        update_cosines(torch.zeros(3), grads)
    stats = cosine_stats(cos, [True, False, True, True])
    assert stats["worst_cosine"] == pytest.approx(-1.0) and stats["conflict"]
    assert stats["cosine_var"] == pytest.approx(np.var([1.0, -1.0, 2**-0.5]))
    assert cosine_stats([], [])["conflict"] is False


def test_clamp_violation_counter_and_validation() -> None:
    bal = MarbleBalancer(2)
    bal.record_clamp_violations(0)
    bal.record_clamp_violations(3)
    assert bal.num_clamp_violations == 3 and bal.state_dict()["num_clamp_violations"] == 3
    with pytest.raises(ValueError):
        bal.record_clamp_violations(-1)
    with pytest.raises(ValueError):
        MarbleBalancer()
    with pytest.raises(ValueError):
        MarbleBalancer(3, reward_names=["a", "b"])
    with pytest.raises(ValueError):
        MarbleBalancer(reward_names=["a", "a"])
    with pytest.raises(ValueError):
        MarbleBalancer(2, rho=1.5)
    with pytest.raises(ValueError):
        MarbleBalancer(2, refresh_interval=0)
    with pytest.raises(ValueError):
        MarbleBalancer(2, uniform_final_steps=5, max_steps=3)
    with pytest.raises(ValueError):
        MarbleBalancer(2).combine(torch.zeros(3, 4))


def test_clamp_boundary_is_not_a_violation() -> None:
    # Prop. 1 needs r(A_bar) = sum_k w_k r(A_k) with r(A) = clamp(0.5 + clip(A, +-A_max) / (2 A_max), 0, 1): r is
    # affine on the closed interval |A| <= A_max, so |A_k| = A_max exactly is no violation, and |A_bar| <= max |A_k|
    # for simplex weights. Clamp violations are therefore samples with some |A_k| > A_max (strict), as counted by the
    # trainer and documented in record_clamp_violations.
    a_max = 5.0
    bal = MarbleBalancer(3, rho=0.0)
    bal.combine(make_grads(0, k=3))  # non-uniform alpha_bar
    w = bal.advantage_weights(dtype=torch.float64)
    at_boundary = torch.tensor(
        [[a_max, -a_max, 0.5, a_max], [-a_max, a_max, -a_max, a_max], [1.0, a_max, -a_max, a_max]], dtype=torch.float64
    )  # [K, B]
    # Both sides are sums of K terms <= 1 after an affine map: each within (K + 2) u of the exact (equal) value.
    atol = 2 * (3 + 2) * U64
    torch.testing.assert_close(
        advantage_to_r(w @ at_boundary, a_max), w @ advantage_to_r(at_boundary, a_max), rtol=0, atol=atol
    )
    beyond = at_boundary.clone()
    beyond[0, 0] = 1.5 * a_max  # one sample with |A_0| > A_max: r_0 clips and the identity breaks by w_0 / 4
    gap = (advantage_to_r(w @ beyond, a_max) - w @ advantage_to_r(beyond, a_max)).abs()
    assert gap[0] > 0.2 * w[0] and (gap[1:] <= atol).all()


def test_default_solver_is_injectable() -> None:
    calls = []

    def spy(gram: np.ndarray) -> QPResult:
        calls.append(gram.shape)
        return solve_min_norm(gram)

    bal = MarbleBalancer(3, solver=spy)
    grads = make_grads(13, k=3)
    grads[0] = 0
    bal.combine(grads)
    assert calls == [(2, 2)]  # only the rewards with signal reach the QP


# ---------------------------------------------------------------- norm-aware amortised steps, solve()


def test_solve_gives_the_coefficients_of_combines_update() -> None:
    grads = make_grads(21, k=4)
    a, b = MarbleBalancer(4), MarbleBalancer(4)
    update, info = a.combine(grads.clone())
    coeffs, info_b = b.solve(grads.clone())
    torch.testing.assert_close(torch.as_tensor(coeffs) @ grads, update, rtol=1e-12, atol=0)
    assert info.alpha_star == info_b.alpha_star and a.state_dict() == b.state_dict()


def test_norm_aware_amortised_coefficients_are_eq7s_on_the_refresh_gradients() -> None:
    # With rho = 0 (alpha_bar = alpha*), an amortised step on the refresh's own gradients is the refresh's update.
    grads = make_grads(5, k=4)
    bal = MarbleBalancer(4, rho=0.0, amortised="norm_aware")
    coeffs, _ = bal.solve(grads)
    signal = torch.ones(4, dtype=torch.bool)
    np.testing.assert_allclose(bal.amortised_coefficients(1, signal), coeffs, rtol=1e-12)
    # The paper's amortised steps apply alpha_bar itself, whatever the norms.
    paper = MarbleBalancer(4, rho=0.0)
    paper.solve(grads)
    np.testing.assert_array_equal(paper.amortised_coefficients(1, signal), paper.alpha_bar)


def test_norm_aware_coefficients_by_hand_and_their_edge_cases() -> None:
    bal = MarbleBalancer(3, amortised="norm_aware")
    signal = torch.tensor([True, True, True])
    np.testing.assert_array_equal(bal.amortised_coefficients(0, signal), np.full(3, 1 / 3))  # no refresh yet
    state = bal.state_dict()
    state["alpha_bar"], state["last_grad_norms"] = [0.5, 0.3, 0.2], [1.0, 4.0, 0.0]  # reward 2: no signal then
    bal.load_state_dict(state)
    # mean over the rewards with a gradient at the refresh: 2.5; reward 2 keeps its alpha_bar (ratio 1)
    np.testing.assert_allclose(bal.amortised_coefficients(1, signal), [0.5 * 2.5, 0.3 * 2.5 / 4, 0.2], rtol=1e-15)
    # a reward without signal now gets no coefficient, as on a refresh
    np.testing.assert_allclose(
        bal.amortised_coefficients(1, torch.tensor([True, False, True])), [1.25, 0.0, 0.2], rtol=1e-15
    )


def test_plan_returns_prop1s_advantage_and_policy_scale() -> None:
    bal = MarbleBalancer(2, amortised="norm_aware")
    state = bal.state_dict()
    state["alpha_bar"], state["last_grad_norms"], state["num_refreshes"] = [0.8, 0.2], [1.0, 4.0], 1
    bal.load_state_dict(state)
    per_reward = torch.tensor([[1.0, -1.0, 0.5], [-2.0, 2.0, 0.0]], dtype=torch.float64)
    c = np.array([0.8 * 2.5, 0.2 * 2.5 / 4])
    plan = bal.plan(1, per_reward, adv_clip_max=5.0)
    assert not plan.refresh and plan.policy_scale == pytest.approx(c.sum(), rel=1e-15)
    torch.testing.assert_close(plan.advantages, torch.as_tensor(c / c.sum()) @ per_reward, rtol=1e-15, atol=0)
    # nothing with signal: no policy term at all (as a refresh without signal), only the KL would move
    none = bal.plan(1, torch.zeros(2, 3, dtype=torch.float64), adv_clip_max=5.0)
    assert none.policy_scale == 0.0 and (none.advantages == 0).all()
    paper = MarbleBalancer(2).plan(1, per_reward, adv_clip_max=5.0)
    assert paper.policy_scale == pytest.approx(1.0, rel=1e-15)


def test_last_grad_norms_survive_state_dict_and_old_states_load() -> None:
    bal = MarbleBalancer(3, amortised="norm_aware")
    grads = make_grads(2, k=3)
    grads[1] = 0  # no signal: its norm is recorded as 0
    bal.combine(grads)
    norms = bal.last_grad_norms
    assert norms[1] == 0 and norms[0] > 0 and norms[2] > 0
    state = json.loads(json.dumps(bal.state_dict()))
    other = MarbleBalancer(3, amortised="norm_aware")
    other.load_state_dict(state)
    np.testing.assert_array_equal(other.last_grad_norms, norms)
    del state["last_grad_norms"]  # a checkpoint written before norm-aware amortisation
    other.load_state_dict(state)
    assert other.last_grad_norms is None
    for bad in ([1.0, 2.0], [1.0, -1.0, 2.0], [1.0, float("nan"), 2.0]):
        with pytest.raises(ValueError, match="last_grad_norms"):
            other.load_state_dict({**state, "last_grad_norms": bad})
    with pytest.raises(ValueError, match="amortised"):
        MarbleBalancer(2, amortised="normalised")


def test_hold_keeps_a_silent_rewards_alpha_bar_and_is_eq12_when_all_are_active() -> None:
    grads = make_grads(11, k=4)
    decay, hold = MarbleBalancer(4, rho=0.7), MarbleBalancer(4, rho=0.7, silent="hold")
    for bal in (decay, hold):
        bal.combine(grads)  # every reward active: the two modes are the paper's Eq. 12
    np.testing.assert_array_equal(decay.alpha_bar, hold.alpha_bar)
    np.testing.assert_array_equal(decay.last_grad_norms, hold.last_grad_norms)
    before, norms_before = hold.alpha_bar, hold.last_grad_norms
    silent = grads.clone()
    silent[2] = 0
    _, info = hold.combine(silent)
    star = np.asarray(info["alpha_star"])
    after = hold.alpha_bar
    assert star[2] == 0.0 and after[2] == pytest.approx(before[2], rel=1e-12)  # decay: 0.7 * before[2]
    assert after.sum() == pytest.approx(1.0, abs=1e-15) and (after >= 0).all()
    share = before[[0, 1, 3]].sum()
    np.testing.assert_allclose(after[[0, 1, 3]], 0.7 * before[[0, 1, 3]] + 0.3 * share * star[[0, 1, 3]], rtol=1e-12)
    assert hold.last_grad_norms[2] == norms_before[2] and hold.last_grad_norms[0] == info["grad_norms"][0]
    decay.combine(silent)
    assert decay.alpha_bar[2] == pytest.approx(0.7 * before[2], rel=1e-12) and decay.last_grad_norms[2] == 0.0
    # The update itself is the same Eq. 7 whatever the EMA does.
    np.testing.assert_array_equal(decay.last_alpha_star, hold.last_alpha_star)


def test_hold_never_refreshes_a_reward_silent_from_the_start() -> None:
    grads = make_grads(12, k=3)
    grads[1] = 0
    bal = MarbleBalancer(3, rho=0.5, silent="hold")
    for _ in range(5):
        bal.combine(grads)
    assert bal.alpha_bar[1] == pytest.approx(1 / 3, rel=1e-12)  # alpha_bar_0, untouched
    assert bal.last_grad_norms[1] == 0.0  # never seen: norm-aware steps then give it c_k = w_k
    with pytest.raises(ValueError, match="silent must be one of"):
        MarbleBalancer(3, silent="zero")
