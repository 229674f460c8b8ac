"""Gradient balancing for multi-reward training (MARBLE): the min-norm QP and the stateful balancer."""

from .gram import (
    ENGINE_NAMES,
    GradientEngine,
    ReferenceGradientEngine,
    TwoStreamGradientEngine,
    find_unsupported_params,
    make_gradient_engine,
    unflatten,
)
from .marble import MarbleBalancer, cosine_stats, gram_cosines, update_cosines
from .qp import QPResult, normalized_gram, solve_min_norm, solve_normalized_min_norm

__all__ = [
    "ENGINE_NAMES",
    "GradientEngine",
    "ReferenceGradientEngine",
    "TwoStreamGradientEngine",
    "find_unsupported_params",
    "make_gradient_engine",
    "unflatten",
    "MarbleBalancer",
    "QPResult",
    "cosine_stats",
    "gram_cosines",
    "normalized_gram",
    "solve_min_norm",
    "solve_normalized_min_norm",
    "update_cosines",
]
