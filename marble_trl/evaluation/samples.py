"""Image sheets a person can read: captioned grids (prompt and per-image scores under each image), the before/after
sample sheet of a run, and the side-by-side comparison sheet of ``marble-trl evaluate``.

Text is laid out by :mod:`marble_trl.evaluation.text_layout` (Pillow's built-in default font); small images are scaled
up with nearest-neighbour so a 32 px image and its caption are both readable. Every sheet records the strings it drew in
``image.info["captions"]``.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from PIL import Image, ImageDraw

from ..artifacts import SAMPLES_DIR
from ..rewards.images import to_pil
from ..rewards.video import still_frames
from .text_layout import FONT_SIZE, Scores, caption_font, draw_lines, line_height, score_items, score_lines, wrap_text

logger = logging.getLogger(__name__)

MIN_CELL = 128  # images narrower than this are scaled up (nearest neighbour) and shown in a cell this wide
PAD = 4  # margin around text
GAP = 2  # white gap between cells
PROMPT_LINES = 3  # a longer prompt is truncated with an ellipsis
HEADER_LINES = 2
LABEL_WIDTH = 180  # the row-label column of a comparison sheet
BACKGROUND = (255, 255, 255)
TEXT = (0, 0, 0)
SCORE_TEXT = (20, 60, 140)
TITLE_BAND = (232, 236, 244)


def image_grid(images: torch.Tensor, columns: int) -> Image.Image:
    """Tile ``[N, 3, H, W]`` images in ``[0, 1]`` into a grid with ``columns`` columns (no captions); videos show
    their middle frame."""
    pils = to_pil(still_frames(images))
    w, h = pils[0].size
    rows = (len(pils) + columns - 1) // columns
    grid = Image.new("RGB", (columns * w, rows * h), "white")
    for i, im in enumerate(pils):
        grid.paste(im, ((i % columns) * w, (i // columns) * h))
    return grid


def _as_pils(images) -> list[Image.Image]:
    if isinstance(images, torch.Tensor):
        return to_pil(still_frames(images))  # a video's grid cell is its middle frame
    return [im.convert("RGB") for im in images]


def captioned_grid(
    images: torch.Tensor | Sequence[Image.Image],
    columns: int,
    *,
    captions: Sequence[str | None] | None = None,
    scores: Sequence[Scores | None] | None = None,
    headers: Sequence[str] | None = None,
    row_labels: Sequence[Sequence[str] | str] | None = None,
    title: str | None = None,
    scale: int | None = None,
    min_cell: int = MIN_CELL,
    max_cell: int | None = None,
    prompt_lines: int = PROMPT_LINES,
) -> Image.Image:
    """A grid of ``images`` (a ``[N, 3, H, W]`` tensor in ``[0, 1]`` or PIL images), ``columns`` per row, each
    with its caption (a prompt, wrapped to ``prompt_lines`` lines) and its scores (``{reward: value}``) under it.

    ``headers`` name the columns (a band on top), ``row_labels`` the rows (a column on the left: a string is
    wrapped, a list of strings is one paragraph each), ``title`` the whole sheet. Images are scaled by ``scale``,
    else up by an integer factor (nearest neighbour) to at least ``min_cell`` pixels wide, and down to at most
    ``max_cell``. ``image.info["captions"]`` lists every string drawn; ``image.info["layout"]`` the cell geometry.
    """
    pils = _as_pils(images)
    if not pils:
        raise ValueError("captioned_grid needs at least one image.")
    n = len(pils)
    columns = max(1, min(int(columns), n))
    rows = math.ceil(n / columns)
    w = max(im.width for im in pils)
    h = max(im.height for im in pils)
    if scale is None:
        factor = float(max(1, min_cell // max(1, w)))
        if max_cell is not None and w * factor > max_cell:
            factor = max_cell / w
    else:
        factor = float(max(1, scale))
    img_w, img_h = max(1, round(w * factor)), max(1, round(h * factor))
    if factor != 1.0:
        method = Image.NEAREST if factor > 1 else Image.LANCZOS
        pils = [
            im.resize((max(1, round(im.width * factor)), max(1, round(im.height * factor))), method) for im in pils
        ]
    cell_w = max(img_w, min_cell)
    font = caption_font(max(FONT_SIZE, cell_w // 48))
    lh = line_height(font)
    text_w = cell_w - 2 * PAD

    cap = [wrap_text(c, text_w, font, prompt_lines) if c else [] for c in (captions or [None] * n)]
    sco = [score_lines(s, text_w, font) for s in (scores or [None] * n)]
    band_lines = max(len(c) + len(s) for c, s in zip(cap, sco))
    band = band_lines * lh + PAD if band_lines else 0
    col_pitch, row_pitch = cell_w + GAP, img_h + band + GAP
    label_w = LABEL_WIDTH if row_labels else 0
    width = label_w + columns * col_pitch - GAP
    heads = [wrap_text(hd, text_w, font, HEADER_LINES) for hd in headers] if headers else []
    header_h = max(len(x) for x in heads) * lh + PAD if heads else 0
    titles = wrap_text(title, width - 2 * PAD, font, 2) if title else []
    title_h = len(titles) * lh + PAD if titles else 0
    height = title_h + header_h + rows * row_pitch - GAP

    sheet = Image.new("RGB", (width, height), BACKGROUND)
    draw = ImageDraw.Draw(sheet)
    drawn: list[str] = []
    if titles:
        draw.rectangle((0, 0, width, title_h - 1), fill=TITLE_BAND)
        drawn += draw_lines(draw, (PAD, PAD // 2), titles, font, TEXT)
    for c, lines in enumerate(heads):
        drawn += draw_lines(draw, (label_w + c * col_pitch + PAD, title_h + PAD // 2), lines, font, TEXT)
    top = title_h + header_h
    for r in range(rows if row_labels else 0):
        if r >= len(row_labels):
            break
        label = row_labels[r]
        paragraphs = [label] if isinstance(label, str) else list(label)
        budget = max(1, (row_pitch - GAP - PAD) // lh)
        lines: list[str] = []
        for k, para in enumerate(paragraphs):
            left = budget - len(lines) - (len(paragraphs) - k - 1)  # keep a line for each later paragraph
            lines += wrap_text(para, label_w - 2 * PAD, font, max(1, left))
        drawn += draw_lines(draw, (PAD, top + r * row_pitch + PAD // 2), lines[:budget], font, TEXT)
    for k, im in enumerate(pils):
        r, c = divmod(k, columns)
        x0, y0 = label_w + c * col_pitch, top + r * row_pitch
        sheet.paste(im, (x0 + (cell_w - im.width) // 2, y0))
        y = y0 + img_h + PAD // 2
        drawn += draw_lines(draw, (x0 + PAD, y), cap[k], font, TEXT)
        drawn += draw_lines(draw, (x0 + PAD, y + len(cap[k]) * lh), sco[k], font, SCORE_TEXT)
    sheet.info["captions"] = drawn
    sheet.info["layout"] = {
        "rows": rows,
        "columns": columns,
        "cell": (cell_w, img_h + band),
        "image": (img_w, img_h),
        "label_width": label_w,
        "top": top,
        "gap": GAP,
    }
    return sheet


def stack_sheets(sheets: Sequence[Image.Image]) -> Image.Image:
    """``sheets`` one under the other (left-aligned, a gap between), their captions concatenated."""
    width = max(s.width for s in sheets)
    height = sum(s.height for s in sheets) + 3 * GAP * (len(sheets) - 1)
    out = Image.new("RGB", (width, height), BACKGROUND)
    y = 0
    for s in sheets:
        out.paste(s, (0, y))
        y += s.height + 3 * GAP
    out.info["captions"] = [line for s in sheets for line in s.info.get("captions", [])]
    return out


def mean_scores(scores: Sequence[Scores | None]) -> dict[str, float | None]:
    """Each reward's mean over ``scores`` (``None`` and NaN skipped; ``None`` when it applies to none)."""
    names: dict[str, None] = {}
    for s in scores:
        names.update(dict.fromkeys(s or {}))
    out: dict[str, float | None] = {}
    for name in names:
        xs = [float(v) for s in scores if s and (v := s.get(name)) is not None and not math.isnan(float(v))]
        out[name] = sum(xs) / len(xs) if xs else None
    return out


def score_images(
    reward_funcs: Sequence[Any],
    names: Sequence[str],
    prompts: list[str],
    images: torch.Tensor,
    columns: dict[str, list[Any]] | None = None,
) -> list[dict[str, float | None]] | None:
    """Per-image ``{reward: score}`` (``None``: not applicable) for captions; ``None`` (with a warning) when a
    reward fails: a caption is not worth failing a finished run for."""
    from ..rewards import score_rewards

    try:
        values = score_rewards(list(reward_funcs), prompts, images, columns or {}, list(names))
    except Exception as err:  # noqa: BLE001 - the sheet is drawn without scores
        logger.warning("Sample sheet drawn without scores: scoring its images failed (%s).", err)
        return None
    return [
        {n: (None if math.isnan(v) else v) for n, v in zip(names, values[:, j].tolist())} for j in range(len(prompts))
    ]


def save_before_after(
    before: torch.Tensor,
    after: torch.Tensor,
    columns: int,
    path: str | Path,
    scale: int | None = None,
    *,
    prompts: Sequence[str] | None = None,
    before_scores: Sequence[Scores | None] | None = None,
    after_scores: Sequence[Scores | None] | None = None,
) -> Path:
    """Save the before/after sheet: the ``before`` grid (LoRA off) above the ``after`` grid (same prompts and
    seeds), ``columns`` images per row. With ``prompts`` (one per column), each image is captioned with its prompt;
    with ``before_scores`` / ``after_scores`` (one ``{reward: score}`` per image), with its scores, and each half's
    title gives the mean scores."""
    n = len(before)
    captions = [prompts[k % columns] for k in range(n)] if prompts else None

    def title(name: str, scores) -> str:
        if not scores:
            return name
        return f"{name}, mean: " + " · ".join(score_items(mean_scores(scores)))

    sheets = [
        captioned_grid(images, columns, captions=captions, scores=scores, title=title(name, scores), scale=scale)
        for name, images, scores in (
            ("before training (LoRA off)", before, before_scores),
            ("after training", after, after_scores),
        )
    ]
    sheet = stack_sheets(sheets)
    path = Path(path)
    sheet.save(path)
    return path


def comparison_sheet(
    models: Sequence[str],
    images: Sequence[Sequence[Image.Image | str | Path]],
    row_labels: Sequence[Sequence[str] | str],
    scores: Sequence[Sequence[Scores | None]] | None = None,
    *,
    max_cell: int | None = 512,
) -> Image.Image:
    """Models side by side: ``images[r][m]`` (a PIL image or a file) is row ``r``'s image from ``models[m]``;
    columns are headed by the model names, rows labelled by ``row_labels``, each image captioned by
    ``scores[r][m]``."""
    tiles = [im if isinstance(im, Image.Image) else Image.open(im) for row in images for im in row]
    flat = [s for row in scores for s in row] if scores is not None else None
    return captioned_grid(
        tiles, len(models), scores=flat, headers=list(models), row_labels=list(row_labels), max_cell=max_cell
    )


def save_samples(images, prompts: list[str], folder: str | os.PathLike) -> list[tuple[str, str]]:
    """Save ``[N, 3, H, W]`` images in ``[0, 1]`` as ``samples/000.png`` ... under ``folder`` (videos
    ``[N, F, 3, H, W]`` as ``samples/000.mp4`` or ``.gif``, see :func:`write_video`); returns ``(relative path,
    prompt)`` pairs for the card."""
    out = Path(folder) / SAMPLES_DIR
    out.mkdir(parents=True, exist_ok=True)
    pairs = []
    if images.ndim == 5:
        for i, (video, prompt) in enumerate(zip(images, prompts)):
            path = write_video(video, out / f"{i:03d}")
            pairs.append((f"{SAMPLES_DIR}/{path.name}", prompt))
        return pairs
    for i, (image, prompt) in enumerate(zip(to_pil(images), prompts)):
        image.save(out / f"{i:03d}.png")
        pairs.append((f"{SAMPLES_DIR}/{i:03d}.png", prompt))
    return pairs


def write_video(frames: torch.Tensor, stem: str | os.PathLike, fps: int = 16) -> Path:
    """One video ``[F, 3, H, W]`` in ``[0, 1]`` as ``stem.mp4`` (H.264 through imageio-ffmpeg, the ``video``
    extra) or, without it, ``stem.gif`` (Pillow); returns the path written."""
    stem = Path(stem)
    array = (frames.detach().float().clamp(0, 1) * 255).round().to(torch.uint8).permute(0, 2, 3, 1).cpu().numpy()
    try:
        import imageio.v3 as iio
        import imageio_ffmpeg  # noqa: F401  (the ffmpeg binary imageio's mp4 writer needs)
    except ImportError:
        pils = [Image.fromarray(a) for a in array]
        path = stem.with_suffix(".gif")
        pils[0].save(path, save_all=True, append_images=pils[1:], duration=round(1000 / fps), loop=0)
        return path
    path = stem.with_suffix(".mp4")
    # yuv420p (what browsers and the Hub's viewer play) needs even sides: pad by one row / column if odd.
    pad_h, pad_w = array.shape[1] % 2, array.shape[2] % 2
    if pad_h or pad_w:
        import numpy as np

        array = np.pad(array, ((0, 0), (0, pad_h), (0, pad_w), (0, 0)), mode="edge")
    iio.imwrite(path, array, plugin="FFMPEG", fps=fps, codec="libx264", macro_block_size=1)
    return path
