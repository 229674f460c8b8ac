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
    solve_min_norm,
    solve_normalized_min_norm,
    update_cosines,
)


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
        np.testing.assert_allclose(info["alpha_star"], expected, atol=1e-9)
        np.testing.assert_allclose(bal.alpha_bar, expected, atol=1e-9)
        np.testing.assert_allclose(bal.advantage_weights(dtype=torch.float64).numpy(), expected, atol=1e-9)


def test_ema_matches_hand_computation() -> None:
    rho = 0.7
    bal = MarbleBalancer(reward_names=["a", "b", "c", "d"], rho=rho)
    expected = np.full(4, 0.25)
    for seed in range(3):
        grads = make_grads(10 + seed)
        _, info = bal.combine(grads)
        star = bare_alpha(grads)
        np.testing.assert_allclose(info["alpha_star"], star, atol=1e-9)
        expected = rho * expected + (1 - rho) * star
        np.testing.assert_allclose(bal.alpha_bar, expected, atol=1e-12)
        np.testing.assert_allclose(info["alpha_bar"], expected, atol=1e-12)
        np.testing.assert_allclose(bal.last_alpha_star, star, atol=1e-9)
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
    np.testing.assert_allclose(np.delete(info["alpha_star"], 2), ref["alpha_star"], atol=1e-12)
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
    update, info = MarbleBalancer(2).combine(torch.stack([g, -3 * g]))
    np.testing.assert_allclose(info["alpha_star"], [0.5, 0.5], atol=1e-8)
    # Pareto-stationary: the update is exactly zero, cosines 0, no conflict reported.
    assert info["pareto_stationary"] and info["direction_norm"] < 1e-8
    assert (update == 0).all() and info["cosines"] == [0.0, 0.0] and not info["conflict"]


def test_pareto_stationary_convex_hull_contains_zero() -> None:
    # Three unit directions at 120 degrees (different lengths): 0 = their centroid, MGDA finds it.
    angles = torch.tensor([0.0, 2.0, 4.0], dtype=torch.float64) * torch.pi / 3
    g = torch.stack([angles.cos(), angles.sin(), torch.zeros(3, dtype=torch.float64)], dim=1)
    g = g * torch.tensor([[1.0], [5.0], [0.2]], dtype=torch.float64)
    bal = MarbleBalancer(3, rho=0.0)
    update, info = bal.combine(g)
    np.testing.assert_allclose(info["alpha_star"], np.full(3, 1 / 3), atol=1e-7)
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
    ref = bare_alpha(grads.double())
    atol = 1e-4 if dtype in (torch.float32, torch.float64) else 1e-2
    np.testing.assert_allclose(info["alpha_star"], ref, atol=atol)
    assert info["worst_cosine"] >= -atol


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
