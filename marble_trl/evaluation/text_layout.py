"""The text of the image sheets (:mod:`marble_trl.evaluation.samples`): the caption font, word wrapping and
truncation to a width in pixels, and the score lines under an image (``name value`` items, names shortened, packed into
lines).

Text is drawn with Pillow's built-in default font (no font file, no download); where that font is the bitmap one,
text is kept to Latin-1 and ``...`` stands for the ellipsis.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from functools import cache
from typing import Any

from PIL import ImageDraw, ImageFont

FONT_SIZE = 11

Scores = Mapping[str, float | None]


@cache
def caption_font(size: int = FONT_SIZE):
    """Pillow's default font: the bundled FreeType font at ``size`` when FreeType is available, else the bitmap
    font (both ship with Pillow and work offline)."""
    try:
        return ImageFont.load_default(size=size)
    except (TypeError, OSError, ImportError, AttributeError):  # Pillow < 10.1: no size argument
        return ImageFont.load_default()


def _unicode_ok(font) -> bool:
    return isinstance(font, ImageFont.FreeTypeFont)


def _ellipsis(font) -> str:
    return "…" if _unicode_ok(font) else "..."


def _clean(text: Any, font) -> str:
    text = " ".join(str(text).split())  # newlines and tabs: one space
    if not _unicode_ok(font):  # the bitmap font covers Latin-1 only
        text = text.encode("latin-1", "replace").decode("latin-1")
    return text


def text_width(text: str, font) -> float:
    return font.getlength(text)


def line_height(font) -> int:
    box = font.getbbox("Ágjy|")
    return int(box[3] - min(0, box[1])) + 3


def truncate(text: str, width: float, font) -> str:
    """``text`` cut to fit ``width`` pixels, with an ellipsis when cut."""
    if text_width(text, font) <= width:
        return text
    ell = _ellipsis(font)
    while text and text_width(text.rstrip() + ell, font) > width:
        text = text[:-1]
    return text.rstrip() + ell if text else ""


def wrap_text(text: Any, width: float, font, max_lines: int | None = None) -> list[str]:
    """Greedy word wrap of ``text`` into lines of at most ``width`` pixels (a word wider than a line is broken);
    with ``max_lines``, the last kept line ends in an ellipsis when text was left out."""
    words = _clean(text, font).split(" ")
    lines: list[str] = []
    current = ""
    for word in words:
        if not word:
            continue
        candidate = f"{current} {word}" if current else word
        if text_width(candidate, font) <= width:
            current = candidate
            continue
        if current:
            lines.append(current)
        while text_width(word, font) > width and len(word) > 1:
            k = len(word) - 1
            while k > 1 and text_width(word[:k], font) > width:
                k -= 1
            lines.append(word[:k])
            word = word[k:]
        current = word
    if current:
        lines.append(current)
    if max_lines is not None and len(lines) > max_lines:
        lines = lines[: max(0, max_lines)]
        if lines:
            ell = _ellipsis(font)
            last = lines[-1]
            while last and text_width(last.rstrip() + ell, font) > width:
                last = last[:-1]
            lines[-1] = last.rstrip() + ell
    return lines


def format_score(value: float | None) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "n/a"
    return f"{float(value):.3g}"


def score_items(scores: Scores | None) -> list[str]:
    """``["brightness 0.47", "jpeg -1.56"]`` for ``{"brightness": 0.47, "jpeg": -1.56}`` (``n/a`` for ``None``)."""
    return [f"{name} {format_score(value)}" for name, value in (scores or {}).items()]


def short_names(names: Sequence[str]) -> list[str]:
    """Reward names without the prefix they all share up to an underscore (``shapes_preference``, ``shapes_count``
    -> ``preference``, ``count``); unchanged for one name or none shared."""
    names = list(names)
    if len(names) < 2:
        return names
    prefix = os.path.commonprefix(names)
    prefix = prefix[: prefix.rfind("_") + 1]
    return [n[len(prefix) :] or n for n in names] if prefix else names


def score_lines(scores: Scores | None, width: float, font) -> list[str]:
    """The scores packed into lines of at most ``width`` pixels, joined by `` · ``, names shortened by
    :func:`short_names`; a name too long for a line is broken over lines at its underscores (never cut), the value
    after it."""
    sep = " · " if _unicode_ok(font) else " | "
    lines: list[str] = []
    current = ""
    scores = scores or {}
    for name, value in zip(short_names(list(scores)), scores.values()):
        item = f"{_clean(name, font)} {format_score(value)}"
        candidate = f"{current}{sep}{item}" if current else item
        if text_width(candidate, font) <= width:
            current = candidate
            continue
        if current:
            lines.append(current)
        current = item
        while text_width(current, font) > width and "_" in current:  # too long alone: break at underscores
            parts = current.split("_")
            head, k = parts[0], 1
            while k < len(parts) - 1 and text_width(f"{head}_{parts[k]}_", font) <= width:
                head, k = f"{head}_{parts[k]}", k + 1
            lines.append(head + "_")
            current = "_".join(parts[k:])
    if current:
        lines.append(current)
    return lines


def draw_lines(draw: ImageDraw.ImageDraw, xy: tuple[int, int], lines: Sequence[str], font, fill) -> list[str]:
    """Draw ``lines`` one under the other from ``xy``; returns the strings drawn."""
    x, y = xy
    step = line_height(font)
    for k, line in enumerate(lines):
        draw.text((x, y + k * step), line, fill=fill, font=font)
    return list(lines)
