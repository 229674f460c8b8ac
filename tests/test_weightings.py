"""The Gram weightings of balance.weightings: TorchJD-style properties (non-conflict where the method claims it, KKT
of the QPs, permutation equivariance, scale handling, duplicated and rank-deficient gradients), agreement with TorchJD
where it has the method, and each one selectable through the balancer and the trainer."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from tiny import brightness, contrast, tiny_args

from marble_trl import MarbleDiffusionNFTTrainer
from marble_trl.balance import MarbleBalancer
from marble_trl.balance.registry import AGGREGATORS, WEIGHTINGS
from marble_trl.balance.weightings import as_solver
from marble_trl.data.prompts import load_prompt_dataset

NON_CONFLICTING = ("mgda", "upgrad", "dualproj")  # methods whose update conflicts with no gradient
SCALE_INVARIANT = tuple(n for n in AGGREGATORS if n != "nash_mtl")  # nash_mtl: w(sG) = w(G) / sqrt(s)


def jacobian(seed: int, k: int, dim: int = 6, conflict: bool = True) -> np.ndarray:
    rng = np.random.default_rng(seed)
    j = rng.normal(size=(k, dim))
    if conflict:
        j[1] = -0.7 * j[0] + 0.3 * rng.normal(size=dim)  # an opposing pair
    return j


def weights(name: str, gram: np.ndarray) -> np.ndarray:
    return np.asarray(WEIGHTINGS[name]()(gram), dtype=np.float64)


@pytest.mark.parametrize("name", AGGREGATORS)
@pytest.mark.parametrize("k", [2, 3, 5])
def test_finite_and_permutation_equivariant(name, k):
    for seed in range(3):
        j = jacobian(seed, k)
        gram = j @ j.T
        w = weights(name, gram)
        assert w.shape == (k,) and np.isfinite(w).all()
        perm = np.random.default_rng(seed + 10).permutation(k)
        w_perm = weights(name, gram[np.ix_(perm, perm)])
        np.testing.assert_allclose(w_perm, w[perm], rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("name", NON_CONFLICTING)
@pytest.mark.parametrize("k", [2, 3, 5])
def test_update_conflicts_with_no_gradient(name, k):
    for seed in range(4):
        j = jacobian(seed, k)
        gram = j @ j.T
        w = weights(name, gram)
        assert (gram @ w >= -1e-8 * np.abs(gram).max()).all(), (name, gram @ w)


@pytest.mark.parametrize("name", ["upgrad", "dualproj"])
def test_dual_cone_projection_kkt(name):
    """``v = argmin v^T G v s.t. v >= u``: ``G v >= 0``, ``v >= u``, complementary slackness ``(G v)_i (v - u)_i = 0``."""
    k = 4
    j = jacobian(7, k)
    gram = j @ j.T
    from marble_trl.balance.weightings import _qp_lower_bounded

    for u in [np.full(k, 1 / k), *(np.eye(k)[i] / k for i in range(k))]:
        v = _qp_lower_bounded(gram, u)
        mu = gram @ v
        assert (v >= u - 1e-12).all() and (mu >= -1e-9).all()
        assert np.abs(mu * (v - u)).max() < 1e-8
    if name == "upgrad":
        assert (weights("upgrad", gram) >= 1 / k - 1e-12).all()  # every reward keeps a share


@pytest.mark.parametrize("name", SCALE_INVARIANT)
def test_scale_invariance(name):
    j = jacobian(3, 3)
    gram = j @ j.T
    np.testing.assert_allclose(weights(name, 1e4 * gram), weights(name, gram), rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(weights(name, 1e-4 * gram), weights(name, gram), rtol=1e-5, atol=1e-7)


def test_nash_mtl_is_the_bargaining_solution_and_scales_as_one_over_sqrt():
    j = jacobian(4, 3, conflict=False)
    gram = j @ j.T
    w = weights("nash_mtl", gram)
    assert (w > 0).all()
    np.testing.assert_allclose(gram @ w, 1 / w, rtol=1e-8)
    np.testing.assert_allclose(weights("nash_mtl", 4.0 * gram), w / 2, rtol=1e-8)


@pytest.mark.parametrize("name", AGGREGATORS)
def test_duplicated_and_rank_deficient_gradients(name):
    j = jacobian(5, 3, dim=2, conflict=False)  # 3 gradients in 2 dimensions: rank 2
    j = np.vstack([j, j[0]])  # and a duplicate of the first
    gram = j @ j.T
    w = weights(name, gram)
    assert np.isfinite(w).all()
    if name != "nash_mtl":  # its objective is unbounded on a singular Gram with a positive null vector
        # The update is unique (the weights need not be: the QPs' objective is flat along w_0 - w_3).
        swap = [3, 1, 2, 0]
        w_swapped = weights(name, gram[np.ix_(swap, swap)])
        np.testing.assert_allclose(j[swap].T @ w_swapped, j.T @ w, rtol=1e-5, atol=1e-6)
        if name not in ("upgrad", "dualproj"):
            np.testing.assert_allclose(w[0], w[3], rtol=1e-5, atol=1e-7)  # the two copies are treated alike
    if name in NON_CONFLICTING:
        assert (gram @ w >= -1e-7 * np.abs(gram).max()).all()


def test_cagrad_solves_its_dual_problem():
    """CAGrad's inner problem ``min_{w in simplex} w . G u + sqrt(phi) ||J^T w||``: our SOCP's point is at least as
    good as an independent solver's (scipy SLSQP), and the weights agree to that solver's accuracy."""
    from scipy.optimize import minimize

    for seed, k in [(0, 2), (1, 3), (2, 4)]:
        j = jacobian(seed, k, dim=8)
        gram = j @ j.T
        u = np.full(k, 1 / k)
        sqrt_phi = 0.5 * math.sqrt(u @ gram @ u)

        def objective(w, gram=gram, u=u, sqrt_phi=sqrt_phi):
            return w @ gram @ u + sqrt_phi * math.sqrt(max(w @ gram @ w, 0.0))

        res = minimize(objective, u, method="SLSQP", bounds=[(0, 1)] * k, tol=1e-14,
                       constraints=[{"type": "eq", "fun": lambda w: w.sum() - 1}])  # fmt: skip
        ours = weights("cagrad", gram)
        inner = (ours - u) / (ours - u).sum()  # ours = u + (sqrt(phi) / ||J^T w||) w with w on the simplex
        assert objective(inner) <= objective(res.x) + 1e-8  # interior-point accuracy
        expected = u + sqrt_phi / math.sqrt(res.x @ gram @ res.x) * res.x
        np.testing.assert_allclose(ours, expected, rtol=1e-3, atol=1e-4)


def test_cagrad_with_c_zero_is_the_mean():
    from marble_trl.balance.weightings import CAGradWeighting

    j = jacobian(1, 3)
    np.testing.assert_allclose(CAGradWeighting(c=0.0)(j @ j.T), np.full(3, 1 / 3))


# ---------------------------------------------------------------------------------------------- against TorchJD
def _torchjd(name: str):
    aggregation = pytest.importorskip("torchjd.aggregation")
    if name in ("upgrad", "dualproj"):
        pytest.importorskip("quadprog")
        from torchjd._linalg import QuadprogProjector

        projector = QuadprogProjector(norm_eps=0.0, reg_eps=0.0)  # the exact projection (ours solves it exactly)
        cls = aggregation.UPGradWeighting if name == "upgrad" else aggregation.DualProjWeighting
        return cls(projector=projector)
    if name == "mgda":
        return aggregation.MGDAWeighting(epsilon=1e-9, max_iters=20_000)
    if name == "cagrad":
        pytest.importorskip("cvxpy")
        return aggregation.CAGradWeighting(c=0.5, norm_eps=0.0)
    return {"imtl_g": aggregation.IMTLGWeighting, "aligned_mtl": aggregation.AlignedMTLWeighting,
            "pcgrad": aggregation.PCGradWeighting}[name]()  # fmt: skip


@pytest.mark.parametrize("name", ["upgrad", "dualproj", "imtl_g", "aligned_mtl", "mgda", "cagrad", "pcgrad"])
def test_weights_match_torchjd(name):
    theirs = _torchjd(name)
    for seed, k in [(0, 2), (1, 3), (2, 4)]:
        j = jacobian(seed, k, dim=8)
        gram = j @ j.T
        ours = weights(name, gram)
        g = torch.tensor(gram)
        if name == "pcgrad" and k > 2:  # theirs draws one random order per call: compare with the mean of many
            torch.manual_seed(0)
            ref = torch.stack([theirs(g) for _ in range(2000)]).mean(0).numpy()
            np.testing.assert_allclose(ours, ref, rtol=0, atol=0.05 * np.abs(ours).max())
            continue
        ref = theirs(g).numpy()
        tol = 1e-4 if name == "mgda" else 1e-6  # theirs: Frank-Wolfe; ours: the QP with a KKT-checked polish
        np.testing.assert_allclose(ours, ref, rtol=tol, atol=tol * np.abs(ref).max())


# ---------------------------------------------------------------------------------------------- in the balancer
@pytest.mark.parametrize("name", [n for n in AGGREGATORS if n != "mgda"])
def test_balancer_refresh_with_a_weighting(name):
    j = jacobian(2, 3, dim=8)
    norms = np.array([1.0, 3.0, 0.5])
    j = j / np.linalg.norm(j, axis=1, keepdims=True) * norms[:, None]
    balancer = MarbleBalancer(3, rho=0.0, solver=as_solver(WEIGHTINGS[name]()))
    coeffs, info = balancer.refresh(j @ j.T)
    unit = j / norms[:, None]
    w = np.clip(weights(name, unit @ unit.T), 0, None)
    np.testing.assert_allclose(info.alpha_bar, w / w.sum(), rtol=1e-6, atol=1e-9)
    update = coeffs @ j
    assert math.isclose(np.linalg.norm(coeffs * norms / norms.mean()), np.linalg.norm(w / w.sum()), rel_tol=1e-6)
    if name in NON_CONFLICTING:
        assert min(info.cosines) >= -1e-8 and (j @ update >= -1e-8).all()


@pytest.mark.parametrize("name", AGGREGATORS)
def test_every_aggregation_trains_through_the_trainer(name, tmp_path):
    args = tiny_args(tmp_path, max_steps=1, multi_objective_aggregation=name)
    trainer = MarbleDiffusionNFTTrainer("tiny", [brightness, contrast], args=args, train_dataset=load_prompt_dataset())
    trainer.train()
    logs = [h for h in trainer.state.log_history if "marble/alpha_bar/brightness" in h]
    assert len(logs) == 1 and trainer.balancer.num_refreshes == 1
    a = [logs[-1][f"marble/alpha_bar/{n}"] for n in ("brightness", "contrast")]
    assert all(v >= 0 for v in a) and math.isclose(sum(a), 1.0, abs_tol=1e-9)
    if name == "mgda":  # no EMA: alpha_bar is the last QP solution
        assert a == pytest.approx([logs[-1]["marble/alpha/brightness"], logs[-1]["marble/alpha/contrast"]])


# The registry: one entry per aggregation name ---------------------------------------------------------------------


def test_the_registry_is_the_one_list_of_aggregations():
    from marble_trl.balance.qp import solve_min_norm
    from marble_trl.balance.registry import ADVANTAGE_AGGREGATIONS, AGGREGATIONS, BALANCER_AGGREGATIONS
    from marble_trl.config_checks import AGGREGATIONS as ACCEPTED
    from marble_trl.config_checks import WEIGHTED_SUM_AGGREGATIONS

    assert ACCEPTED == ("auto", *AGGREGATIONS)
    assert set(ADVANTAGE_AGGREGATIONS) | set(BALANCER_AGGREGATIONS) == set(AGGREGATIONS)
    assert ADVANTAGE_AGGREGATIONS == WEIGHTED_SUM_AGGREGATIONS == ("sum_then_normalize", "normalize_then_sum")
    assert set(AGGREGATORS) == set(BALANCER_AGGREGATIONS) - {"marble"} and "mgda" in AGGREGATORS
    assert [n for n, a in AGGREGATIONS.items() if "released" in a.procedures] == ["marble"]
    assert [n for n, a in AGGREGATIONS.items() if a.balanced and not a.ema] == ["mgda"]
    j = np.abs(np.random.default_rng(0).normal(size=(4, 7)))  # no Pareto-stationary point: every weighting has one
    gram = (j / np.linalg.norm(j, axis=1, keepdims=True)) @ (j / np.linalg.norm(j, axis=1, keepdims=True)).T
    for name in ADVANTAGE_AGGREGATIONS:
        with pytest.raises(ValueError, match="no gradient solver"):
            AGGREGATIONS[name].solver()
    for name in BALANCER_AGGREGATIONS:
        res = AGGREGATIONS[name].solver()(gram)
        assert res.ok and res.alpha.shape == (4,) and abs(res.alpha.sum() - 1) < 1e-9 and (res.alpha >= 0).all(), name
    # MARBLE and MGDA are the min-norm QP itself (its status and polish), not the weights renormalised
    for name in ("marble", "mgda"):
        assert np.array_equal(AGGREGATIONS[name].solver()(gram).alpha, solve_min_norm(gram).alpha)
        assert AGGREGATIONS[name].solver()(gram).status == solve_min_norm(gram).status
