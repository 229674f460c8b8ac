"""The ShapesBench base model: a tiny SD3.5-architecture pipeline pretrained by flow matching on the world.

Two stages, both on images drawn by :mod:`marble_trl.shapesbench.world`, deterministic from ``PretrainConfig.seed``
(for a given number of CPU threads):

1. the VAE as a plain autoencoder (MSE on the decoded posterior mean, a small latent L2 penalty); then the latent
   ``shift_factor`` / ``scaling_factor`` are set so that training latents have mean 0 and std 1;
2. the transformer and both tiny CLIP text encoders together by rectified flow: ``x_t = (1 - s) x0 + s eps``,
   target ``v = eps - x0`` (``marble_trl.models.predict_velocity``), ``s`` drawn like the sampler's shifted grid.

The result is saved with ``save_pretrained`` under ``~/.cache/marble_trl/shapesbench/<config hash>/`` (override with
``$MARBLE_TRL_CACHE``), so ``load_sd3_pipeline(path)`` and ``MarbleDiffusionNFTTrainer(model=path)`` load it. A cached
folder is reused; the folder is written atomically (temporary folder, then rename).
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import os
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from ..models import build_tiny_sd3_pipeline, predict_velocity
from .world import all_scenes, sample_corpus, to_tensor

FORMAT_VERSION = 1
CLIP_CONTEXT = 77  # CLIP's position embeddings: the longest context
LATENT_SIZE = 16  # the tiny VAE's latent side at 32 px (it downsamples by 2)


@dataclass(frozen=True)
class PretrainConfig:
    """Everything that determines the base model (hashed into the cache folder name)."""

    seed: int = 0
    num_images: int = 12000
    vae_steps: int = 800
    vae_batch_size: int = 32
    vae_lr: float = 2e-3
    steps: int = 2000  # v2's 1,000 at patch 2; at patch 4 a step is ~3x cheaper and 1,000 drew fragments (docs)
    batch_size: int = 64
    lr: float = 1e-3
    warmup_steps: int = 100
    num_layers: int = 4
    heads: int = 4
    head_dim: int = 16
    text_hidden: int = 32
    shift: float = 3.0
    threads: int = 1
    # Both CLIP tokenizers pad to this many tokens (CLIP pads to 77). At 32 px the text stream is most of the joint
    # attention's tokens, so a context just above the longest caption (28 tokens of the character-level tokenizer)
    # makes every forward cheaper; the transformer then never sees the long pad tail.
    clip_max_length: int = 32
    # The transformer's patch size on the 16 x 16 latent: 4 gives 16 image tokens (v2 used SD3's 2: 64 tokens).
    # With the 32-token context a step costs 0.4x v2's, which is what fits the benchmark in its 90 minutes (docs).
    patch_size: int = 4

    def __post_init__(self) -> None:
        longest = longest_caption_tokens()
        if not longest <= self.clip_max_length <= CLIP_CONTEXT:
            raise ValueError(
                f"PretrainConfig.clip_max_length={self.clip_max_length}: must be between the longest caption's "
                f"{longest} tokens (shorter would truncate prompts) and CLIP's {CLIP_CONTEXT} position embeddings."
            )
        if self.patch_size < 1 or LATENT_SIZE % self.patch_size:
            raise ValueError(
                f"PretrainConfig.patch_size={self.patch_size}: must divide the {LATENT_SIZE} x {LATENT_SIZE} latent "
                "(1, 2, 4, 8 or 16)."
            )

    def key(self) -> str:
        """A short hash of the config (and the format version): the cache folder name. ``clip_max_length`` and
        ``patch_size`` came later and are hashed only when they differ from v2's 77 and 2, so models built before
        them keep their names."""
        fields = asdict(self)
        for name, legacy in (("clip_max_length", CLIP_CONTEXT), ("patch_size", 2)):
            if fields[name] == legacy:
                del fields[name]
        return config_key(fields, FORMAT_VERSION)


def config_key(config, format_version: int) -> str:
    """A short hash of a config (a dataclass or its field dict) and its file format version: the name of what it
    builds."""
    fields = config if isinstance(config, dict) else asdict(config)
    blob = json.dumps({**fields, "format": format_version}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


@functools.cache
def longest_caption_tokens() -> int:
    """The longest world caption in the tiny CLIP tokenizer's tokens (with the start and end tokens)."""
    from ..models.tiny import tiny_clip_tokenizer

    tokenizer = tiny_clip_tokenizer()
    return max(len(tokenizer(s.prompt).input_ids) for s in all_scenes())


def cache_root() -> Path:
    return Path(os.environ.get("MARBLE_TRL_CACHE", Path.home() / ".cache" / "marble_trl")) / "shapesbench"


def model_path(config: PretrainConfig) -> Path:
    return cache_root() / config.key()


def _log(message: str, quiet: bool) -> None:
    if not quiet:
        print(f"[shapesbench pretrain] {message}", flush=True)


def _cosine_lr(step: int, total: int, warmup: int) -> float:
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))


def train_vae(vae, pixels: torch.Tensor, config: PretrainConfig, gen: torch.Generator, quiet: bool) -> float:
    """Train the VAE as an autoencoder on ``pixels`` (``[N, 3, H, W]`` in ``[-1, 1]``); returns the last MSE."""
    vae.train().requires_grad_(True)
    opt = torch.optim.AdamW(vae.parameters(), lr=config.vae_lr, weight_decay=0.0)
    loss_value = float("nan")
    for step in range(config.vae_steps):
        for group in opt.param_groups:
            group["lr"] = config.vae_lr * _cosine_lr(step, config.vae_steps, config.warmup_steps)
        idx = torch.randint(len(pixels), (config.vae_batch_size,), generator=gen)
        x = pixels[idx]
        z = vae.encode(x).latent_dist.mean
        recon = vae.decode(z).sample
        loss = torch.nn.functional.mse_loss(recon, x) + 1e-4 * z.pow(2).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(vae.parameters(), 1.0)
        opt.step()
        loss_value = loss.item()
        if step % 100 == 0 or step == config.vae_steps - 1:
            _log(f"vae step {step}/{config.vae_steps} mse {loss_value:.5f}", quiet)
    vae.eval().requires_grad_(False)
    return loss_value


@torch.no_grad()
def _encode_latents(vae, pixels: torch.Tensor, batch: int = 256) -> torch.Tensor:
    return torch.cat([vae.encode(pixels[i : i + batch]).latent_dist.mean for i in range(0, len(pixels), batch)])


def _encode_prompts(pipe, prompts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
    embeds, _, pooled, _ = pipe.encode_prompt(
        prompt=prompts,
        prompt_2=None,
        prompt_3=None,
        device=torch.device("cpu"),
        num_images_per_prompt=1,
        do_classifier_free_guidance=False,
        max_sequence_length=8,
    )
    return embeds, pooled


def train_flow(pipe, latents: torch.Tensor, prompt_idx: torch.Tensor, prompts: list[str], config, gen, quiet) -> float:
    """Rectified-flow training of the transformer and the text encoders; returns the mean loss of the last 100
    steps."""

    def batch_loss() -> torch.Tensor:
        idx = torch.randint(len(latents), (config.batch_size,), generator=gen)
        x0 = latents[idx]
        eps = torch.randn(x0.shape, generator=gen)
        u = torch.rand(x0.shape[0], generator=gen)
        sigma = config.shift * u / (1 + (config.shift - 1) * u)  # the sampler's shifted grid, as a density
        s = sigma.view(-1, 1, 1, 1)
        x_t = (1 - s) * x0 + s * eps
        embeds, pooled = _encode_prompts(pipe, prompts)  # every distinct caption once, then indexed
        pi = prompt_idx[idx]
        v = predict_velocity(pipe.transformer, x_t, sigma, embeds[pi], pooled[pi])
        return torch.nn.functional.mse_loss(v, eps - x0)

    return flow_matching([pipe.transformer, pipe.text_encoder, pipe.text_encoder_2], config, batch_loss, quiet)


def flow_matching(modules: list[torch.nn.Module], config, batch_loss, quiet: bool) -> float:
    """``config.steps`` AdamW steps (cosine schedule with warmup, gradients clipped at 1) of ``modules`` on
    ``batch_loss()``, a fresh batch's loss each call; returns the mean loss of the last 100 steps."""
    params = [p for m in modules for p in m.parameters()]
    for m in modules:
        m.train().requires_grad_(True)
    opt = torch.optim.AdamW(params, lr=config.lr, weight_decay=1e-4)
    recent: list[float] = []
    for step in range(config.steps):
        for group in opt.param_groups:
            group["lr"] = config.lr * _cosine_lr(step, config.steps, config.warmup_steps)
        loss = batch_loss()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        recent = (recent + [loss.item()])[-100:]
        if step % 100 == 0 or step == config.steps - 1:
            _log(f"flow step {step}/{config.steps} loss {sum(recent) / len(recent):.4f}", quiet)
    for m in modules:
        m.eval().requires_grad_(False)
    return sum(recent) / len(recent)


def untrained_pipeline(config: PretrainConfig):
    """The base model's pipeline before pretraining: random weights from ``config.seed`` (the global RNG is left as
    it was), the sampler's shift and the CLIP context set. Its cost per step is the pretrained model's
    (``benchmarks/shapes_architecture.py`` times architectures with it)."""
    pipe = build_tiny_sd3_pipeline(
        seed=config.seed,
        latent_size=LATENT_SIZE,
        num_layers=config.num_layers,
        hidden_heads=config.heads,
        head_dim=config.head_dim,
        text_hidden=config.text_hidden,
        patch_size=config.patch_size,
    )
    pipe.scheduler.register_to_config(shift=config.shift)
    for tokenizer in (pipe.tokenizer, pipe.tokenizer_2):
        tokenizer.model_max_length = config.clip_max_length
    # The pipeline reads this once at construction; a loaded pipeline reads it back from the tokenizer.
    pipe.tokenizer_max_length = config.clip_max_length
    return pipe


def pretrain(config: PretrainConfig | None = None, force: bool = False, quiet: bool = False) -> Path:
    """Build (or reuse from the cache) the ShapesBench base model; returns its ``save_pretrained`` folder."""
    config = config or PretrainConfig()
    out = model_path(config)
    if (out / "model_index.json").is_file() and not force:
        _log(f"cached: {out}", quiet)
        return out
    start = time.perf_counter()
    threads = torch.get_num_threads()
    rng_state = torch.random.get_rng_state()
    torch.set_num_threads(config.threads)
    try:
        torch.manual_seed(config.seed)
        gen = torch.Generator().manual_seed(config.seed)
        scenes, images = sample_corpus(config.num_images, config.seed)
        pixels = to_tensor(images) * 2 - 1
        prompts = [s.prompt for s in all_scenes()]
        where = {p: i for i, p in enumerate(prompts)}
        prompt_idx = torch.tensor([where[s.prompt] for s in scenes])
        pipe = untrained_pipeline(config)
        _log(f"corpus {len(scenes)} images; training the VAE ({config.vae_steps} steps)", quiet)
        vae_mse = train_vae(pipe.vae, pixels, config, gen, quiet)
        raw = _encode_latents(pipe.vae, pixels)
        shift, scale = float(raw.mean()), float(1.0 / raw.std())
        pipe.vae.register_to_config(shift_factor=shift, scaling_factor=scale)
        latents = (raw - shift) * scale
        _log(f"latent shift {shift:.4f} scale {scale:.4f}; flow matching ({config.steps} steps)", quiet)
        flow_loss = train_flow(pipe, latents, prompt_idx, prompts, config, gen, quiet)
    finally:
        torch.set_num_threads(threads)
        torch.random.set_rng_state(rng_state)
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    pipe.save_pretrained(tmp)
    info = {
        "config": asdict(config),
        "key": config.key(),
        "vae_mse": vae_mse,
        "flow_loss": flow_loss,
        "seconds": time.perf_counter() - start,
    }
    (tmp / "shapesbench.json").write_text(json.dumps(info, indent=2))
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)
    _log(f"saved {out} in {info['seconds']:.0f} s", quiet)
    return out
