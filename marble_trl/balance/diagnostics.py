"""Harmony diagnostics of a multi-reward update (MARBLE Table S1): cosines between an update and each reward's
gradient, and their worst / mean / variance / conflict statistics. One home for every method (MARBLE's refreshes and
the baselines' per-step diagnostic) so they are computed the same way."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from .qp import as_float64_matrix

__all__ = ["cosine_stats", "gram_cosines", "ieee_fp32_matmul", "update_cosines", "work_tensor"]


@contextlib.contextmanager
def ieee_fp32_matmul() -> Iterator[None]:
    """Full-precision float32 matmuls inside (restored after): with TF32 on (``tf32=True``, or
    ``set_float32_matmul_precision("high")``) a float32 Gram would carry ~1e-3 relative error, as large as the
    cosines it is meant to resolve."""
    prev = torch.get_float32_matmul_precision()
    if prev == "highest":
        yield
        return
    torch.set_float32_matmul_precision("highest")
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(prev)


def work_tensor(grads: torch.Tensor) -> torch.Tensor:
    """The buffers in a dtype safe for sums of squares: float32/float64 as is, half types upcast to float32."""
    if not grads.is_floating_point():
        raise TypeError(f"grads must be a floating tensor, got {grads.dtype}")
    return grads if grads.dtype in (torch.float32, torch.float64) else grads.float()


@torch.no_grad()
def update_cosines(update: torch.Tensor, grads: torch.Tensor, grad_norms: torch.Tensor | None = None) -> torch.Tensor:
    """``cos(update, g_k)`` for each row of ``grads`` [K, P]; 0 where either vector is zero. float64 [K].

    Use it for any update direction (MARBLE's ``d_final``, a weighted-sum baseline's ``mean_k g_k``) so the harmony
    statistics of Table S1 are computed the same way. ``grad_norms`` (``||g_k||``) may be passed to skip a pass.
    """
    work = work_tensor(grads)
    if work.ndim != 2:
        raise ValueError(f"grads must be [K, P], got shape {tuple(grads.shape)}")
    u = update.reshape(-1).to(work.dtype)
    if u.shape[0] != work.shape[1]:
        raise ValueError(f"update has {u.shape[0]} elements, grads rows have {work.shape[1]}")
    with ieee_fp32_matmul():
        dots = torch.mv(work, u).double()
    gn = torch.linalg.vector_norm(work, dim=1) if grad_norms is None else grad_norms.to(work.device)
    denom = torch.linalg.vector_norm(u).double() * gn.double()
    ok = denom > 0
    return torch.where(ok, dots / torch.where(ok, denom, torch.ones_like(denom)), 0.0).clamp(-1.0, 1.0)


def gram_cosines(gram: Any, coeffs: Any) -> np.ndarray:
    """``cos(d, g_k)`` for ``d = sum_j coeffs_j g_j``, from the Gram alone (no pass over the parameters).

    Zero-safe: 0 for a zero ``g_k`` and for ``||d||`` below 1e-6 of ``sum_j |coeffs_j| ||g_j||`` (a cancelled
    direction, where the Gram's rounding would otherwise produce arbitrary cosines).
    """
    m = as_float64_matrix(gram)
    c = np.asarray(coeffs, dtype=np.float64)
    mc = m @ c
    dd = float(c @ mc)
    n = np.sqrt(np.clip(np.diag(m), 0.0, None))
    size = float(np.abs(c) @ n)  # >= ||d|| by the triangle inequality
    if not dd > (1e-6 * size) ** 2:
        return np.zeros_like(c)
    out = np.zeros_like(c)
    nz = n > 0
    out[nz] = mc[nz] / (math.sqrt(dd) * n[nz])
    return np.clip(out, -1.0, 1.0)


def cosine_stats(cosines: Any, active: Any = None) -> dict[str, float | bool]:
    """Table S1 harmony statistics over the rewards in ``active`` (default all): worst, mean, population variance,
    and ``conflict = worst < 0``. With no reward selected everything is 0 / False."""
    c = np.asarray(cosines.detach().cpu() if hasattr(cosines, "detach") else cosines, dtype=np.float64).reshape(-1)
    if active is not None:
        c = c[np.asarray(active, dtype=bool)]
    if c.size == 0:
        return {"worst_cosine": 0.0, "mean_cosine": 0.0, "cosine_var": 0.0, "conflict": False}
    worst = float(c.min())
    return {"worst_cosine": worst, "mean_cosine": float(c.mean()), "cosine_var": float(c.var()), "conflict": worst < 0}
