"""The request protocol of ``marble-trl serve-reward``: what a request may cost and how its body is read.

:class:`ServeLimits` (the ``--max_*`` and ``--client_timeout`` options), :class:`RequestError` (a refusal: an HTTP
status and a message for the client), :func:`parse_request` (a JSON body -> prompts, images and metadata columns, each
checked) and :func:`decode_images` (base64 PNG/JPEG files -> a ``[B, 3, H, W]`` float tensor, sizes checked from the
files' headers before any pixel is decoded). JSON only (nothing is unpickled) and Pillow restricted to PNG and JPEG.
The server and its handler are :mod:`marble_trl.rewards.serve`.
"""

from __future__ import annotations

import base64
import binascii
import io
import json
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from PIL import Image, UnidentifiedImageError

from .base import RESERVED_NAMES

FORMATS = ("PNG", "JPEG")


@dataclass(frozen=True)
class ServeLimits:
    """What one request may cost the server (the ``--max_*`` and ``--client_timeout`` options)."""

    max_request_bytes: int = 256 * 2**20
    max_images: int = 256
    max_image_pixels: int = 4096 * 4096
    max_total_pixels: int = 2**27  # 128 Mpx: 1.5 GiB as the reward's float32 tensor
    client_timeout: float = 60.0
    max_concurrent_requests: int = 16  # bodies being read, waiting for the reward or scored (memory)
    max_connections: int = 256  # open connections, each a thread (idle ones end at client_timeout)


class RequestError(Exception):
    """A request the server refuses: an HTTP status and a message for the client."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


def decode_images(encoded: list[Any], limits: ServeLimits) -> torch.Tensor:
    """base64 PNG/JPEG files -> ``[B, 3, H, W]`` float32 in ``[0, 1]`` (uint8 / 255), sizes checked before decoding."""
    opened, size, total = [], None, 0
    for i, text in enumerate(encoded):
        if not isinstance(text, str):
            raise RequestError(400, f"images[{i}] is a {type(text).__name__}; images must be base64 strings.")
        try:
            raw = base64.b64decode(text, validate=True)
        except (binascii.Error, ValueError) as err:
            raise RequestError(
                400, f"images[{i}] is not valid base64 ({err}); send the file's bytes, without a 'data:' prefix."
            ) from err
        try:
            image = Image.open(io.BytesIO(raw), formats=FORMATS)  # reads the header only
        except Image.DecompressionBombError as err:
            raise RequestError(413, f"images[{i}]: {err}") from err
        except (UnidentifiedImageError, OSError, ValueError, SyntaxError) as err:
            raise RequestError(400, f"images[{i}] is not a PNG or JPEG file ({err}).") from err
        w, h = image.size
        if w * h > limits.max_image_pixels:
            raise RequestError(
                413, f"images[{i}] is {w}x{h} = {w * h} pixels, over max_image_pixels = {limits.max_image_pixels}."
            )
        if size is not None and image.size != size:
            raise RequestError(
                400,
                f"images[{i}] is {w}x{h} but images[0] is {size[0]}x{size[1]}: one request holds images of one size "
                "(the reward takes one [B, 3, H, W] tensor); send each size in its own request.",
            )
        size, total = image.size, total + w * h
        if total > limits.max_total_pixels:
            raise RequestError(
                413,
                f"the images hold over max_total_pixels = {limits.max_total_pixels} pixels; send fewer per request.",
            )
        opened.append(image)
    arrays = []
    for i, image in enumerate(opened):
        try:
            arrays.append(np.asarray(image.convert("RGB")))
        except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as err:
            raise RequestError(400, f"images[{i}] could not be decoded ({err}).") from err
    return torch.from_numpy(np.stack(arrays)).permute(0, 3, 1, 2).contiguous().float().div_(255.0)


def parse_request(body: bytes, limits: ServeLimits) -> tuple[list[str], torch.Tensor | None, dict[str, list]]:
    """A request body -> ``(prompts, images, metadata)``; :class:`RequestError` naming what is wrong otherwise."""
    try:
        payload = json.loads(body)
    except (ValueError, RecursionError) as err:  # UnicodeDecodeError is a ValueError; RecursionError: nesting bomb
        raise RequestError(400, f"the body is not JSON ({type(err).__name__}: {str(err)[:200]}).") from err
    if not isinstance(payload, dict):
        raise RequestError(
            400, f'the body must be a JSON object {{"prompts", "images", "metadata"}}, got a {type(payload).__name__}.'
        )
    missing = [key for key in ("prompts", "images") if key not in payload]
    if missing:
        raise RequestError(400, f"the body has no {' and no '.join(repr(k) for k in missing)}.")
    prompts, images, metadata = payload["prompts"], payload["images"], payload.get("metadata") or {}
    if not isinstance(prompts, list) or not all(isinstance(p, str) for p in prompts):
        raise RequestError(400, "'prompts' must be a list of strings.")
    if not isinstance(images, list):
        raise RequestError(400, "'images' must be a list of base64 strings.")
    if len(images) > limits.max_images:
        raise RequestError(
            413, f"{len(images)} images, over max_images = {limits.max_images}; send fewer per request."
        )
    if len(images) != len(prompts):
        raise RequestError(400, f"{len(images)} images for {len(prompts)} prompts; send one image per prompt.")
    if not isinstance(metadata, dict):
        raise RequestError(400, f"'metadata' must be an object of columns, got a {type(metadata).__name__}.")
    for key, values in metadata.items():
        if not isinstance(values, list):
            raise RequestError(400, f"metadata column {key!r} must be a list (one value per sample).")
        if len(values) != len(prompts):
            raise RequestError(400, f"metadata column {key!r} has {len(values)} values for {len(prompts)} prompts.")
    clash = sorted(set(metadata) & {"prompt", "source_images", *RESERVED_NAMES})
    if clash:
        raise RequestError(400, f"metadata columns may not be named {clash}: the server passes those itself.")
    sources = payload.get("source_images")
    if sources is not None:  # an editing model's source images: the reward gets them as `source_images=`
        if not isinstance(sources, list) or len(sources) != len(prompts):
            raise RequestError(400, "'source_images' must be a list of base64 strings, one per prompt.")
        metadata = {**metadata, "source_images": decode_images(sources, limits) if sources else None}
    return prompts, decode_images(images, limits) if images else None, metadata
