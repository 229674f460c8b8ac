"""ShapesBench rewards: classical vision on the image itself, no learned weights.

All follow the reward contract of :mod:`marble_trl.rewards.base`: ``fn(prompts, images, **columns)`` with ``images``
a float tensor ``[B, 3, H, W]`` in ``[0, 1]``, returning one float per image, or ``None`` where the reward does not
apply. Every score lies in ``[0, 1]``.

General rewards (apply to every prompt):

- ``sharpness``:        variance of the grey-level Laplacian, squashed ``v / (v + 0.02)``: crisp edges score high,
  blur and flat images low;
- ``compressibility``:  how small a quality-95 JPEG of the image is: ``(2.0 kB - size) / 1.4 kB``, clipped; flat
  images score high, noise low. It pulls against ``sharpness`` (edges cost bytes).

Specialist rewards (a GenEval in miniature; ``None`` outside their prompt family), computed on the *foreground*:
pixels that are bright (``max(rgb) > 0.35``) and saturated (``(max - min) / max > 0.45``), the way the world draws
objects:

- ``color``:     the colour match (fraction of foreground pixels whose hue is nearest the prompt's colour, times a
  presence factor ``min(1, area / 40 px)``) times the shape match (below);
- ``count``:     connected foreground components (4-connected, at least 8 px) against the prompt's number:
  ``max(0, 1 - |found - asked| / 2)`` (exact 1, off by one 0.5);
- ``position``:  the side score (the foreground centroid's displacement ``d`` from the centre towards the prompt's
  side in half-widths, ``clip(0.5 + 1.25 d, 0, 1)``, times a presence factor ``min(1, area / 20 px)``) times the
  shape match.

Like GenEval, which counts an image right only when the object *and* its colour (or place) are right, each
requirement multiplies: a wrong object scores near 0 however right its colour. (v2 took their mean. The base model
gets colours and sides right on ~0.97 of its images, so that half was nearly constant and halved every gain the
shape brought; with groups normalised by their std the training signal is the same either way.)

The shape match scores the largest foreground object's fill ratio (area / bounding-box area: square 1.0, disc 0.78,
triangle 0.53 once rasterised) against the asked shape's: ``exp(-((fill - ideal) / 0.12)^2 / 2)``, 0 without an
object. (v1 used ``clip(1 - |fill - ideal| / 0.2, 0, 1)``: a blob drawn for a square then scored exactly 0, so the
base model's squares carried no signal at all; the Gaussian is graded everywhere and still ranks the right shape
first.) Like
GenEval, the colour and position prompts thus also check the object class, graded per requirement.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import cache

import numpy as np
import torch

from ..rewards.jpeg import jpeg_kb
from .judges import caption_ranks, judge_scores
from .world import COLORS, NUMBERS, all_scenes, render, to_tensor

FG_MIN_VALUE = 0.35
FG_MIN_SATURATION = 0.45
# An object is a component of at least half the world's smallest shape (a count triangle of radius 3: 16 px); v2's
# 3 px counted the specks a soft 32 px drawing sheds as objects, noise the policy cannot steer (docs/shapesbench.md).
MIN_COMPONENT_PX = 8
SHARPNESS_SCALE = 0.02
JPEG_FLAT_KB, JPEG_SPAN_KB = 2.0, 1.4


def _hue_degrees(rgb: tuple[int, int, int]) -> float:
    x = torch.tensor(rgb, dtype=torch.float32).view(1, 3, 1, 1) / 255.0
    return float(hue(x)[0, 0, 0])


def hue(images: torch.Tensor) -> torch.Tensor:
    """HSV hue in degrees ``[0, 360)`` of ``[B, 3, H, W]`` images, ``[B, H, W]`` (0 for grey pixels)."""
    r, g, b = images[:, 0], images[:, 1], images[:, 2]
    mx, _ = images.max(dim=1)
    mn, _ = images.min(dim=1)
    delta = (mx - mn).clamp(min=1e-6)
    h = torch.where(
        mx == r,
        ((g - b) / delta) % 6,
        torch.where(mx == g, (b - r) / delta + 2, (r - g) / delta + 4),
    )
    return (h * 60.0) % 360.0


PALETTE_HUES: dict[str, float] = {name: _hue_degrees(rgb) for name, rgb in COLORS.items()}


def foreground(images: torch.Tensor) -> torch.Tensor:
    """``[B, H, W]`` booleans: bright, saturated pixels (the objects; the world's background is near-black)."""
    x = images.float()
    mx, _ = x.max(dim=1)
    mn, _ = x.min(dim=1)
    return (mx > FG_MIN_VALUE) & ((mx - mn) / mx.clamp(min=1e-6) > FG_MIN_SATURATION)


def nearest_color(images: torch.Tensor) -> torch.Tensor:
    """``[B, H, W]`` index into ``list(COLORS)`` of the palette hue nearest each pixel's hue (circular distance)."""
    h = hue(images.float())
    centres = torch.tensor(list(PALETTE_HUES.values()))
    diff = (h[..., None] - centres).abs()
    return torch.minimum(diff, 360.0 - diff).argmin(dim=-1)


def components(mask: np.ndarray, min_size: int = MIN_COMPONENT_PX) -> list[tuple[int, int, int]]:
    """4-connected components of a 2-D boolean mask with at least ``min_size`` pixels, as ``(size, bbox height,
    bbox width)``, largest first."""
    h, w = mask.shape
    seen = np.zeros_like(mask, dtype=bool)
    found = []
    for y0, x0 in zip(*np.nonzero(mask)):
        if seen[y0, x0]:
            continue
        seen[y0, x0] = True
        stack, size = [(y0, x0)], 0
        ys, xs = [], []
        while stack:
            y, x = stack.pop()
            size += 1
            ys.append(y)
            xs.append(x)
            for ny, nx in ((y - 1, x), (y + 1, x), (y, x - 1), (y, x + 1)):
                if 0 <= ny < h and 0 <= nx < w and mask[ny, nx] and not seen[ny, nx]:
                    seen[ny, nx] = True
                    stack.append((ny, nx))
        if size >= min_size:
            found.append((size, max(ys) - min(ys) + 1, max(xs) - min(xs) + 1))
    return sorted(found, reverse=True)


def count_components(mask: np.ndarray, min_size: int = MIN_COMPONENT_PX) -> int:
    """Number of 4-connected components of a 2-D boolean mask with at least ``min_size`` pixels."""
    return len(components(mask, min_size))


# Fill ratio (area / bounding-box area) of each drawn shape: a square fills its box, a disc pi/4 of it, a triangle
# about half (a little more once rasterised).
SHAPE_FILL = {"square": 1.0, "circle": 0.78, "triangle": 0.53}
SHAPE_TOLERANCE = 0.2  # fidelity's regularity: linear tolerance around the nearest ideal fill
SHAPE_SIGMA = 0.12  # the specialists' shape match: Gaussian width around the asked shape's fill


def shape_match(mask: np.ndarray, shape: str) -> float:
    """How well the largest foreground object's fill ratio matches ``shape``: ``exp(-((fill - ideal) / 0.12)^2 /
    2)``; 0 without an object."""
    found = components(mask)
    if not found:
        return 0.0
    size, bh, bw = found[0]
    fill = size / (bh * bw)
    return float(np.exp(-0.5 * ((fill - SHAPE_FILL[shape]) / SHAPE_SIGMA) ** 2))


def _applies(family: Sequence[str] | None, i: int, name: str) -> bool:
    return family is not None and family[i] == name


def color(prompts: list[str], images: torch.Tensor, family=None, color=None, shape=None, **_) -> list[float | None]:
    """Attribute binding for ``color`` prompts (``None`` elsewhere): the colour match (share of the foreground in
    the asked colour) times the shape match of the largest object."""
    fg = foreground(images)
    fg_np = fg.numpy()
    nearest = nearest_color(images)
    names = list(COLORS)
    out: list[float | None] = []
    for i in range(len(prompts)):
        if not _applies(family, i, "color"):
            out.append(None)
            continue
        area = int(fg[i].sum())
        if area == 0:
            out.append(0.0)
            continue
        frac = float((nearest[i][fg[i]] == names.index(color[i])).float().mean())
        out.append(frac * min(1.0, area / 40.0) * shape_match(fg_np[i], shape[i]))
    return out


def count(prompts: list[str], images: torch.Tensor, family=None, count=None, **_) -> list[float | None]:
    """Object count for ``count`` prompts (``None`` elsewhere): 1 if exact, 0.5 if off by one, else 0."""
    fg = foreground(images).numpy()
    out: list[float | None] = []
    for i in range(len(prompts)):
        if not _applies(family, i, "count"):
            out.append(None)
            continue
        asked = int(count[i])
        if asked not in NUMBERS:
            raise ValueError(f"count prompt {prompts[i]!r} asks for {asked} objects; the world has {list(NUMBERS)}")
        out.append(max(0.0, 1.0 - abs(count_components(fg[i]) - asked) / 2.0))
    return out


_DIRECTIONS = {"left": (-1.0, 0.0), "right": (1.0, 0.0), "top": (0.0, -1.0), "bottom": (0.0, 1.0)}


def position(
    prompts: list[str], images: torch.Tensor, family=None, position=None, shape=None, **_
) -> list[float | None]:
    """Placement for ``position`` prompts (``None`` elsewhere): how far the objects sit towards the asked side
    times the shape match of the largest object."""
    fg_np = foreground(images).numpy()
    fg = foreground(images).float()
    _, h, w = fg.shape
    ys = torch.arange(h, dtype=torch.float32)[:, None]
    xs = torch.arange(w, dtype=torch.float32)[None, :]
    out: list[float | None] = []
    for i in range(len(prompts)):
        if not _applies(family, i, "position"):
            out.append(None)
            continue
        area = float(fg[i].sum())
        if area == 0:
            out.append(0.0)
            continue
        cx = float((fg[i] * xs).sum()) / area
        cy = float((fg[i] * ys).sum()) / area
        dx, dy = _DIRECTIONS[position[i]]
        d = (dx * (cx - (w - 1) / 2) + dy * (cy - (h - 1) / 2)) / (w / 2 if dx else h / 2)
        side = float(np.clip(0.5 + 1.25 * d, 0.0, 1.0)) * min(1.0, area / 20.0)
        out.append(side * shape_match(fg_np[i], shape[i]))
    return out


def laplacian_variance(images: torch.Tensor) -> torch.Tensor:
    """``[B]`` variance of the 4-neighbour Laplacian of the grey-level image (interior pixels)."""
    g = images.float().mean(dim=1)
    lap = 4 * g[:, 1:-1, 1:-1] - g[:, :-2, 1:-1] - g[:, 2:, 1:-1] - g[:, 1:-1, :-2] - g[:, 1:-1, 2:]
    return lap.flatten(1).var(dim=1)


def sharpness(prompts: list[str], images: torch.Tensor, **_) -> list[float]:
    """Edge sharpness ``v / (v + 0.02)`` with ``v`` the Laplacian variance: high for crisp edges, low for blur."""
    v = laplacian_variance(images)
    return (v / (v + SHARPNESS_SCALE)).tolist()


def compressibility(prompts: list[str], images: torch.Tensor, **_) -> list[float]:
    """JPEG compressibility ``clip((2.0 - kB) / 1.4, 0, 1)`` at quality 95: flat images high, noise low."""
    return [float(np.clip((JPEG_FLAT_KB - kb) / JPEG_SPAN_KB, 0.0, 1.0)) for kb in jpeg_kb(images)]


PALETTE = torch.tensor([list(c) for c in COLORS.values()], dtype=torch.float32) / 255.0
PURE_DISTANCE = 0.2


def _shape_regularity(size: int, bh: int, bw: int) -> float:
    """How much one component looks like a drawn shape: the best fill-ratio match over the world's shapes times
    how square its box is (drawn shapes have box aspect 0.9-1; a stripe or a smear far less)."""
    fill = size / (bh * bw)
    best = max(float(np.clip(1.0 - abs(fill - ideal) / SHAPE_TOLERANCE, 0.0, 1.0)) for ideal in SHAPE_FILL.values())
    aspect = min(bh, bw) / max(bh, bw)
    return best * float(np.clip(1.0 - (1.0 - aspect) / 0.3, 0.0, 1.0))


def fidelity(prompts: list[str], images: torch.Tensor, **_) -> list[float]:
    """World-likeness, prompt-free (a held-out evaluation reward, never trained on): mean of

    - *purity*: the share of inked pixels (``max(rgb) > 0.2``) within RGB distance 0.2 of a palette colour: blur,
      colour fringes and noise lower it;
    - *regularity*: the area-weighted :func:`_shape_regularity` of the foreground components: blobs, smears and
      stripes lower it.

    0 for an image without any object."""
    x = images.float().clamp(0, 1)
    fg = foreground(x).numpy()
    ink = x.amax(dim=1) > 0.2
    dist = (x.permute(0, 2, 3, 1)[..., None, :] - PALETTE).norm(dim=-1).amin(dim=-1)
    pure = (dist < PURE_DISTANCE) & ink
    out = []
    for i in range(x.shape[0]):
        found = components(fg[i])
        if not found:
            out.append(0.0)
            continue
        total = sum(c[0] for c in found)
        regular = sum(c[0] * _shape_regularity(*c) for c in found) / total
        purity = float(pure[i].sum()) / max(1, int(ink[i].sum()))
        out.append(0.5 * purity + 0.5 * regular)
    return out


def alignment(prompts: list[str], images: torch.Tensor, **_) -> list[float]:
    """Caption alignment by the learned ``alignment`` judge (CLIPScore's role; :mod:`.judges`)."""
    return judge_scores("alignment", prompts, images)


def preference(prompts: list[str], images: torch.Tensor, **_) -> list[float]:
    """Preference for a clean, well-drawn image of the caption by the learned ``preference`` judge (PickScore /
    HPS's role; :mod:`.judges`)."""
    return judge_scores("preference", prompts, images)


def judge(prompts: list[str], images: torch.Tensor, **_) -> list[float]:
    """The held-out learned judge (UnifiedReward's role): never a training reward (:mod:`.judges`)."""
    return judge_scores("judge", prompts, images)


def retrieval(prompts: list[str], images: torch.Tensor, **_) -> list[float | None]:
    """Prompt retrieval (a held-out evaluation reward, never trained on): among the world's captions of the image's
    family, the share the held-out ``judge`` scores below the image's own caption (ties half; :func:`caption_ranks`).
    ``None`` for the general family, whose captions name nothing. It is the score no prompt-independent generator
    can raise: the ranks of one fixed image over a family's captions are a permutation, so drawing the same picture
    for every prompt averages exactly 0.5 over the family, however well the picture scores on ``judge`` itself."""
    families = _families(prompts)
    out: list[float | None] = [None] * len(prompts)
    idx = [i for i, f in enumerate(families) if f != "general"]
    if idx:
        cands = [_FAMILY_CAPTIONS[families[i]] for i in idx]
        ranks = caption_ranks("judge", [prompts[i] for i in idx], images[idx], cands)
        for i, r in zip(idx, ranks, strict=True):
            out[i] = r
    return out


def diversity(prompts: list[str], images: torch.Tensor, **_) -> list[float | None]:
    """Within-caption diversity (a held-out evaluation reward, never trained on): each image's mean squared pixel
    distance to the *other images of its caption in the batch*, over the world's own expectation of it (twice its
    within-caption pixel variance, :func:`world_spread`), clipped to ``[0, 1]``: the world's images score about 1, a
    model that draws one picture for a caption whatever the noise 0. ``None`` for an image alone with its caption.
    Noise is diverse too: read it beside ``fidelity``."""
    _families(prompts)  # world captions only: the reference is the world's spread for the caption
    x = images.detach().float().cpu().clamp(0, 1).flatten(1)
    out: list[float | None] = [None] * len(prompts)
    for prompt in dict.fromkeys(prompts):
        idx = [i for i, p in enumerate(prompts) if p == prompt]
        if len(idx) < 2:
            continue
        group = x[idx].double()
        dist = torch.cdist(group, group).square()
        mean_dist = dist.sum(1) / (len(idx) - 1)  # the diagonal is 0
        for i, d in zip(idx, mean_dist.tolist(), strict=True):
            out[i] = min(1.0, d / world_spread(prompt))
    return out


@cache
def world_spread(prompt: str, n: int = 64) -> float:
    """Twice the world's within-caption pixel variance (summed over pixels) for ``prompt``: the expected squared
    distance between two of its images, estimated from ``n`` renders with seeds no pretraining corpus uses."""
    x = to_tensor(np.stack([render(_SCENES[prompt], 2**40 + i) for i in range(n)])).double().flatten(1)
    return float(2 * x.var(0).sum())


_SCENES = {s.prompt: s for s in all_scenes()}
_FAMILY_CAPTIONS = {f: [s.prompt for s in all_scenes() if s.family == f] for f in ("color", "count", "position")}
_PROMPT_FAMILY = {p: s.family for p, s in _SCENES.items()}


def _families(prompts: Sequence[str]) -> list[str]:
    unknown = sorted({p for p in prompts if p not in _PROMPT_FAMILY})
    if unknown:
        raise ValueError(f"shapes retrieval and diversity score the world's captions only; not one: {unknown[:3]}")
    return [_PROMPT_FAMILY[p] for p in prompts]


# The v2 training rewards: two general (every prompt), three specialist (their family only).
GENERAL_REWARDS = {"alignment": alignment, "preference": preference}
SPECIALIST_REWARDS = {"color": color, "count": count, "position": position}
TRAIN_REWARDS = {**GENERAL_REWARDS, **SPECIALIST_REWARDS}
# Held out: scored on every evaluation, never trained on (the paper's Aesthetic / ImageReward / UnifiedReward role).
HELD_OUT_REWARDS = {"fidelity": fidelity, "judge": judge, "retrieval": retrieval, "diversity": diversity}
# v1's general rewards, an opposing pair of pixel statistics: kept for the stress test (docs/shapesbench.md).
STRESS_GENERAL_REWARDS = {"sharpness": sharpness, "compressibility": compressibility}
STRESS_REWARDS = {**STRESS_GENERAL_REWARDS, **SPECIALIST_REWARDS}
REWARDS = {**TRAIN_REWARDS, **HELD_OUT_REWARDS, **STRESS_GENERAL_REWARDS}
REWARD_NAMES = list(TRAIN_REWARDS)
EVAL_NAMES = [*TRAIN_REWARDS, *HELD_OUT_REWARDS]


def score_all(
    prompts: list[str], images: torch.Tensor, columns: dict[str, list], names: Sequence[str] | None = None
) -> dict[str, list[float | None]]:
    """ShapesBench rewards on a batch (default: every reward, stress pair included): ``{name: values}``."""
    return {name: REWARDS[name](prompts, images, **columns) for name in (names or REWARDS)}
