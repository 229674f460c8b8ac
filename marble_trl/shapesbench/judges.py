"""ShapesBench judges: small image-text models the package trains deterministically on its own world.

They play the role of the MARBLE paper's learned rewards (PickScore / HPSv2.1 / CLIPScore for training, ImageReward /
UnifiedReward held out): each scores a ``(prompt, image)`` pair in ``[0, 1]`` and applies to every prompt. A judge is
a tiny CNN over the 32 x 32 image, a bag-of-words embedding of the caption (the world's vocabulary), and an MLP on
``[img, txt, img * txt]`` giving one logit; its score is ``sigmoid(logit / temperature)``. What it is trained to tell
apart defines it:

- ``alignment`` (CLIPScore's role): the world's image for this caption (1) against a world image drawn for another
  caption (0);
- ``preference`` (PickScore / HPS's role): the world's image for this caption (1) against images of another caption,
  and against *degraded* images of this caption (0): blurred, noised, smeared into blobs, striped, flat, hue-shifted;
- ``judge`` (held out, never a training reward; UnifiedReward's role): ``preference``'s task with another seed, other
  widths and other degradation strengths, so that gaming the training judges shows as a drop on this one.

Because every judge is conditioned on the caption, no prompt-independent image can score well on average over
prompts: a fixed image matches at most the few captions it depicts (``tests/test_shapesbench_v2.py`` checks stripes,
flat frames, noise and a fixed world image against the world's own images).

Judges are cached under ``~/.cache/marble_trl/shapesbench/judges/<config hash>.safetensors`` (see
:func:`load_judge`); the package ships the default ones (:mod:`.shipped`).
"""

from __future__ import annotations

import json
import math
import os
import random
import time
from dataclasses import asdict, dataclass
from functools import cache, lru_cache
from pathlib import Path

import torch
from torch import nn

from .pretrain import cache_root, config_key
from .shipped import shipped_judge
from .world import Scene, all_scenes, sample_corpus, to_tensor

FORMAT_VERSION = 1
WORDS = sorted({w for s in all_scenes() for w in s.prompt.lower().split()})
VOCAB = {w: i + 1 for i, w in enumerate(WORDS)}  # 0 = a word the world never uses


@dataclass(frozen=True)
class JudgeConfig:
    """Everything that determines one judge (hashed into its cache file name)."""

    name: str = "preference"
    seed: int = 0
    degraded: bool = True  # train against degraded images of the caption too (preference / judge)
    width: int = 16
    embed: int = 64
    num_images: int = 6000
    steps: int = 1000
    batch_size: int = 64
    lr: float = 2e-3
    degrade_strength: float = 1.0
    hard_negatives: float = 0.5  # share of mismatched captions that differ from the true one in one attribute only
    threads: int = 1

    def key(self) -> str:
        """A short hash of the config (and the format version): the judge's file name."""
        return config_key(self, FORMAT_VERSION)


JUDGES: dict[str, JudgeConfig] = {
    "alignment": JudgeConfig(name="alignment", seed=11, degraded=False),
    "preference": JudgeConfig(name="preference", seed=12, degraded=True),
    "judge": JudgeConfig(name="judge", seed=13, degraded=True, width=24, embed=48, degrade_strength=0.7),
}
# score = sigmoid(logit / T): a classifier's logits are large; T keeps the base model's images off the flat ends of
# the sigmoid, where a group's scores would carry no spread (calibrated on the base model, docs/shapesbench.md).
TEMPERATURES: dict[str, float] = {"alignment": 1.0, "preference": 1.5, "judge": 1.5}


def tokenize(prompts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
    """``(ids, offsets)`` for :class:`torch.nn.EmbeddingBag`: one bag of word ids per prompt."""
    ids, offsets = [], []
    for p in prompts:
        offsets.append(len(ids))
        ids += [VOCAB.get(w, 0) for w in p.lower().split()] or [0]
    return torch.tensor(ids), torch.tensor(offsets)


class JudgeNet(nn.Module):
    """CNN image encoder + bag-of-words caption encoder + a matching MLP: one logit per ``(prompt, image)``."""

    def __init__(self, width: int = 16, embed: int = 64) -> None:
        super().__init__()
        w = width
        self.image = nn.Sequential(
            nn.Conv2d(3, w, 3, padding=1),
            nn.GELU(),
            nn.Conv2d(w, 2 * w, 3, stride=2, padding=1),  # 16 x 16
            nn.GELU(),
            nn.Conv2d(2 * w, 2 * w, 3, stride=2, padding=1),  # 8 x 8
            nn.GELU(),
            nn.Conv2d(2 * w, 2 * w, 3, stride=2, padding=1),  # 4 x 4: position survives the flatten
            nn.GELU(),
            nn.Flatten(),
            nn.Linear(2 * w * 16, embed),
        )
        self.text = nn.EmbeddingBag(len(VOCAB) + 1, embed, mode="mean")
        self.head = nn.Sequential(nn.Linear(3 * embed, embed), nn.GELU(), nn.Linear(embed, 1))

    def forward(self, images: torch.Tensor, ids: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        return self.match(self.image(images * 2 - 1), self.text(ids, offsets))

    def match(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """The logit of image embeddings ``a`` against caption embeddings ``b`` (broadcast over leading dims)."""
        a, b = torch.broadcast_tensors(a, b)
        return self.head(torch.cat([a, b, a * b], dim=-1)).squeeze(-1)


# ------------------------------------------------------------------------------------------------ degradations
def _blur(x: torch.Tensor, k: int) -> torch.Tensor:
    return nn.functional.avg_pool2d(nn.functional.pad(x, (k // 2,) * 4, mode="replicate"), k, stride=1)


def degrade(x: torch.Tensor, gen: torch.Generator, strength: float = 1.0) -> torch.Tensor:
    """A degraded copy of each image of ``x`` (``[B, 3, 32, 32]`` in ``[0, 1]``): one of blur, noise, blobs (blur
    then threshold: the shape's outline lost), stripes, a flat frame, a hue shift (channels permuted) or a pixel
    shuffle, drawn per image."""
    b = x.shape[0]
    kind = torch.randint(7, (b,), generator=gen)
    out = x.clone()
    u = lambda: float(torch.rand((), generator=gen))  # noqa: E731
    for i in range(b):
        img = x[i : i + 1]
        k = int(kind[i])
        if k == 0:
            out[i] = _blur(img, 3 if u() < 0.5 else 5)[0]
        elif k == 1:
            out[i] = (img + strength * (0.08 + 0.25 * u()) * torch.randn(img.shape, generator=gen)).clamp(0, 1)[0]
        elif k == 2:
            soft = _blur(img, 5)
            out[i] = (soft * (1.0 + strength * (0.5 + u()))).clamp(0, 1)[0] * (soft.amax(1, keepdim=True) > 0.2)[0]
        elif k == 3:
            period = 2 + int(6 * u())
            ramp = torch.arange(32).float()
            mask = ((ramp // period) % 2).view(1, 32) if u() < 0.5 else ((ramp // period) % 2).view(32, 1)
            colour = torch.rand(3, 1, 1, generator=gen)
            out[i] = (mask * colour + (1 - mask) * 0.05).expand(3, 32, 32)
        elif k == 4:
            out[i] = torch.rand(3, 1, 1, generator=gen).expand(3, 32, 32) * (1.0 if u() < 0.5 else 0.1)
        elif k == 5:
            out[i] = img[0, torch.randperm(3, generator=gen)] if u() < 0.8 else img[0].flip(-1)
        else:
            flat = img[0].reshape(3, -1)
            out[i] = flat[:, torch.randperm(flat.shape[1], generator=gen)].reshape(3, 32, 32)
    return out


# ---------------------------------------------------------------------------------------------------- training
def near_miss(scene: Scene, rng: random.Random) -> str:
    """A caption of the same family as ``scene`` that differs in exactly one attribute (shape, colour, count or
    side): the hard negatives that make a judge check every word, not just the family's look."""
    return rng.choice(_near_misses(scene))


@cache
def _near_misses(scene: Scene) -> tuple[str, ...]:
    pool = [
        s
        for s in all_scenes()
        if s.family == scene.family
        and s.prompt != scene.prompt
        and sum(getattr(s, a) != getattr(scene, a) for a in ("shape", "color", "count", "position")) == 1
    ]
    if not pool:  # the general family: any caption of another family
        pool = [s for s in all_scenes() if s.family != scene.family]
    return tuple(s.prompt for s in pool)


def train_judge(config: JudgeConfig, quiet: bool = True) -> tuple[JudgeNet, dict]:
    """Train one judge from its config (deterministic for a given thread count); returns the net and its stats."""
    threads = torch.get_num_threads()
    rng_state = torch.random.get_rng_state()
    torch.set_num_threads(config.threads)
    start = time.perf_counter()
    try:
        with torch.enable_grad():  # a judge may be built on first use, from inside a no-grad scorer
            net, losses = _fit(config, quiet)
    finally:
        torch.set_num_threads(threads)
        torch.random.set_rng_state(rng_state)
    net.eval().requires_grad_(False)
    stats = {"loss": sum(losses[-100:]) / len(losses[-100:]), "seconds": time.perf_counter() - start}
    return net, stats


def _fit(config: JudgeConfig, quiet: bool) -> tuple[JudgeNet, list[float]]:
    torch.manual_seed(config.seed)
    gen = torch.Generator().manual_seed(config.seed)
    scenes, images = sample_corpus(config.num_images, seed=1000 + config.seed)
    pixels = to_tensor(images)
    prompts = [s.prompt for s in scenes]
    captions = sorted({s.prompt for s in all_scenes()})
    net = JudgeNet(config.width, config.embed)
    opt = torch.optim.AdamW(net.parameters(), lr=config.lr, weight_decay=1e-4)
    pyrng = random.Random(config.seed)
    losses: list[float] = []
    for step in range(config.steps):
        lr = config.lr * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * step / config.steps)))
        for group in opt.param_groups:
            group["lr"] = lr
        idx = torch.randint(len(pixels), (config.batch_size,), generator=gen).tolist()
        x = pixels[idx]
        own = [prompts[i] for i in idx]
        other = [
            near_miss(scenes[i], pyrng) if pyrng.random() < config.hard_negatives else pyrng.choice(captions)
            for i in idx
        ]
        other = [o if o != p else captions[(captions.index(o) + 1) % len(captions)] for o, p in zip(other, own)]
        batch_x, batch_p, labels = [x, x], own + other, [1.0] * len(idx) + [0.0] * len(idx)
        if config.degraded:
            batch_x.append(degrade(x, gen, config.degrade_strength))
            batch_p += own
            labels += [0.0] * len(idx)
        ids, offsets = tokenize(batch_p)
        logits = net(torch.cat(batch_x), ids, offsets)
        target = torch.tensor(labels)
        weight = torch.where(target > 0, float(len(batch_x) - 1), 1.0)  # positives balance the negatives
        loss = nn.functional.binary_cross_entropy_with_logits(logits, target, weight=weight)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
        if not quiet and (step % 250 == 0 or step == config.steps - 1):
            print(f"[shapesbench judge {config.name}] step {step}/{config.steps} loss {loss.item():.4f}")
    return net, losses


def _cache_dir() -> Path:
    return cache_root() / "judges"


def judge_file(config: JudgeConfig) -> Path:
    """Where a judge is found: the package's shipped copy if its hash matches, else the user cache."""
    return shipped_judge(config.key()) or _cache_dir() / f"{config.name}-{config.key()}.safetensors"


def build_judge(config: JudgeConfig, force: bool = False, quiet: bool = True) -> Path:
    """Train (or find) a judge; returns its safetensors file (written atomically)."""
    from safetensors.torch import save_file

    path = judge_file(config)
    if path.is_file() and not force:
        return path
    path = _cache_dir() / f"{config.name}-{config.key()}.safetensors"
    net, stats = train_judge(config, quiet=quiet)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    meta = {"config": json.dumps(asdict(config)), "stats": json.dumps(stats), "key": config.key()}
    save_file({k: v.contiguous() for k, v in net.state_dict().items()}, str(tmp), metadata=meta)
    os.replace(tmp, path)
    if not quiet:
        print(f"[shapesbench judge {config.name}] saved {path} ({stats['seconds']:.0f} s)")
    return path


@lru_cache(maxsize=8)
def load_judge(name: str) -> tuple[JudgeNet, float]:
    """The judge ``name`` of :data:`JUDGES` (trained on first use, then cached) and its temperature."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    if name not in JUDGES:
        raise ValueError(f"unknown judge {name!r}; ShapesBench has {list(JUDGES)}")
    config = JUDGES[name]
    path = build_judge(config)
    with safe_open(str(path), "pt") as f:
        stored = json.loads(f.metadata()["config"])
    if stored != asdict(config):
        raise ValueError(f"{path} was trained with another config than JUDGES[{name!r}]; delete it to retrain.")
    net = JudgeNet(config.width, config.embed)
    net.load_state_dict(load_file(str(path)))
    return net.eval().requires_grad_(False), TEMPERATURES[name]


def _judge_input(images: torch.Tensor) -> torch.Tensor:
    x = images.detach().float().cpu().clamp(0, 1)
    if x.shape[-2:] != (32, 32):
        x = nn.functional.adaptive_avg_pool2d(x, (32, 32))  # box filter: a 2x nearest upscale comes back exact
    return x


@torch.no_grad()
def judge_scores(name: str, prompts: list[str], images: torch.Tensor) -> list[float]:
    """``sigmoid(logit / T)`` of judge ``name`` for each ``(prompt, image)``; float32 on CPU, in chunks."""
    net, temperature = load_judge(name)
    x = _judge_input(images)
    out: list[float] = []
    for i in range(0, len(prompts), 256):
        ids, offsets = tokenize(prompts[i : i + 256])
        out += torch.sigmoid(net(x[i : i + 256], ids, offsets) / temperature).tolist()
    return out


@torch.no_grad()
def caption_ranks(name: str, prompts: list[str], images: torch.Tensor, candidates: list[list[str]]) -> list[float]:
    """For each image, the share of the other captions in its ``candidates`` (a list that holds its own caption) that
    judge ``name`` scores below its own caption, ties counting half: 1 when the image is told apart from every
    candidate, 0.5 by chance. Only the order of the logits counts, so the temperature does not."""
    net, _ = load_judge(name)
    x = _judge_input(images)
    out: list[float] = []
    embedded: dict[tuple[str, ...], torch.Tensor] = {}  # each candidate list embedded once, not once per image
    for i in range(0, len(prompts), 256):
        feats = net.image(x[i : i + 256] * 2 - 1)
        for feat, prompt, cands in zip(feats, prompts[i : i + 256], candidates[i : i + 256], strict=True):
            if prompt not in cands or len(cands) < 2:
                raise ValueError(f"caption_ranks: {prompt!r} needs its own caption and another among {cands}")
            key = tuple(cands)
            if key not in embedded:
                embedded[key] = net.text(*tokenize(list(key)))
            logits = net.match(feat, embedded[key])
            own = logits[list(cands).index(prompt)]
            below = (logits < own).sum().item() + 0.5 * ((logits == own).sum().item() - 1)
            out.append(below / (len(cands) - 1))
    return out
