"""The Gram-based weightings of multi-objective optimisation, Gram in, weights out, on the same per-reward gradient
engine as MARBLE (``multi_objective_aggregation``: ``mgda``, ``upgrad``, ``dualproj``, ``pcgrad``, ``imtl_g``,
``aligned_mtl``, ``cagrad``, ``nash_mtl``).

Each weighting is a small class: ``weighting(G)`` takes a K x K Gram matrix ``G_ij = g_i . g_j`` and returns the
weights ``w`` [K] of the update ``sum_k w_k g_k`` as the method defines them. It runs on a float64 numpy copy,
without autograd, deterministically (no global RNG). The balancer (:class:`~marble_trl.balance.marble.MarbleBalancer`)
applies it to the *normalised* Gram (cosines, MARBLE's Eq. 5) through :func:`as_solver`, which turns the weights into
coefficients on the simplex (``w / sum w``): the direction is the method's, and Eq. 7 sets the step length (the mean
gradient norm), as for MARBLE. The EMA (``marble_rho``) and the amortised steps (``marble_refresh_interval``) then
apply to every weighting.

Why not TorchJD (the field's maintained library, which has most of these as Gramian weightings)? Measured against
torchjd 0.18: its UPGrad / DualProj need ``quadprog`` and ``qpsolvers`` and regularise the Gram (``reg_eps`` 1e-4,
so their weights differ from the exact projection by ~1e-4), its CAGrad needs ``cvxpy`` + ``clarabel``, its PCGrad
draws ``torch.randperm`` from the global RNG (a resumed run would not be the uninterrupted one), its MGDA is
Frank-Wolfe to ``epsilon`` 1e-3, and Nash-MTL is no Gramian weighting there. Written here, every QP runs on cvxopt
(already MARBLE's solver) and is exact, nothing draws random numbers, and no dependency is added. ``tests/test_weightings.py``
checks these weightings against TorchJD's (with its regularisation off) where TorchJD has them.

References: MGDA (Sener & Koltun 2018), UPGrad and DualProj (Quinton & Rey, "Jacobian Descent for Multi-Objective
Optimization", 2024), PCGrad (Yu et al. 2020), IMTL-G (Liu et al. 2021), Aligned-MTL (Senushkin et al. 2023), CAGrad
(Liu et al. 2021), Nash-MTL (Navon et al. 2022).
"""

from __future__ import annotations

import itertools
import math
import time

import numpy as np

from .qp import QPResult, solve_min_norm


def _qp_lower_bounded(gram: np.ndarray, u: np.ndarray) -> np.ndarray:
    """``argmin_v v^T G v`` subject to ``v >= u`` (the dual-cone projection of ``J^T u`` in weight space)."""
    import cvxopt

    k = gram.shape[0]
    scale = max(float(np.trace(gram)) / k, 1e-300)  # conditioning only: the argmin is scale-free
    p = cvxopt.matrix(gram / scale + 1e-13 * np.eye(k))  # a ridge at float64 rounding: rank-deficient Grams solve
    sol = cvxopt.solvers.qp(
        p, cvxopt.matrix(np.zeros(k)), cvxopt.matrix(-np.eye(k)), cvxopt.matrix(-u.astype(np.float64)),
        options={"show_progress": False, "abstol": 1e-12, "reltol": 1e-12, "feastol": 1e-12},
    )  # fmt: skip
    v = np.array(sol["x"]).reshape(-1)
    return np.maximum(v, u)  # the bound holds exactly


class MGDAWeighting:
    """MGDA's min-norm point of the convex hull (MARBLE's QP, ``qp.solve_min_norm``): ``min ||sum w_k g_k||`` on the
    simplex. :meth:`solve` is the balancer's solver (the QP's status and polish, not only the weights)."""

    def __call__(self, gram: np.ndarray) -> np.ndarray:
        return np.array(solve_min_norm(gram).alpha)

    def solve(self, gram: np.ndarray) -> QPResult:
        return solve_min_norm(gram)


class UPGradWeighting:
    """UPGrad: each ``g_i / K`` projected onto the dual cone of the rows, summed: ``w = sum_i argmin_{v >= e_i / K}
    v^T G v``. The update conflicts with no reward (``G w >= 0``) and every reward keeps a share ``w_i >= 1/K``."""

    def __call__(self, gram: np.ndarray) -> np.ndarray:
        k = gram.shape[0]
        return sum(_qp_lower_bounded(gram, np.eye(k)[i] / k) for i in range(k))


class DualProjWeighting:
    """DualProj: the mean gradient projected onto the dual cone: ``w = argmin_{v >= 1/K} v^T G v``."""

    def __call__(self, gram: np.ndarray) -> np.ndarray:
        k = gram.shape[0]
        return _qp_lower_bounded(gram, np.full(k, 1.0 / k))


class PCGradWeighting:
    """PCGrad in expectation over the projection orders: for each ``g_i``, project away its conflicting component
    against every other gradient in turn, then sum. PCGrad draws one random order per step; this is the mean over all
    ``(K - 1)!`` orders (K <= 6), or over 720 orders from a fixed-seed generator (K > 6): deterministic and
    permutation-equivariant."""

    def __call__(self, gram: np.ndarray) -> np.ndarray:
        k = gram.shape[0]
        weights = np.zeros(k)
        for i in range(k):
            others = [j for j in range(k) if j != i]
            if k <= 6:
                orders = list(itertools.permutations(others))
            else:
                rng = np.random.default_rng(0)
                orders = [tuple(rng.permutation(others)) for _ in range(720)]
            for order in orders:
                w = np.zeros(k)
                w[i] = 1.0
                for j in order:
                    dot = gram[j] @ w
                    if dot < 0.0 and gram[j, j] > 0.0:
                        w[j] -= dot / gram[j, j]
                weights += w / len(orders)
        return weights


class IMTLGWeighting:
    """IMTL-G: the update whose projections on every unit gradient ``u_k`` are equal: ``w = G^+ d / sum(G^+ d)``
    with ``d = sqrt(diag G)``; zero when that sum vanishes."""

    def __call__(self, gram: np.ndarray) -> np.ndarray:
        v = np.linalg.pinv(gram, hermitian=True) @ np.sqrt(np.clip(np.diag(gram), 0.0, None))
        total = v.sum()
        return np.zeros_like(v) if abs(total) < 1e-12 else v / total


class AlignedMTLWeighting:
    """Aligned-MTL: the gradients' principal directions rescaled to the smallest eigenvalue (condition number 1):
    ``w = sqrt(lambda_min) V Sigma^{-1/2} V^T 1 / K`` over the Gram's non-null eigenpairs."""

    def __call__(self, gram: np.ndarray) -> np.ndarray:
        k = gram.shape[0]
        lam, vec = np.linalg.eigh(gram)
        tol = max(lam.max(), 0.0) * k * np.finfo(np.float64).eps
        keep = lam > tol
        if not keep.any():
            return np.full(k, 1.0 / k)
        lam, vec = lam[keep], vec[:, keep]
        b = math.sqrt(lam.min()) * vec @ np.diag(1.0 / np.sqrt(lam)) @ vec.T
        return b @ np.full(k, 1.0 / k)


class CAGradWeighting:
    """CAGrad (``c`` = 0.5): ``w = 1/K + (sqrt(phi) / ||g_w||) w*`` with ``w* = argmin_{w in simplex} g_w . g_0 +
    sqrt(phi) ||g_w||``, ``g_0`` the mean gradient and ``sqrt(phi) = c ||g_0||`` (a second-order cone program,
    solved with cvxopt)."""

    def __init__(self, c: float = 0.5) -> None:
        if c < 0:
            raise ValueError(f"CAGrad's c must be >= 0, got {c}.")
        self.c = c

    def __call__(self, gram: np.ndarray) -> np.ndarray:
        import cvxopt

        k = gram.shape[0]
        gram = gram / max(float(np.trace(gram)) / k, 1e-300)  # the weights are scale-free: solve at unit scale
        u = np.full(k, 1.0 / k)
        sqrt_phi = self.c * math.sqrt(max(float(u @ gram @ u), 0.0))
        lam, vec = np.linalg.eigh(gram)
        root = vec @ np.diag(np.sqrt(np.clip(lam, 0.0, None)))  # G = R R^T: ||J^T w|| = ||R^T w||
        if sqrt_phi <= 0.0:
            return u
        # variables x = [w (K), t]; minimise (G u) . w + sqrt(phi) t, s.t. w >= 0 (K rows) and ||R^T w|| <= t (one
        # second-order cone of size K + 1), sum w = 1. conelp, not socp: only conelp takes per-call options.
        cost = cvxopt.matrix(np.concatenate([gram @ u, [sqrt_phi]]))
        g_mat = np.zeros((2 * k + 1, k + 1))
        g_mat[:k, :k] = -np.eye(k)
        g_mat[k, k] = -1.0
        g_mat[k + 1 :, :k] = -root.T
        sol = cvxopt.solvers.conelp(
            cost, cvxopt.matrix(g_mat), cvxopt.matrix(np.zeros(2 * k + 1)), {"l": k, "q": [k + 1], "s": []},
            A=cvxopt.matrix(np.concatenate([np.ones(k), [0.0]]), (1, k + 1)), b=cvxopt.matrix(1.0),
            options={"show_progress": False, "abstol": 1e-9, "reltol": 1e-9, "feastol": 1e-9},
        )  # fmt: skip
        w = np.clip(np.array(sol["x"]).reshape(-1)[:k], 0.0, None)
        w = w / w.sum()
        norm = math.sqrt(max(float(w @ gram @ w), 0.0))
        return u + (sqrt_phi / norm) * w if norm > 1e-12 else np.zeros(k)


class NashMTLWeighting:
    """Nash-MTL's bargaining solution: ``w > 0`` with ``G w = 1 / w``, the minimiser of the strictly convex
    ``w^T G w / 2 - sum log w`` (damped Newton; the paper approximates it with a few convex-concave steps). Zero when
    no such point exists (the gradients are Pareto-stationary)."""

    def __call__(self, gram: np.ndarray, iterations: int = 100) -> np.ndarray:
        k = gram.shape[0]
        scale = max(float(np.trace(gram)) / k, 1e-300)
        g = gram / scale  # solve at unit scale: w(G / s) = sqrt(s) w(G)
        w = np.ones(k)

        def f(x):
            return 0.5 * x @ g @ x - np.log(x).sum()

        for _ in range(iterations):
            grad = g @ w - 1.0 / w
            hess = g + np.diag(1.0 / w**2)
            step = np.linalg.solve(hess, grad)
            t = 1.0
            while np.any(w - t * step <= 0) or f(w - t * step) > f(w) - 0.25 * t * grad @ step:
                t *= 0.5
                if t < 1e-12:
                    return np.zeros(k)
            w = w - t * step
            if np.abs(grad).max() < 1e-12:
                break
        return w / math.sqrt(scale)


def as_solver(weighting):
    """The balancer's solver (normalised Gram -> :class:`~marble_trl.balance.qp.QPResult` on the simplex) of a
    weighting: ``alpha = w / sum w``. Negative weights (possible with ``imtl_g`` and ``aligned_mtl``) are clipped to
    0 first, since the balancer's coefficients are a convex combination (status ``"clipped"``); weights that sum to
    ~0 (Pareto-stationary gradients) or are not finite give ``ok=False``, and the balancer keeps its coefficients."""

    def solve(gram_hat: np.ndarray) -> QPResult:
        start = time.perf_counter()
        w = np.asarray(weighting(np.asarray(gram_hat, dtype=np.float64)), dtype=np.float64)
        k = w.shape[0]
        status = "optimal"
        if np.isfinite(w).all() and (w < -1e-12).any():
            w, status = np.clip(w, 0.0, None), "clipped"
        total = w.sum() if np.isfinite(w).all() else float("nan")
        ok = bool(np.isfinite(total) and total > 1e-12)
        alpha = w / total if ok else np.full(k, 1.0 / k)
        alpha.flags.writeable = False
        return QPResult(alpha, status if ok else "no_direction", ok, time.perf_counter() - start)

    return solve
