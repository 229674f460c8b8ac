"""Multi-reward balancing: the per-reward and combined group advantages (``advantages.py``), per-reward gradient
engines, the aggregation registry, the min-norm QP, MARBLE's stateful balancers and the harmony diagnostics."""

from .diagnostics import cosine_stats, gram_cosines, update_cosines
from .engines import ENGINE_NAMES, GradientEngine, ReferenceGradientEngine, make_gradient_engine
from .gradient_buffers import unflatten
from .layer_gram import LayerGramEngine
from .marble import MarbleBalancer, RefreshInfo, StepWeights
from .qp import QPResult, normalized_gram, solve_min_norm, solve_normalized_min_norm
from .registry import AGGREGATIONS, Aggregation, Weighting
from .released import PairSolve, ReleasedMarble
from .two_stream import TwoStreamGradientEngine, find_unsupported_params

__all__ = [
    "AGGREGATIONS",
    "Aggregation",
    "Weighting",
    "ENGINE_NAMES",
    "GradientEngine",
    "LayerGramEngine",
    "ReferenceGradientEngine",
    "TwoStreamGradientEngine",
    "find_unsupported_params",
    "make_gradient_engine",
    "unflatten",
    "MarbleBalancer",
    "PairSolve",
    "ReleasedMarble",
    "QPResult",
    "RefreshInfo",
    "StepWeights",
    "cosine_stats",
    "gram_cosines",
    "normalized_gram",
    "solve_min_norm",
    "solve_normalized_min_norm",
    "update_cosines",
]
