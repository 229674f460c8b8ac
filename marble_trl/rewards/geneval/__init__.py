"""GenEval (Ghosh et al., 2023) as a reward: in the training process, or on a reward server over HTTP.

One registered name, ``geneval``, two back-ends chosen by the options (docs/rewards.md):

- with ``url``: the HTTP client (:class:`~marble_trl.rewards.http.HTTPReward`), for a GenEval server, as before;
- without: :class:`GenEvalReward`, which runs a transformers Mask2Former detector and CLIP colour check here and
  applies GenEval's rules, with no mmcv/mmdet.

Modules: ``rules`` (the scoring rules, pure Python/numpy), ``detector`` (Mask2Former with mmdet's pre- and
post-processing), ``colour`` (the CLIP colour classifier), ``metadata`` (reading GenEval's columns), ``reward``.
"""

from __future__ import annotations

import inspect
from typing import Any

from ..base import RewardFunc
from .reward import DEFAULT_CLIP, DEFAULT_DETECTOR, GenEvalReward
from .rules import (
    COLORS,
    Detection,
    evaluate,
    evaluate_reward,
    filter_detections,
    geneval_value,
    relative_position,
)

__all__ = [
    "COLORS",
    "DEFAULT_CLIP",
    "DEFAULT_DETECTOR",
    "Detection",
    "GenEvalReward",
    "evaluate",
    "evaluate_reward",
    "filter_detections",
    "geneval",
    "geneval_value",
    "relative_position",
]


def geneval(url: str | None = None, name: str = "geneval", **options: Any) -> RewardFunc:
    """GenEval: over HTTP when ``url`` is given (an HTTPReward logged as ``geneval``; the server reads ``metadata``),
    else in this process (:class:`GenEvalReward`)."""
    if url is not None:
        from ..http import HTTPReward

        return HTTPReward(url, name=name, **options)
    accepted = set(inspect.signature(GenEvalReward).parameters)
    unknown = sorted(set(options) - accepted)
    if unknown:
        raise TypeError(
            f"Reward {name!r} (in-process GenEval, no `url`) got unknown options {unknown}; it takes "
            f"{sorted(accepted)}. Options such as `timeout` or `image_format` are for a GenEval server: give its `url`."
        )
    return GenEvalReward(name=name, **options)
