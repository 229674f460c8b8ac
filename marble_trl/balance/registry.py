"""Every way several rewards combine (``multi_objective_aggregation``), one entry per name: the only place a name is
written. The config's checks, the trainer's setup, the preflight, the model card and the benchmark read it.

Two kinds (TorchJD's split between aggregating losses and aggregating a Jacobian):

- **advantage space**: the per-reward advantages are combined into one before the policy loss (one backward, no
  balancer): ``sum_then_normalize`` (DiffusionNFT's weighted sum) and ``normalize_then_sum`` (GDPO); the arithmetic
  is :func:`marble_trl.balance.advantages.collate_advantages`.
- **gradient space**: a :class:`Weighting` (a K x K Gram matrix in, K weights out; TorchJD's ``Weighting``) applied by
  the balancer (:class:`~marble_trl.balance.marble.MarbleBalancer`: the normalised Gram of Eq. 5, the EMA, the refresh
  schedule, Eq. 7, the counters) to the per-reward gradients of the engines. MARBLE is the min-norm point (MGDA's
  weighting, solved by :func:`~marble_trl.balance.qp.solve_min_norm`) with the EMA; ``mgda`` is the same point
  without it (rho 0); the others are :mod:`marble_trl.balance.weightings`.

A weighting is any callable ``gram -> weights``; one with a ``solve(gram) -> QPResult`` method gives the balancer its
simplex coefficients directly (the min-norm QP's status, polish and KKT check), the others go through
:func:`~marble_trl.balance.weightings.as_solver`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, Protocol

import numpy as np

from .qp import QPResult
from .weightings import (
    AlignedMTLWeighting,
    CAGradWeighting,
    DualProjWeighting,
    IMTLGWeighting,
    MGDAWeighting,
    NashMTLWeighting,
    PCGradWeighting,
    UPGradWeighting,
    as_solver,
)


class Weighting(Protocol):
    """Gram in, weights out: ``weighting(G)`` with ``G_ij = g_i . g_j`` (float64 [K, K]) returns ``w`` [K], the update
    being ``sum_k w_k g_k``. Deterministic, without autograd."""

    def __call__(self, gram: np.ndarray) -> np.ndarray: ...


@dataclass(frozen=True)
class Aggregation:
    """One ``multi_objective_aggregation``: its name, its space, and (gradient space) its weighting."""

    name: str
    space: Literal["advantage", "gradient"]
    summary: str
    weighting: Callable[[], Weighting] | None = None
    ema: bool = True  # whether the balancer smooths the coefficients (marble_rho); False: rho 0
    procedures: tuple[str, ...] = ("paper",)  # marble_procedure values it takes ("released": MARBLE's own)

    @property
    def balanced(self) -> bool:
        """Whether the balancer (per-reward gradients, Gram, coefficients) runs it."""
        return self.space == "gradient"

    def solver(self) -> Callable[[np.ndarray], QPResult]:
        """The balancer's solver: normalised Gram -> coefficients on the simplex."""
        if self.weighting is None:
            raise ValueError(f"Aggregation {self.name!r} combines advantages: it has no gradient solver.")
        weighting = self.weighting()
        return weighting.solve if hasattr(weighting, "solve") else as_solver(weighting)


_ENTRIES = (
    Aggregation("sum_then_normalize", "advantage", "DiffusionNFT's weighted sum of the rewards, normalised per group"),
    Aggregation("normalize_then_sum", "advantage", "GDPO: each reward normalised per group, then the weighted sum"),
    Aggregation(
        "marble", "gradient", "MARBLE: the min-norm point of the unit gradients, EMA-smoothed and amortised",
        MGDAWeighting, procedures=("paper", "released"),
    ),
    Aggregation("mgda", "gradient", "MGDA: the min-norm point at every refresh (MARBLE without its EMA)", MGDAWeighting,
                ema=False),
    Aggregation("upgrad", "gradient", "UPGrad (Quinton & Rey 2024)", UPGradWeighting),
    Aggregation("dualproj", "gradient", "DualProj (Quinton & Rey 2024)", DualProjWeighting),
    Aggregation("pcgrad", "gradient", "PCGrad in expectation over orders (Yu et al. 2020)", PCGradWeighting),
    Aggregation("imtl_g", "gradient", "IMTL-G (Liu et al. 2021)", IMTLGWeighting),
    Aggregation("aligned_mtl", "gradient", "Aligned-MTL (Senushkin et al. 2023)", AlignedMTLWeighting),
    Aggregation("cagrad", "gradient", "CAGrad, c = 0.5 (Liu et al. 2021)", CAGradWeighting),
    Aggregation("nash_mtl", "gradient", "Nash-MTL's bargaining solution (Navon et al. 2022)", NashMTLWeighting),
)  # fmt: skip
AGGREGATIONS: dict[str, Aggregation] = {a.name: a for a in _ENTRIES}

ADVANTAGE_AGGREGATIONS = tuple(n for n, a in AGGREGATIONS.items() if not a.balanced)
BALANCER_AGGREGATIONS = tuple(n for n, a in AGGREGATIONS.items() if a.balanced)
# The weightings of multi-objective optimisation beside MARBLE, on its gradient engine (benchmarks, docs/marble.md).
AGGREGATORS = tuple(n for n in BALANCER_AGGREGATIONS if n != "marble")
WEIGHTINGS: dict[str, Callable[[], Weighting]] = {n: AGGREGATIONS[n].weighting for n in AGGREGATORS}


def aggregation(name: str) -> Aggregation:
    if name not in AGGREGATIONS:
        raise ValueError(f"multi_objective_aggregation must be one of {('auto', *AGGREGATIONS)}, got {name!r}.")
    return AGGREGATIONS[name]
