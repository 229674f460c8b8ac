"""Deterministic evaluation images, shared by the trainer's ``evaluate`` (during training) and ``marble-trl evaluate``
(base model, LoRAs, checkpoints): :func:`generate_eval_images`, and the captioned grids of what it drew.

Image ``i`` of prompt ``p`` starts from noise drawn with its own generator, seeded from ``(seed, p, i)``
(:func:`sample_seed`), so an image does not depend on the batch it is in, on the number of processes, nor on any
training randomness; the default sampler is the reference's 40-step Euler, CFG-free.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch

from ..seeding import derived_seed


def sample_seed(seed: int, prompt_index: int, image_index: int) -> int:
    """The noise seed of image ``image_index`` of prompt ``prompt_index`` (integers hash identically everywhere)."""
    return derived_seed(seed, prompt_index, image_index)


@torch.no_grad()
def generate_eval_images(
    pipeline,
    scheduler,
    prompts: list[str],
    seeds: Sequence[int],
    *,
    num_steps: int,
    resolution: int,
    guidance_scale: float = 1.0,
    negative_prompt: str = "",
    max_sequence_length: int = 256,
    device: torch.device | str | None = None,
    source_images: torch.Tensor | None = None,
) -> torch.Tensor:
    """Images ``[B, 3, H, W]`` (videos ``[B, F, 3, H, W]``) in ``[0, 1]`` for ``prompts``, image ``j`` from noise
    seeded with ``seeds[j]``; ``pipeline`` is a diffusers pipeline of a supported family or its adapter; an editing
    family edits ``source_images`` (``[B, 3, R, R]`` in ``[0, 1]``, one per prompt)."""
    from ..models import adapter_for
    from ..models.editing import source_kwargs

    adapter = pipeline if hasattr(pipeline, "predict") else adapter_for(pipeline)
    device = torch.device(device) if device is not None else adapter.transformer.device
    sources = source_kwargs(adapter, source_images)
    embeds = adapter.encode(prompts, max_sequence_length, device, guidance_scale, **sources)
    negative = None
    if adapter.needs_negative(guidance_scale):
        negative = adapter.encode([negative_prompt] * len(prompts), max_sequence_length, device, **sources)
    generators = [torch.Generator().manual_seed(int(s)) for s in seeds]
    latents = adapter.sample(scheduler, embeds, num_steps, resolution, generators, guidance_scale, negative)
    return adapter.decode(latents)


def grid_image(
    images: torch.Tensor,
    columns: int,
    resolution: int,
    *,
    prompts: Sequence[str] | None = None,
    scores: Sequence[dict[str, float | None] | None] | None = None,
):
    """A PIL grid of ``images``, each captioned with its prompt and its scores (``{reward: value}``) when given;
    small images are scaled up (nearest neighbour) to about 128 px so the images and the text are readable."""
    from .samples import captioned_grid

    scale = max(1, 128 // max(1, resolution))
    return captioned_grid(images, max(1, columns), captions=prompts, scores=scores, scale=scale)


def save_file_grid(
    files: Sequence[Path],
    columns: int,
    path: Path,
    *,
    prompts: Sequence[str] | None = None,
    scores: Sequence[dict[str, float | None] | None] | None = None,
) -> Path:
    """Tile image files (same size) into a grid PNG, each captioned with its prompt and scores when given; small
    images scaled up to about 128 px."""
    from PIL import Image

    from .samples import captioned_grid

    grid = captioned_grid([Image.open(f) for f in files], columns, captions=prompts, scores=scores)
    grid.save(path)
    return path
