"""What the editing families (:mod:`.flux_kontext`, :mod:`.qwen_image_edit`) share with the rest of the package:
each distinct source image encoded once, and the ``source_images=`` argument that only editing adapters take."""

from __future__ import annotations

import hashlib
from typing import Any

import torch


def unique_images(images: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
    """The distinct images of ``images`` (``[B, ...]``) in first-seen order, and each image's row among them (a group
    repeats its source ``num_generations`` times: the VAE encodes it once)."""
    keys = [hashlib.sha1(img.detach().float().cpu().contiguous().numpy().tobytes()).hexdigest() for img in images]
    where: dict[str, int] = {}
    first: list[int] = []
    rows = []
    for i, key in enumerate(keys):
        if key not in where:
            where[key] = len(first)
            first.append(i)
        rows.append(where[key])
    return images[first], rows


def source_kwargs(adapter, source_images: torch.Tensor | None) -> dict[str, Any]:
    """``{"source_images": ...}`` for an editing adapter's :meth:`encode`, ``{}`` for a text-to-image one."""
    return {"source_images": source_images} if getattr(adapter, "editing", False) else {}


def probe_sources(adapter, count: int, resolution: int) -> dict[str, Any]:
    """Mid-grey source images for an internal probe of an editing adapter (a dtype or memory probe), ``{}`` otherwise."""
    from ..data.source_images import blank_sources

    return source_kwargs(adapter, blank_sources(count, resolution)) if getattr(adapter, "editing", False) else {}
