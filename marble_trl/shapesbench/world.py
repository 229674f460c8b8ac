"""The ShapesBench world: captioned 32 x 32 images of coloured shapes, drawn procedurally from a seed.

Every scene is a few flat-coloured shapes (circle, square, triangle) on a near-black background. A caption is drawn
from one of four prompt *families*, which are also the prompt *sources* (as the MARBLE paper mixes prompt sets):

- ``color``:    "a red circle"                 one large shape of that colour;
- ``count``:    "three squares"                that many small shapes (random colours, never touching);
- ``position``: "a blue square on the left"    one shape in that half of the image;
- ``general``:  "some shapes"                  one to three random shapes; no specialist reward applies.

Every scene carries its metadata (``family``, ``shape``, ``color``, ``count``, ``position``; ``None`` where a field
does not apply), which the specialist rewards read through the trainer's ``**columns``.
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass

import numpy as np
from PIL import Image, ImageDraw

SIZE = 32
BACKGROUND = (13, 13, 13)
# Saturated, well-separated hues (red 0, yellow ~57, green 120, blue ~228 degrees): classical hue tests tell them apart.
COLORS: dict[str, tuple[int, int, int]] = {
    "red": (230, 30, 30),
    "yellow": (240, 225, 25),
    "green": (30, 200, 40),
    "blue": (40, 70, 240),
}
SHAPES = ("circle", "square", "triangle")
NUMBERS = {1: "one", 2: "two", 3: "three", 4: "four"}
POSITIONS = ("left", "right", "top", "bottom")
GENERAL_PROMPTS = ("some shapes", "a simple picture", "an abstract drawing", "a few objects")
FAMILIES = ("color", "count", "position", "general")
COLUMNS = ("family", "shape", "color", "count", "position", "source")


@dataclass(frozen=True)
class Scene:
    """One captioned scene: the prompt and the metadata the specialist rewards check."""

    prompt: str
    family: str
    shape: str | None = None
    color: str | None = None
    count: int | None = None
    position: str | None = None

    def columns(self) -> dict[str, object]:
        """The dataset row of this scene (``source`` = the family: each family is one prompt source)."""
        row = asdict(self)
        row["source"] = self.family
        return row


def plural(shape: str) -> str:
    return shape + "s"


def all_scenes() -> list[Scene]:
    """Every distinct caption of the world (76 prompts), in a fixed order."""
    scenes = [Scene(f"a {c} {s}", "color", shape=s, color=c) for c in COLORS for s in SHAPES]
    scenes += [
        Scene(f"{word} {s if n == 1 else plural(s)}", "count", shape=s, count=n)
        for n, word in NUMBERS.items()
        for s in SHAPES
    ]
    scenes += [
        Scene(f"a {c} {s} on the {p}", "position", shape=s, color=c, position=p)
        for p in POSITIONS
        for c in COLORS
        for s in SHAPES
    ]
    scenes += [Scene(p, "general") for p in GENERAL_PROMPTS]
    return scenes


def _draw_shape(draw: ImageDraw.ImageDraw, shape: str, cx: float, cy: float, r: float, fill) -> None:
    box = (cx - r, cy - r, cx + r, cy + r)
    if shape == "circle":
        draw.ellipse(box, fill=fill)
    elif shape == "square":
        draw.rectangle((cx - 0.85 * r, cy - 0.85 * r, cx + 0.85 * r, cy + 0.85 * r), fill=fill)
    elif shape == "triangle":
        draw.polygon([(cx, cy - r), (cx - r, cy + 0.8 * r), (cx + r, cy + 0.8 * r)], fill=fill)
    else:
        raise ValueError(f"unknown shape {shape!r}; the world has {SHAPES}")


def _spread_centres(rng: random.Random, n: int, radius: float, min_gap: float) -> list[tuple[float, float]]:
    """``n`` centres inside the canvas whose shapes stay ``min_gap`` pixels apart (rejection sampling)."""
    lo, hi = radius + 1, SIZE - radius - 2
    for _ in range(1000):
        pts = [(rng.uniform(lo, hi), rng.uniform(lo, hi)) for _ in range(n)]
        if all(
            (a[0] - b[0]) ** 2 + (a[1] - b[1]) ** 2 >= (2 * radius + min_gap) ** 2
            for i, a in enumerate(pts)
            for b in pts[i + 1 :]
        ):
            return pts
    # A 2x2 grid always fits: fall back to it.
    grid = [(8.5, 8.5), (23.5, 23.5), (23.5, 8.5), (8.5, 23.5)]
    return grid[:n]


def render(scene: Scene, seed: int) -> np.ndarray:
    """Draw one image of ``scene`` (uint8 ``[32, 32, 3]``); the layout (sizes, jitter, colours left free by the
    caption) is drawn from ``seed``."""
    rng = random.Random(seed)
    img = Image.new("RGB", (SIZE, SIZE), BACKGROUND)
    draw = ImageDraw.Draw(img)
    free_color = lambda: COLORS[rng.choice(list(COLORS))]  # noqa: E731
    if scene.family == "color":
        r = rng.uniform(7.0, 10.0)
        cx, cy = 15.5 + rng.uniform(-3, 3), 15.5 + rng.uniform(-3, 3)
        _draw_shape(draw, scene.shape, cx, cy, r, COLORS[scene.color])
    elif scene.family == "count":
        r = rng.uniform(3.0, 4.0)
        for cx, cy in _spread_centres(rng, scene.count, r, 3.0):
            _draw_shape(draw, scene.shape, cx, cy, r, free_color())
    elif scene.family == "position":
        r = rng.uniform(5.0, 6.5)
        near, far = rng.uniform(r + 1, 11.0), 15.5 + rng.uniform(-5, 5)
        cx, cy = {
            "left": (near, far),
            "right": (SIZE - 1 - near, far),
            "top": (far, near),
            "bottom": (far, SIZE - 1 - near),
        }[scene.position]
        _draw_shape(draw, scene.shape, cx, cy, r, COLORS[scene.color])
    elif scene.family == "general":
        n = rng.randint(1, 3)
        r = rng.uniform(4.0, 6.0)
        for cx, cy in _spread_centres(rng, n, r, 2.0):
            _draw_shape(draw, rng.choice(SHAPES), cx, cy, r, free_color())
    else:
        raise ValueError(f"unknown family {scene.family!r}; the world has {FAMILIES}")
    return np.asarray(img, dtype=np.uint8)


def sample_corpus(num_images: int, seed: int = 0) -> tuple[list[Scene], np.ndarray]:
    """``num_images`` (scene, image) pairs for pretraining: scenes cycle through :func:`all_scenes` in a seeded
    order, layouts are seeded per image. Returns the scenes and a uint8 array ``[N, 32, 32, 3]``."""
    scenes = all_scenes()
    rng = random.Random(seed)
    chosen: list[Scene] = []
    while len(chosen) < num_images:
        order = scenes[:]
        rng.shuffle(order)
        chosen += order
    chosen = chosen[:num_images]
    images = np.stack([render(s, seed * 1_000_003 + i) for i, s in enumerate(chosen)])
    return chosen, images


def to_tensor(images: np.ndarray):
    """uint8 ``[N, H, W, 3]`` -> float tensor ``[N, 3, H, W]`` in ``[0, 1]`` (the reward input format)."""
    import torch

    pixels = np.require(images, requirements=["C", "W"])  # a copy when read-only (PIL's arrays are)
    return torch.from_numpy(pixels).permute(0, 3, 1, 2).float() / 255.0


def prompt_dataset(scenes: list[Scene] | None = None):
    """A ``datasets.Dataset`` with ``prompt`` and the metadata columns (default: every caption of the world)."""
    from datasets import Dataset

    scenes = all_scenes() if scenes is None else scenes
    rows = [s.columns() for s in scenes]
    data = {"prompt": [r["prompt"] for r in rows]}
    for col in COLUMNS:
        data[col] = [r[col] for r in rows]
    return Dataset.from_dict(data)


def train_dataset():
    """Every caption of the world, repeated so that each prompt family (source) is drawn equally often (the
    ``shapes`` prompt source)."""
    scenes = all_scenes()
    by_family = {f: [s for s in scenes if s.family == f] for f in FAMILIES}
    most = max(len(v) for v in by_family.values())
    rows = []
    for family in FAMILIES:
        pool = by_family[family]
        rows += [pool[i % len(pool)] for i in range(most)]
    return prompt_dataset(rows)


def family_dataset(family: str):
    """The captions of one prompt family (the ``shapes_<family>`` prompt source)."""
    if family not in FAMILIES:
        raise ValueError(f"unknown ShapesBench family {family!r}; the world has {FAMILIES}")
    return prompt_dataset([s for s in all_scenes() if s.family == family])


def eval_dataset(per_family: int = 12):
    """The evaluation captions (the ``shapes_eval`` prompt source): :func:`eval_scenes`; the images are held out
    through their seeds (the world has 76 captions, all of them trained on)."""
    return prompt_dataset(eval_scenes(per_family))


def eval_scenes(per_family: int = 8, seed: int = 1234) -> list[Scene]:
    """A fixed, family-stratified held-out evaluation prompt set (``per_family`` captions of every family; the
    general family has only four captions, which are all used)."""
    rng = random.Random(seed)
    out: list[Scene] = []
    for family in FAMILIES:
        pool = [s for s in all_scenes() if s.family == family]
        out += rng.sample(pool, min(per_family, len(pool)))
    return out
