"""The ShapesBench rewards under their registered names (``reward_funcs: [shapes_color, ...]``: the rewards
registry's name table points here).

They read the ShapesBench world's metadata columns (``family``, ``shape``, ``color``, ``count``, ``position``), which
the ``shapes`` / ``shapes_eval`` prompt sources provide; see :mod:`marble_trl.shapesbench.scorers` and
``docs/shapesbench.md``. The learned judges load from the package's shipped weights on first use.
"""

from __future__ import annotations

from typing import Any

import torch

NAMES = ("alignment", "preference", "color", "count", "position", "fidelity", "judge", "retrieval", "diversity")
EDIT_NAMES = ("edit_instruction", "edit_preservation")  # the editing world's (marble_trl.shapesbench.edits)


def _make(name: str):
    def reward(prompts: list[str], images: torch.Tensor, **columns: Any) -> list[float | None]:
        from .scorers import REWARDS  # the judges' weights load with the scorers: only when a reward is used

        return REWARDS[name](prompts, images, **columns)

    reward.__name__ = reward.__qualname__ = f"shapes_{name}"
    reward.__doc__ = f"ShapesBench's ``{name}`` reward (marble_trl.shapesbench.scorers.{name})."
    return reward


shapes_alignment = _make("alignment")
shapes_preference = _make("preference")
shapes_color = _make("color")
shapes_count = _make("count")
shapes_position = _make("position")
shapes_fidelity = _make("fidelity")
shapes_judge = _make("judge")
shapes_retrieval = _make("retrieval")
shapes_diversity = _make("diversity")


def shapes_edit_instruction(prompts: list[str], images: torch.Tensor, **columns: Any) -> list[float | None]:
    """ShapesBench edits' instruction following (marble_trl.shapesbench.edits.instruction)."""
    from .edits import instruction

    return instruction(prompts, images, **columns)


def shapes_edit_preservation(prompts: list[str], images: torch.Tensor, **columns: Any) -> list[float | None]:
    """ShapesBench edits' preservation of the unedited quadrants (marble_trl.shapesbench.edits.preservation)."""
    from .edits import preservation

    return preservation(prompts, images, **columns)
