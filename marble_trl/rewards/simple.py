"""Cheap pixel-statistics rewards: offline, differentiable-free, and learnable by tiny models.

They exist for smoke tests, the tiny CPU recipe and toy experiments, not as quality metrics.
"""

from __future__ import annotations

import torch


def brightness(prompts: list[str], images: torch.Tensor, **_: object) -> list[float]:
    """Mean pixel intensity in ``[0, 1]`` (higher is brighter)."""
    return images.float().mean(dim=(1, 2, 3)).tolist()


def darkness(prompts: list[str], images: torch.Tensor, **_: object) -> list[float]:
    """``1 -`` mean pixel intensity: the opposite objective of ``brightness`` (for conflict experiments)."""
    return (1.0 - images.float().mean(dim=(1, 2, 3))).tolist()


def saturation(prompts: list[str], images: torch.Tensor, **_: object) -> list[float]:
    """Mean HSV-style saturation ``(max - min) / max`` over pixels, in ``[0, 1]``."""
    x = images.float()
    mx = x.max(dim=1).values
    mn = x.min(dim=1).values
    return ((mx - mn) / mx.clamp(min=1e-6)).mean(dim=(1, 2)).tolist()


def contrast(prompts: list[str], images: torch.Tensor, **_: object) -> list[float]:
    """Standard deviation of the grey-level image (RMS contrast), in ``[0, 0.5]``."""
    grey = images.float().mean(dim=1)
    return grey.flatten(1).std(dim=1).tolist()
