"""GenEval's colour check: zero-shot CLIP ViT-L/14 over 10 colours, on each object's masked crop.

As GenEval (``color_classification`` with clip-benchmark's zero-shot classifier), on transformers' ``CLIPModel``
(``openai/clip-vit-large-patch14`` holds the same weights as OpenCLIP's ``ViT-L-14`` / ``openai``):

- text: per object class, the templates ``"a photo of a {color} {object}"``, ``"a photo of a {color}-colored
  {object}"`` and ``"a photo of a {color} object"``; each embedding normalised, averaged over the templates and
  normalised again; one classifier per class, built once and cached;
- image: the object's pixels composited over flat grey #999 by its mask, cropped to its box (PIL's crop), then
  OpenCLIP's evaluation transform on the PIL image (shortest side to the model's size, bicubic; centre crop;
  OpenAI's mean and std);
- colour: argmax of ``100 * normalised image embedding @ classifier`` (the first maximum on ties).

Not in the reference: an empty crop (a box of zero width or height; the reference's transform fails on it) is given
the colour :data:`NO_COLOUR`, which matches no requirement. A detector mask is never empty above GenEval's thresholds
(its score would be 0), so this only concerns hand-made detections.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image
from torch import nn

from ..clip_family import OPENAI_CLIP_MEAN, OPENAI_CLIP_STD, pooled_features
from .rules import COLORS, Detection

TEMPLATES = ("a photo of a {color} {object}", "a photo of a {color}-colored {object}", "a photo of a {color} object")
BACKGROUND = (153, 153, 153)  # "#999"
NO_COLOUR = "none"


def object_crop(image: np.ndarray, box: Sequence[float], mask: Any = None) -> Image.Image | None:
    """The object's pixels over grey #999 (where ``mask`` is true; the whole image without a mask), cropped to
    ``box`` with PIL's rounding. ``image`` is ``[H, W, 3]`` uint8; ``None`` for an empty crop."""
    if mask is not None:
        mask = mask.detach().cpu().numpy() if isinstance(mask, torch.Tensor) else np.asarray(mask)
        if mask.shape != image.shape[:2]:
            raise ValueError(f"A mask of shape {mask.shape} for an image of {image.shape[:2]}.")
        image = np.where(mask.astype(bool)[..., None], image, np.array(BACKGROUND, dtype=np.uint8))
    x1, y1, x2, y2 = (int(round(float(v))) for v in list(box)[:4])  # PIL's crop rounds the same way
    if x2 <= x1 or y2 <= y1:
        return None
    return Image.fromarray(np.ascontiguousarray(image)).crop((x1, y1, x2, y2))


def clip_pixels(crop: Image.Image, size: int) -> torch.Tensor:
    """OpenCLIP's evaluation transform on a PIL image -> ``[3, size, size]`` float32 (torchvision's ``Resize(size,
    BICUBIC)``, ``CenterCrop(size)``, ``ToTensor``, ``Normalize``, written out on PIL)."""
    width, height = crop.size
    short, long = min(width, height), max(width, height)
    if short != size:  # torchvision leaves an image already at the size as it is
        new_long = int(size * long / short)
        crop = crop.resize((size, new_long) if width <= height else (new_long, size), Image.BICUBIC)
    width, height = crop.size
    top, left = int(round((height - size) / 2.0)), int(round((width - size) / 2.0))
    crop = crop.crop((left, top, left + size, top + size)).convert("RGB")
    x = torch.from_numpy(np.asarray(crop, dtype=np.float32) / 255.0).permute(2, 0, 1)
    mean = torch.tensor(OPENAI_CLIP_MEAN).view(3, 1, 1)
    std = torch.tensor(OPENAI_CLIP_STD).view(3, 1, 1)
    return (x - mean) / std


class ColourClassifier:
    """Zero-shot colour of detected objects with a ``CLIPModel`` and its tokenizer (see the module docstring)."""

    def __init__(self, model: nn.Module, tokenizer: Any) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.size = int(model.config.vision_config.image_size)
        self.max_length = int(model.config.text_config.max_position_embeddings)
        self._classifiers: dict[str, torch.Tensor] = {}  # class name -> [10, D] float32, on the CPU

    def _device_dtype(self) -> tuple[torch.device, torch.dtype]:
        param = next(self.model.parameters())
        return param.device, param.dtype

    def classifier(self, classname: str) -> torch.Tensor:
        """The ``[10, D]`` unit-norm text embeddings of the colours for one object class (cached)."""
        if classname not in self._classifiers:
            texts = [t.format(color=c, object=classname) for c in COLORS for t in TEMPLATES]
            device, _ = self._device_dtype()
            tokens = self.tokenizer(
                texts, padding=True, truncation=True, max_length=self.max_length, return_tensors="pt"
            ).to(device)
            emb = F.normalize(pooled_features(self.model.get_text_features(**tokens)).float(), dim=-1)
            emb = emb.view(len(COLORS), len(TEMPLATES), -1).mean(dim=1)
            self._classifiers[classname] = F.normalize(emb, dim=-1).cpu()
        return self._classifiers[classname]

    def logits(self, crops: Sequence[Image.Image], classname: str) -> torch.Tensor:
        """``[N, 10]`` float32 colour logits of non-empty crops."""
        device, dtype = self._device_dtype()
        pixels = torch.stack([clip_pixels(c, self.size) for c in crops]).to(device, dtype)
        image = F.normalize(pooled_features(self.model.get_image_features(pixel_values=pixels)).float(), dim=-1)
        return 100.0 * image @ self.classifier(classname).to(device).T

    def __call__(self, image: np.ndarray, objects: Sequence[Detection], classname: str) -> list[str]:
        """The colour of each object (``[H, W, 3]`` uint8 image); :data:`NO_COLOUR` for an empty crop."""
        crops = [object_crop(image, obj[0], obj[2]) for obj in objects]
        colours = [NO_COLOUR] * len(crops)
        kept = [i for i, c in enumerate(crops) if c is not None]
        if kept:
            best = self.logits([crops[i] for i in kept], classname).argmax(dim=1).tolist()
            for i, b in zip(kept, best):
                colours[i] = COLORS[b]
        return colours
