"""JPEG (in)compressibility rewards (DDPO / flow_grpo): size of a quality-95 JPEG in kB."""

from __future__ import annotations

import io

import torch

from .images import to_pil


def jpeg_kb(images: torch.Tensor, quality: int = 95) -> list[float]:
    """Size in kB of each image saved as a JPEG at ``quality``."""
    sizes = []
    for im in to_pil(images):
        buf = io.BytesIO()
        im.save(buf, format="JPEG", quality=quality)
        sizes.append(buf.tell() / 1000.0)
    return sizes


def jpeg_compressibility(prompts: list[str], images: torch.Tensor, **_: object) -> list[float]:
    """Negative JPEG size in kB (quality 95): higher means simpler, more compressible images."""
    return [-s for s in jpeg_kb(images)]


def jpeg_incompressibility(prompts: list[str], images: torch.Tensor, **_: object) -> list[float]:
    """JPEG size in kB (quality 95): higher means more detailed images."""
    return jpeg_kb(images)
