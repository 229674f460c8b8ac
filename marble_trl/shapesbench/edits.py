"""ShapesBench edits: the editing world, its instruction and preservation scorers, and its prompt sources.

A source scene holds two shapes (different shapes, different colours) in two of the canvas's four quadrants, on the
world's near-black background (:mod:`.world`'s palette and drawing). An instruction asks for one edit, which is also
the row's prompt *source* (the four kinds mix like the text-to-image world's families):

- ``recolor``: "make the red circle blue"          that shape, in its place, in the new colour;
- ``move``:    "move the red circle to the right"  that shape mirrored into the empty quadrant on the other side;
- ``add``:     "add a green square at top left"    a new shape in that empty quadrant;
- ``remove``:  "remove the red circle"             that quadrant left empty.

Each row carries what the scorers check: the quadrant that must hold the asked shape and colour after the edit
(``edit_target``), the quadrant that must be empty (``edit_vacate``), and the quadrants the edit may change
(``edit_quadrants``); everything outside them must stay as in the source. Two scorers read them:

- :func:`instruction`: did the edit happen (the asked shape and colour in the target quadrant, the vacated one empty);
- :func:`preservation`: is the rest of the scene unchanged (each object outside the edited quadrants, pixel labels
  against the source's).

The rows' source images are PNG bytes in ``source_images`` (the editing data contract, docs/models.md).
"""

from __future__ import annotations

import io
import random
from dataclasses import dataclass, field

import numpy as np
import torch
from PIL import Image, ImageDraw

from .world import BACKGROUND, COLORS, SHAPES, SIZE, _draw_shape

KINDS = ("recolor", "move", "add", "remove")
QUADRANTS = {"top left": (0, 0), "top right": (1, 0), "bottom left": (0, 1), "bottom right": (1, 1)}
MIRROR = {
    "top left": "top right",
    "top right": "top left",
    "bottom left": "bottom right",
    "bottom right": "bottom left",
}
HALF = SIZE // 2
EDIT_COLUMNS = ("edit_target", "edit_vacate", "edit_quadrants", "edit_shape", "edit_color", "source")
TRAIN_ROWS, EVAL_ROWS = 512, 64
TRAIN_SEED, EVAL_SEED = 0, 1


@dataclass(frozen=True)
class Shape:
    shape: str
    color: str
    quadrant: str
    radius: float
    dx: float  # the centre's jitter inside the quadrant
    dy: float

    def name(self) -> str:
        return f"{self.color} {self.shape}"

    def moved(self, quadrant: str) -> Shape:
        return Shape(self.shape, self.color, quadrant, self.radius, self.dx, self.dy)

    def recolored(self, color: str) -> Shape:
        return Shape(self.shape, color, self.quadrant, self.radius, self.dx, self.dy)


@dataclass(frozen=True)
class Edit:
    """One editing example: the source scene, the instruction and the scene it asks for."""

    kind: str
    prompt: str
    source: tuple[Shape, ...]
    target: tuple[Shape, ...]
    edit_target: str | None  # the quadrant that must hold the asked shape after the edit
    edit_vacate: str | None  # the quadrant that must be empty after the edit
    edit_shape: str
    edit_color: str
    edit_quadrants: tuple[str, ...] = field(default=())  # the quadrants the edit may change

    def row(self) -> dict[str, object]:
        return {
            "prompt": self.prompt,
            "source_images": png_bytes(draw(self.source)),
            "edit_target": self.edit_target,
            "edit_vacate": self.edit_vacate,
            "edit_quadrants": list(self.edit_quadrants),
            "edit_shape": self.edit_shape,
            "edit_color": self.edit_color,
            "source": self.kind,
        }


def _random_shape(rng: random.Random, quadrant: str, shape: str, color: str) -> Shape:
    return Shape(shape, color, quadrant, rng.uniform(4.5, 6.0), rng.uniform(-1.5, 1.5), rng.uniform(-1.5, 1.5))


def draw(shapes: tuple[Shape, ...] | list[Shape]) -> np.ndarray:
    """The scene as uint8 ``[32, 32, 3]``."""
    img = Image.new("RGB", (SIZE, SIZE), BACKGROUND)
    canvas = ImageDraw.Draw(img)
    for s in shapes:
        qx, qy = QUADRANTS[s.quadrant]
        cx, cy = qx * HALF + 7.5 + s.dx, qy * HALF + 7.5 + s.dy
        _draw_shape(canvas, s.shape, cx, cy, s.radius, COLORS[s.color])
    return np.asarray(img, dtype=np.uint8)


def png_bytes(pixels: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return buffer.getvalue()


def sample_edit(rng: random.Random, kind: str | None = None) -> Edit:
    """One random editing example (of ``kind``, or a random kind)."""
    kind = kind or rng.choice(KINDS)
    shapes = rng.sample(SHAPES, 2)
    colors = rng.sample(list(COLORS), 2)
    quadrants = rng.sample(list(QUADRANTS), 2)
    if kind == "move":  # the moved shape's mirror quadrant must be free
        while MIRROR[quadrants[0]] == quadrants[1]:
            quadrants = rng.sample(list(QUADRANTS), 2)
    a, b = (_random_shape(rng, q, s, c) for q, s, c in zip(quadrants, shapes, colors))
    source = (a, b)
    if kind == "recolor":
        new = rng.choice([c for c in COLORS if c != a.color])
        return Edit(kind, f"make the {a.name()} {new}", source, (a.recolored(new), b), a.quadrant, None, a.shape, new,
                    (a.quadrant,))  # fmt: skip
    if kind == "move":
        to = MIRROR[a.quadrant]
        side = "right" if QUADRANTS[to][0] else "left"
        return Edit(kind, f"move the {a.name()} to the {side}", source, (a.moved(to), b), to, a.quadrant, a.shape,
                    a.color, (a.quadrant, to))  # fmt: skip
    if kind == "add":
        free = rng.choice([q for q in QUADRANTS if q not in quadrants])
        new = _random_shape(rng, free, rng.choice(SHAPES), rng.choice(list(COLORS)))
        return Edit(kind, f"add a {new.name()} at {free}", source, (a, b, new), free, None, new.shape, new.color,
                    (free,))  # fmt: skip
    if kind == "remove":
        return Edit(kind, f"remove the {a.name()}", source, (b,), None, a.quadrant, a.shape, a.color, (a.quadrant,))
    raise ValueError(f"unknown edit kind {kind!r}; the world has {KINDS}")


def sample_edits(count: int, seed: int) -> list[Edit]:
    """``count`` examples, the kinds in turn (each kind a quarter), layouts from ``seed``."""
    rng = random.Random(seed)
    return [sample_edit(rng, KINDS[i % len(KINDS)]) for i in range(count)]


def edit_dataset(count: int = TRAIN_ROWS, seed: int = TRAIN_SEED):
    """A ``datasets.Dataset`` of editing rows (``prompt``, ``source_images`` as PNG bytes, the scorers' columns and
    the kind as ``source``): the ``shapes_edit`` prompt source (512 rows, seed 0)."""
    from datasets import Dataset

    rows = [e.row() for e in sample_edits(count, seed)]
    return Dataset.from_list(rows)


def edit_eval_dataset():
    """The held-out editing rows (64, seed 1: other layouts and instructions): the ``shapes_edit_eval`` source."""
    return edit_dataset(EVAL_ROWS, EVAL_SEED)


# ------------------------------------------------------------------------------------------------- scorers
def _quadrant(images: torch.Tensor, name: str) -> torch.Tensor:
    """The quadrant ``name`` of ``images`` (``[..., H, W]``; a view)."""
    qx, qy = QUADRANTS[name]
    h, w = images.shape[-2] // 2, images.shape[-1] // 2
    return images[..., qy * h : (qy + 1) * h, qx * w : (qx + 1) * w]


def _holds(images: torch.Tensor, i: int, quadrant: str, shape: str, color: str) -> float:
    """How well ``quadrant`` of image ``i`` holds a ``color`` ``shape``: the share of its foreground in that colour
    times the shape match times how much of a shape there is (:func:`.scorers.color`'s measure, in a quadrant)."""
    from .scorers import foreground, nearest_color, shape_match

    part = _quadrant(images[i : i + 1].float(), quadrant)
    fg = foreground(part)[0]
    area = int(fg.sum())
    if area == 0:
        return 0.0
    frac = float((nearest_color(part)[0][fg] == list(COLORS).index(color)).float().mean())
    return frac * min(1.0, area / 30.0) * shape_match(fg.numpy(), shape)


# An empty quadrant scores 0 once this many of its pixels are foreground (specks, for the instruction's vacated
# quadrant) or differ from the source (preservation's kept quadrants; an occupied one once as many as its object has).
EMPTY_TOLERANCE_PX = 20


def _empty(images: torch.Tensor, i: int, quadrant: str) -> float:
    from .scorers import foreground

    return max(0.0, 1.0 - float(foreground(_quadrant(images[i : i + 1].float(), quadrant)).sum()) / EMPTY_TOLERANCE_PX)


def instruction(
    prompts: list[str], images: torch.Tensor, edit_target=None, edit_vacate=None, edit_shape=None, edit_color=None,
    **_,
) -> list[float | None]:  # fmt: skip
    """Instruction following: the mean of the checks the edit asks for (the asked shape and colour in the target
    quadrant; the vacated quadrant empty), in ``[0, 1]``; ``None`` for a row without edit columns."""
    out: list[float | None] = []
    for i in range(len(prompts)):
        target = edit_target[i] if edit_target is not None else None
        vacate = edit_vacate[i] if edit_vacate is not None else None
        if target is None and vacate is None:
            out.append(None)
            continue
        checks = []
        if target is not None:
            checks.append(_holds(images, i, target, edit_shape[i], edit_color[i]))
        if vacate is not None:
            checks.append(_empty(images, i, vacate))
        out.append(sum(checks) / len(checks))
    return out


def _labels(images: torch.Tensor) -> torch.Tensor:
    """``[B, H, W]``: each pixel's nearest palette colour where it is foreground, -1 on the background."""
    from .scorers import foreground, nearest_color

    x = images.detach().float().cpu()  # the palette lives on the CPU, as the other scorers' pixel loops do
    return torch.where(foreground(x), nearest_color(x), -1)


def preservation(
    prompts: list[str], images: torch.Tensor, source_images=None, edit_quadrants=None, **_
) -> list[float | None]:
    """Preservation of the unedited content, object by object: the mean over the quadrants the edit must leave alone
    of ``max(0, 1 - m / max(n, 20))``, with ``m`` the pixels whose object label (the nearest palette colour of a
    foreground pixel, or background) differs from the source's and ``n`` the source object's pixels there (an empty
    quadrant tolerates 20); 1 for an untouched rest, 0 for a kept object removed or recoloured; ``None`` without a
    source image or where the edit may change every quadrant. ``source_images`` holds one source per image."""
    if source_images is None:
        return [None] * len(prompts)
    edited, source = _labels(images), _labels(source_images)
    out: list[float | None] = []
    for i in range(len(prompts)):
        moved = set((edit_quadrants[i] if edit_quadrants is not None else None) or ())
        if moved - QUADRANTS.keys():
            raise ValueError(
                f"preservation: row {i}'s edit_quadrants {edit_quadrants[i]!r} name unknown quadrants; each must be one of "
                f"{list(QUADRANTS)} (a list per row)."
            )
        scores = []
        for q in QUADRANTS:
            if q in moved:
                continue
            s, e = _quadrant(source[i], q), _quadrant(edited[i], q)
            mismatch = int((s != e).sum())  # both background (-1) counts as equal
            scores.append(max(0.0, 1.0 - mismatch / max(int((s >= 0).sum()), EMPTY_TOLERANCE_PX)))
        out.append(sum(scores) / len(scores) if scores else None)
    return out
