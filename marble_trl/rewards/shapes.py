"""The ShapesBench rewards under registered names, for configs and the CLI (``reward_funcs: [shapes_color, ...]``).

They read the ShapesBench world's metadata columns (``family``, ``shape``, ``color``, ``count``, ``position``), which
the ``shapes`` / ``shapes_eval`` prompt sources provide; see :mod:`marble_trl.shapesbench.scorers` and
``docs/shapesbench.md``. The learned judges load from the package's shipped weights.
"""

from __future__ import annotations

from typing import Any

import torch

from .registry import register_reward

NAMES = ("alignment", "preference", "color", "count", "position", "fidelity", "judge", "retrieval", "diversity")


def _make(name: str):
    def reward(prompts: list[str], images: torch.Tensor, **columns: Any) -> list[float | None]:
        from ..shapesbench.scorers import REWARDS

        return REWARDS[name](prompts, images, **columns)

    reward.__doc__ = f"ShapesBench's ``{name}`` reward (marble_trl.shapesbench.scorers.{name})."
    return register_reward(f"shapes_{name}")(reward)


for _name in NAMES:
    _make(_name)
