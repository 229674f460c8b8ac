"""Image grids: the before/after sample sheet of a run."""

from __future__ import annotations

from pathlib import Path

import torch
from PIL import Image, ImageDraw

from .rewards.images import to_pil


def image_grid(images: torch.Tensor, columns: int) -> Image.Image:
    """Tile ``[N, 3, H, W]`` images in ``[0, 1]`` into a grid with ``columns`` columns."""
    pils = to_pil(images)
    w, h = pils[0].size
    rows = (len(pils) + columns - 1) // columns
    grid = Image.new("RGB", (columns * w, rows * h), "white")
    for i, im in enumerate(pils):
        grid.paste(im, ((i % columns) * w, (i // columns) * h))
    return grid


def save_before_after(
    before: torch.Tensor, after: torch.Tensor, columns: int, path: str | Path, scale: int = 1
) -> Path:
    """Save a labelled sheet: the ``before`` grid above the ``after`` grid (same prompts and seeds)."""
    top, bottom = image_grid(before, columns), image_grid(after, columns)
    if scale > 1:
        top = top.resize((top.width * scale, top.height * scale), Image.NEAREST)
        bottom = bottom.resize((bottom.width * scale, bottom.height * scale), Image.NEAREST)
    label = 14
    sheet = Image.new("RGB", (top.width, top.height + bottom.height + 2 * label), "white")
    draw = ImageDraw.Draw(sheet)
    draw.text((2, 1), "before", fill="black")
    sheet.paste(top, (0, label))
    draw.text((2, top.height + label + 1), "after", fill="black")
    sheet.paste(bottom, (0, top.height + 2 * label))
    path = Path(path)
    sheet.save(path)
    return path
