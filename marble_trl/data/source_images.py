"""The source images of an editing dataset: the ``source_images`` column, read, checked and resized.

An editing row holds a ``prompt`` (the instruction) and, in ``source_images``, the image to edit: a file path
(relative paths are relative to the data file), a Hub ``Image`` column (``{"bytes", "path"}`` rows, or decoded PIL
images), raw encoded bytes, a PIL image, or a list of one such item. Every row's image header is read when the
trainer is built (:func:`check_source_images`: a clear error naming the row), so a broken file fails before the first
rollout. At a step, :class:`SourceImageLoader` decodes the rows' images, resizes them to the training resolution
(a square, with Lanczos: the editing pipelines' ``VaeImageProcessor.resize``) and keeps the uint8 pixels in an LRU
cache (a group repeats its source ``num_generations`` times, and epochs repeat it again).

The rewards receive the same pixels as ``source_images=`` (``[B, 3, H, W]`` in ``[0, 1]``, float32), beside
``images``: the reward contract of docs/rewards.md.
"""

from __future__ import annotations

import hashlib
import io
from collections import OrderedDict
from pathlib import Path
from typing import Any

import torch

SOURCE_IMAGES_COLUMN = "source_images"
EDIT_MASKS_COLUMN = "edit_masks"  # the preservation reward's masks (marble_trl.rewards.editing): paths resolved too
IMAGE_COLUMNS = (SOURCE_IMAGES_COLUMN, EDIT_MASKS_COLUMN)


def _one(value: Any, row: int | None, where: str) -> Any:
    """The single image of a row (a list of one is accepted; several are not supported by these families)."""
    if isinstance(value, (list, tuple)):
        if len(value) != 1:
            raise ValueError(
                f"{where}: row {row} holds {len(value)} source images; the supported editing families (FLUX.1 Kontext, "
                "Qwen-Image-Edit) edit one image per prompt: keep one per row."
            )
        value = value[0]
    return value


def _key(value: Any) -> str | None:
    """A cache key for an image value (its path, or a digest of its bytes); ``None`` for a decoded PIL image."""
    if isinstance(value, str):
        return "path:" + value
    if isinstance(value, dict):
        if value.get("bytes") is not None:
            return "bytes:" + hashlib.sha1(value["bytes"]).hexdigest()
        if value.get("path"):
            return "path:" + str(value["path"])
    if isinstance(value, (bytes, bytearray)):
        return "bytes:" + hashlib.sha1(value).hexdigest()
    return None


def open_image(value: Any):
    """A PIL image from one ``source_images`` value (not yet decoded: PIL reads the header only; a relative path is
    relative to the working folder: :func:`resolve_image_paths` made a data file's absolute)."""
    from PIL import Image

    if isinstance(value, Image.Image):
        return value
    if isinstance(value, dict):
        if value.get("bytes") is not None:
            return Image.open(io.BytesIO(value["bytes"]))
        value = value.get("path")
        if not value:
            raise ValueError("an image dict with neither 'bytes' nor 'path'")
    if isinstance(value, (bytes, bytearray)):
        return Image.open(io.BytesIO(value))
    if isinstance(value, (str, Path)):
        path = Path(value).expanduser()
        if not path.is_file():
            raise FileNotFoundError(f"no image file {str(path)!r}")
        return Image.open(path)
    raise TypeError(f"{type(value).__name__} is not an image (a path, bytes, a PIL image or a Hub Image column)")


def check_source_images(dataset, name: str = "train_dataset") -> None:
    """Open every row's source image header (cheap: no pixels are decoded): a missing column, a missing file, an
    unreadable image or several images in a row raise ``ValueError`` naming the row and the fix."""
    if SOURCE_IMAGES_COLUMN not in dataset.column_names:
        raise ValueError(
            f"{name} has no {SOURCE_IMAGES_COLUMN!r} column (columns: {dataset.column_names}), but the model edits "
            f"images: give each row its source image in {SOURCE_IMAGES_COLUMN!r} (a path, bytes, a PIL image or a Hub "
            "Image column; docs/models.md#editing-models)."
        )
    column = _undecoded(dataset)[SOURCE_IMAGES_COLUMN]
    for row, value in enumerate(column):
        try:
            one = _one(value, row, name)
            image = open_image(one)
            image.size  # noqa: B018 - the header is read by open
            if image is not one:  # a file PIL opened here: closed now, not when the garbage collector gets to it
                image.close()
        except ValueError as err:
            if "source images;" in str(err):
                raise
            raise ValueError(f"{name}: row {row}'s {SOURCE_IMAGES_COLUMN!r} is not a readable image: {err}.") from None
        except Exception as err:  # PIL raises UnidentifiedImageError, OSError, ... for a corrupt file
            raise ValueError(
                f"{name}: row {row}'s {SOURCE_IMAGES_COLUMN!r} is not a readable image ({type(err).__name__}: {err}). "
                "Fix or drop that row (paths are relative to the data file)."
            ) from None


def _undecoded(dataset):
    """``dataset`` with a Hub ``Image`` column left as ``{"bytes", "path"}`` (decoding every row would be slow)."""
    try:
        from datasets import Image as ImageFeature
    except ImportError:  # pragma: no cover - datasets is a dependency
        return dataset
    feature = getattr(dataset, "features", {}).get(SOURCE_IMAGES_COLUMN)
    if isinstance(feature, ImageFeature) and feature.decode:
        return dataset.cast_column(SOURCE_IMAGES_COLUMN, ImageFeature(decode=False))
    return dataset


def resolve_image_paths(dataset, base_dir: str | Path):
    """A data file's relative image paths (``source_images``, ``edit_masks``) made relative to the file's folder
    (absolute ones unchanged)."""

    def absolute(value):
        if isinstance(value, str) and value and not Path(value).expanduser().is_absolute():
            return str(Path(base_dir) / value)
        if isinstance(value, list):
            return [absolute(v) for v in value]
        return value

    for name in IMAGE_COLUMNS:
        if name in dataset.column_names and any(isinstance(v, (str, list)) for v in dataset[name]):
            dataset = dataset.map(lambda row, name=name: {name: absolute(row[name])})
    return dataset


def source_image_keys(dataset) -> list[str | None]:
    """Each row's source image identity (its path, or a digest of its bytes; ``None`` for a decoded image)."""
    return [_key(_one(v, row, "source_images")) for row, v in enumerate(_undecoded(dataset)[SOURCE_IMAGES_COLUMN])]


def to_pixels(image, resolution: int) -> torch.Tensor:
    """A PIL image as uint8 ``[3, resolution, resolution]``: RGB, resized with Lanczos (the pipelines' resize)."""
    import numpy as np
    from PIL import Image, ImageOps

    image = ImageOps.exif_transpose(image).convert("RGB")  # as diffusers' load_image: a phone photo's orientation
    if image.size != (resolution, resolution):
        image = image.resize((resolution, resolution), resample=Image.LANCZOS)
    return torch.from_numpy(np.asarray(image, dtype=np.uint8).copy()).permute(2, 0, 1)


class SourceImageLoader:
    """Rows' ``source_images`` values -> ``[B, 3, R, R]`` float32 in ``[0, 1]``, with an LRU cache of uint8 pixels
    bounded in bytes (``cache_bytes``, 1 GiB: about 340 sources at 1024 x 1024); decoded PIL images (a Hub ``Image``
    column read by ``datasets``) are resized each time, their decoding is ``datasets``'."""

    def __init__(self, resolution: int, cache_bytes: int = 1 << 30) -> None:
        self.resolution = resolution
        self.cache_bytes = cache_bytes
        self._cache: OrderedDict[str, torch.Tensor] = OrderedDict()
        self._bytes = 0

    def reset(self) -> None:
        self._cache.clear()
        self._bytes = 0

    def pixels(self, value: Any, row: int | None = None) -> torch.Tensor:
        """One value's uint8 pixels; ``row``: its position in the batch (named in errors)."""
        value = _one(value, row, "source_images (batch position)")
        if isinstance(value, torch.Tensor):  # already pixels (a caller's tensor): [3, H, W] in [0, 1]
            return _tensor_pixels(value, self.resolution)
        key = _key(value)
        if key is not None and key in self._cache:
            self._cache.move_to_end(key)
            return self._cache[key]
        try:
            image = open_image(value)
            pixels = to_pixels(image, self.resolution)
            if image is not value:
                image.close()
        except Exception as err:
            where = f"batch position {row}: " if row is not None else ""
            raise ValueError(
                f"{where}{SOURCE_IMAGES_COLUMN!r} could not be read: {type(err).__name__}: {err}"
            ) from err
        if key is not None and pixels.numel() <= self.cache_bytes:
            self._cache[key] = pixels
            self._bytes += pixels.numel()
            while self._bytes > self.cache_bytes:
                self._bytes -= self._cache.popitem(last=False)[1].numel()
        return pixels

    def __call__(self, values: Any) -> torch.Tensor:
        """``[B, 3, R, R]`` for a list of values (or one value: a path, bytes, a PIL image, a ``[3, H, W]`` tensor,
        or a ``[B, 3, H, W]`` tensor)."""
        from PIL import Image

        single = (str, Path, bytes, bytearray, dict, Image.Image)
        if isinstance(values, single) or (isinstance(values, torch.Tensor) and values.ndim == 3):
            values = [values]
        else:  # a list, a datasets column, a [B, 3, H, W] tensor
            values = list(values)
        return torch.stack([self.pixels(v, i) for i, v in enumerate(values)]).float() / 255.0


def _tensor_pixels(value: torch.Tensor, resolution: int) -> torch.Tensor:
    if value.ndim != 3 or value.shape[0] != 3:
        raise ValueError(f"a source image tensor must be [3, H, W] in [0, 1], got shape {tuple(value.shape)}")
    value = value.detach().float().cpu()
    if value.shape[1:] != (resolution, resolution):
        value = torch.nn.functional.interpolate(value[None], size=(resolution, resolution), mode="bilinear")[0]
    return (value.clamp(0, 1) * 255).round().to(torch.uint8)


def blank_sources(count: int, resolution: int) -> torch.Tensor:
    """Mid-grey source images: what internal probes (a dtype probe, a memory measurement) edit."""
    return torch.full((count, 3, resolution, resolution), 0.5)
