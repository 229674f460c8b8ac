"""Editing rewards: they score an edit against its source image (``source_images=``, ``[B, 3, H, W]`` in ``[0, 1]``,
at the edits' size; the trainer passes it for an editing model, docs/rewards.md#editing-rewards).

- :class:`CLIPDirectional` (``clip_directional``): instruction following as CLIP directional similarity, the cosine
  between the image change ``E(edit) - E(source)`` and the text change: ``E(target caption) - E(source caption)``
  when the rows have ``source_captions`` / ``target_captions`` columns (InstructPix2Pix's metric), else the
  instruction's own embedding.
- :func:`preservation` (``preservation``): preservation of the unedited content, a structural similarity (SSIM on
  luma, 7 x 7 Gaussian windows) to the source, restricted to the pixels outside the edit when the rows carry an
  ``edit_masks`` column (1 where the edit may change the image: a path, bytes, a PIL image or an ``[H, W]`` array).
- VLM graders: ``http_reward`` sends the source images beside the edits to a judge server
  (:mod:`marble_trl.rewards.http`), so any VLM (EditScore, a Qwen2.5-VL judge, ...) grades the edit.

Text-to-image rewards (``clipscore``, ``aesthetic``, ...) score an edit like any image: they ignore the source.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from .clip_family import _CLIPReward, pooled_features


def _check_sources(name: str, images: torch.Tensor, source_images: Any) -> torch.Tensor:
    if source_images is None:
        raise ValueError(
            f"Reward {name!r} scores edits against their source images, but got no source_images: train an editing "
            "model (its rows' 'source_images' reach the rewards) or drop this reward."
        )
    if not isinstance(source_images, torch.Tensor) or tuple(source_images.shape) != tuple(images.shape):
        shape = tuple(source_images.shape) if isinstance(source_images, torch.Tensor) else type(source_images).__name__
        raise ValueError(
            f"Reward {name!r}: source_images must be a tensor shaped like the images {tuple(images.shape)}, got {shape}."
        )
    return source_images


class CLIPDirectional(_CLIPReward):
    """CLIP directional similarity of an edit to its instruction (``clip_directional``), in ``[-1, 1]``."""

    reward_name = "clip_directional"
    default_model = "openai/clip-vit-large-patch14"

    def __call__(  # type: ignore[override]
        self,
        prompts: list[str],
        images: torch.Tensor,
        source_images: torch.Tensor | None = None,
        source_captions: list[str] | None = None,
        target_captions: list[str] | None = None,
        **_: object,
    ) -> list[float]:
        self.check_images(prompts, images)
        sources = _check_sources(self.reward_name, images, source_images)
        if (source_captions is None) != (target_captions is None):
            raise ValueError(
                f"Reward {self.reward_name!r}: give both source_captions and target_captions columns, or neither "
                "(then the instruction's embedding is the text direction)."
            )

        def score(part: slice) -> torch.Tensor:
            change = F.normalize(self._image(images[part]) - self._image(sources[part]), dim=-1)
            if target_captions is not None:
                text = self._text(list(target_captions[part])) - self._text(list(source_captions[part]))
            else:
                text = self._text(list(prompts[part]))
            return (change * F.normalize(text, dim=-1)).sum(-1)

        return self.batched(len(prompts), score)

    def _image(self, pixels: torch.Tensor) -> torch.Tensor:
        pixel_values = self.transform(pixels.to(self.device, torch.float32)).to(self.dtype)
        return F.normalize(pooled_features(self.model.get_image_features(pixel_values=pixel_values)).float(), dim=-1)

    def _text(self, texts: list[str]) -> torch.Tensor:
        tokens = self.tokenizer(texts, padding=True, truncation=True, max_length=self.max_length, return_tensors="pt")
        return F.normalize(pooled_features(self.model.get_text_features(**tokens.to(self.device))).float(), dim=-1)


def _gaussian_window(size: int = 7, sigma: float = 1.5) -> torch.Tensor:
    x = torch.arange(size, dtype=torch.float32) - (size - 1) / 2
    g = torch.exp(-(x**2) / (2 * sigma**2))
    g = g / g.sum()
    return (g[:, None] * g[None, :])[None, None]


def ssim_map(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Per-pixel SSIM (Wang et al. 2004: constants ``(0.01 L)^2``, ``(0.03 L)^2`` with ``L = 1``) of the luma of
    ``a`` and ``b`` (``[B, 3, H, W]`` in ``[0, 1]``), ``[B, H, W]`` (the windows reflect at the borders)."""
    luma = torch.tensor([0.299, 0.587, 0.114]).view(1, 3, 1, 1)
    x = (a.float().cpu() * luma).sum(1, keepdim=True)
    y = (b.float().cpu() * luma).sum(1, keepdim=True)
    w = _gaussian_window()
    pad = w.shape[-1] // 2

    def blur(t: torch.Tensor) -> torch.Tensor:
        return F.conv2d(F.pad(t, (pad, pad, pad, pad), mode="reflect"), w)

    mx, my = blur(x), blur(y)
    vx, vy, cov = blur(x * x) - mx**2, blur(y * y) - my**2, blur(x * y) - mx * my
    c1, c2 = 0.01**2, 0.03**2
    return (((2 * mx * my + c1) * (2 * cov + c2)) / ((mx**2 + my**2 + c1) * (vx + vy + c2)))[:, 0]


def _mask(value: Any, hw: tuple[int, int]) -> torch.Tensor:
    """An ``edit_masks`` value as ``[H, W]`` booleans (True: the edit may change the pixel)."""
    import numpy as np

    from ..data.source_images import open_image

    if value is None:
        return torch.zeros(hw, dtype=torch.bool)
    if isinstance(value, torch.Tensor):
        mask = value.float()
    elif isinstance(value, np.ndarray) or (isinstance(value, list) and value and isinstance(value[0], list)):
        mask = torch.as_tensor(np.asarray(value, dtype=np.float32))
    else:
        mask = torch.from_numpy(np.asarray(open_image(value).convert("L"), dtype=np.float32) / 255.0)
    if mask.ndim != 2:
        raise ValueError(f"an edit mask must be [H, W], got shape {tuple(mask.shape)}")
    if tuple(mask.shape) != hw:
        mask = F.interpolate(mask[None, None], size=hw, mode="nearest")[0, 0]
    return mask > 0.5


def preservation(
    prompts: list[str], images: torch.Tensor, source_images: torch.Tensor | None = None, edit_masks=None, **_: Any
) -> list[float]:
    """Preservation of the unedited content (``preservation``): the mean SSIM of the edit to its source over the
    pixels outside the row's edit mask (the whole image without ``edit_masks``), in ``[-1, 1]`` (1: unchanged)."""
    sources = _check_sources("preservation", images, source_images)
    ssim = ssim_map(images, sources)
    out = []
    for i in range(len(prompts)):
        keep = ~_mask(edit_masks[i] if edit_masks is not None else None, tuple(ssim.shape[1:]))
        out.append(float(ssim[i][keep].mean()) if keep.any() else 1.0)
    return out
