"""The image format rewards receive, and cheap conversions to the others.

Rewards get ``images`` as a float tensor ``[B, 3, H, W]`` with values in ``[0, 1]`` (diffusers' ``output_type="pt"``),
on the device the pipeline decoded on. Rewards that need PIL images or uint8 arrays convert with the helpers here.
"""

from __future__ import annotations

import numpy as np
import torch
from PIL import Image


def to_uint8_numpy(images: torch.Tensor) -> np.ndarray:
    """``[B, 3, H, W]`` floats in ``[0, 1]`` -> ``[B, H, W, 3]`` uint8 (rounded, clipped)."""
    arr = (images.detach().float().clamp(0, 1) * 255.0).round().to(torch.uint8)
    return arr.permute(0, 2, 3, 1).cpu().numpy()


def to_pil(images: torch.Tensor) -> list[Image.Image]:
    """``[B, 3, H, W]`` floats in ``[0, 1]`` -> a list of RGB PIL images."""
    return [Image.fromarray(a) for a in to_uint8_numpy(images)]


def from_pil(images: list[Image.Image]) -> torch.Tensor:
    """A list of PIL images -> ``[B, 3, H, W]`` float tensor in ``[0, 1]`` (the reward input format)."""
    arrays = [np.asarray(im.convert("RGB"), dtype=np.float32) / 255.0 for im in images]
    return torch.from_numpy(np.stack(arrays)).permute(0, 3, 1, 2).contiguous()
