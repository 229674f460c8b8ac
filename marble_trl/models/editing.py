"""What the editing families (:mod:`.flux_kontext`, :mod:`.qwen_image_edit`) share with the rest of the package:
each distinct source image encoded once, and the ``source_images=`` argument that only editing adapters take."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, ClassVar

import torch

from .base import unique_index


class EditingAdapter:
    """The part of an editing family's adapter that is about its source images (mixed in before the family's text-to-
    image adapter): they are square, ``source_resolution`` pixels a side, one per prompt."""

    editing: ClassVar[bool] = True
    # the pipeline's own conditioning size for a square source (it conditions on about 1024 x 1024 whatever the output
    # size); an offline tiny pipeline sets a smaller `source_resolution` attribute
    pipeline_source_resolution: ClassVar[int] = 1024
    # whether a prompt's conditioning depends on its image (Qwen-Image-Edit's VL encoder sees it): no prompt cache
    prompt_sees_image: ClassVar[bool] = False

    @classmethod
    def edit_call_kwargs(cls, resolution: int) -> dict[str, Any]:
        """The family pipeline's ``__call__`` arguments that make it edit as the adapter samples (model cards)."""
        return {}

    @property
    def source_resolution(self) -> int:
        """The side of the square source images the model is conditioned on (the data loader resizes to it)."""
        return int(getattr(self.pipeline, "source_resolution", self.pipeline_source_resolution))

    def check_sources(self, prompts: list[str], source_images: torch.Tensor | None) -> torch.Tensor:
        """``source_images`` as ``[B, 3, S, S]`` (resized to :attr:`source_resolution` if given at another size), or a
        clear error when they are missing or do not match the prompts."""
        name = type(self.pipeline).__name__
        if source_images is None:
            raise ValueError(
                f"{name} edits images: every prompt needs its source image (source_images=, or a 'source_images' "
                "dataset column; docs/models.md#editing-models)."
            )
        if source_images.ndim != 4 or source_images.shape[1] != 3 or len(source_images) != len(prompts):
            raise ValueError(
                f"{name}: source_images must be [B, 3, H, W] in [0, 1] with one image per prompt; got shape "
                f"{tuple(source_images.shape)} for {len(prompts)} prompts."
            )
        return at_resolution(source_images, self.source_resolution)


def at_resolution(images: torch.Tensor, side: int) -> torch.Tensor:
    """``images`` (``[B, 3, H, W]`` in ``[0, 1]``) at ``side x side`` (bicubic, antialiased), unchanged if they are."""
    if tuple(images.shape[-2:]) == (side, side):
        return images
    resized = torch.nn.functional.interpolate(images.float(), size=(side, side), mode="bicubic", antialias=True)
    return resized.clamp(0, 1)


def repeat_sources(pixels: torch.Tensor, count: int) -> torch.Tensor:
    """One source image for every prompt, or one per prompt (a clear error otherwise)."""
    if len(pixels) == 1:
        return pixels.expand(count, -1, -1, -1)
    if len(pixels) != count:
        raise ValueError(f"{len(pixels)} source images for {count} prompts: give one, or one per prompt.")
    return pixels


def beside(sources: torch.Tensor, images: torch.Tensor) -> torch.Tensor:
    """The source images as the rewards receive them: at the edits' size, on the edits' device."""
    return at_resolution(sources, images.shape[-1]).to(images.device)


def unique_images(images: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
    """The distinct images of ``images`` (``[B, ...]``) in first-seen order, and each image's row among them (a group
    repeats its source ``num_generations`` times: the VAE encodes it once)."""
    keys = [hashlib.sha1(img.detach().float().cpu().contiguous().numpy().tobytes()).hexdigest() for img in images]
    distinct, rows = unique_index(keys)
    return images[[keys.index(key) for key in distinct]], rows


def source_kwargs(adapter, source_images: torch.Tensor | None) -> dict[str, Any]:
    """``{"source_images": ...}`` for an editing adapter's :meth:`encode`, ``{}`` for a text-to-image one."""
    return {"source_images": source_images} if getattr(adapter, "editing", False) else {}


def probe_sources(adapter, count: int, resolution: int) -> dict[str, Any]:
    """Mid-grey source images for an internal probe of an editing adapter (a dtype or memory probe), ``{}`` otherwise."""
    from ..data.source_images import blank_sources

    return source_kwargs(adapter, blank_sources(count, resolution)) if getattr(adapter, "editing", False) else {}


@contextmanager
def small_sources(adapter, side: int) -> Iterator[None]:
    """Inside the block, an editing adapter conditions on ``side``-pixel sources (a probe whose answer does not depend
    on the source's size, e.g. which parameters a forward reaches: not a 1024 x 1024 VAE encode per process)."""
    if not getattr(adapter, "editing", False):
        yield
        return
    pipeline = adapter.pipeline
    had, before = hasattr(pipeline, "source_resolution"), getattr(pipeline, "source_resolution", None)
    pipeline.source_resolution = side
    try:
        yield
    finally:
        if had:
            pipeline.source_resolution = before
        else:
            del pipeline.source_resolution
