"""The ShapesBench editing base model (``shapes-edit``): a tiny FLUX.1 Kontext pipeline pretrained by flow matching
on the editing world (:mod:`.edits`).

The VAE is the ``shapes`` model's (trained on the same world's images: its latent shift and scale already normalise
them); the transformer and both text encoders (CLIP for the pooled vector, T5 for the sequence) are trained together
by rectified flow on (source, instruction, edited scene) triples: the edited scene's latent is noised,
``x_t = (1 - s) x0 + s eps``, the source's latent rides in the sequence as FLUX.1 Kontext's does, and the target is
``v = eps - x0`` (:meth:`marble_trl.models.flux_kontext.FluxKontextAdapter.predict`); ``s`` is drawn from the density
of the sampler's dynamically shifted grid. The model has no guidance input (``guidance_embeds=False``).

Deterministic from :class:`EditPretrainConfig` for a given number of CPU threads; cached and shipped like
``shapes`` (:mod:`.pretrain`, :mod:`.shipped`).
"""

from __future__ import annotations

import json
import math
import os
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from ..models.flux_kontext import FluxKontextAdapter, FluxKontextConditioning
from ..models.tiny import (
    tiny_clip_text_encoder,
    tiny_clip_tokenizer,
    tiny_dynamic_shift_scheduler,
    tiny_t5_encoder,
    tiny_t5_tokenizer,
)
from .edits import KINDS, draw, sample_edits
from .pretrain import _log, cache_root, config_key, flow_matching
from .world import to_tensor

FORMAT_VERSION = 1
SHAPES_EDIT_MODEL_NAME = "shapes-edit"
MAX_SEQUENCE_LENGTH = 40  # T5 tokens: above the longest instruction (the benchmark encodes with the same length)
CLIP_MAX_LENGTH = 40


@dataclass(frozen=True)
class EditPretrainConfig:
    """Everything that determines the editing base model (hashed into its name)."""

    seed: int = 0
    num_examples: int = 12000
    # 500 steps leave the base room on every reward (held-out instruction 0.24, preservation 0.66, fidelity 0.40);
    # 1,500 edited so well that each reward's room was fine rendering, which RL did not learn (docs/shapesbench.md)
    steps: int = 500
    batch_size: int = 64
    lr: float = 1e-3
    warmup_steps: int = 100
    num_layers: int = 2
    num_single_layers: int = 2
    heads: int = 4
    head_dim: int = 16
    text_hidden: int = 32
    threads: int = 1

    def key(self) -> str:
        return config_key(self, FORMAT_VERSION)


def edit_model_path(config: EditPretrainConfig) -> Path:
    return cache_root() / f"edit-{config.key()}"


def untrained_edit_pipeline(config: EditPretrainConfig):
    """The editing base model before pretraining: random transformer and text encoders from ``config.seed``, the
    ``shapes`` model's VAE."""
    from diffusers import AutoencoderKL, FluxKontextPipeline, FluxTransformer2DModel

    from .shipped import base_model

    state = torch.random.get_rng_state()
    torch.manual_seed(config.seed)
    try:
        transformer = FluxTransformer2DModel(
            patch_size=1,
            in_channels=16,
            num_layers=config.num_layers,
            num_single_layers=config.num_single_layers,
            attention_head_dim=config.head_dim,
            num_attention_heads=config.heads,
            joint_attention_dim=config.text_hidden,
            pooled_projection_dim=config.text_hidden,
            guidance_embeds=False,
            axes_dims_rope=(4, 6, 6),
        )
        clip, t5 = tiny_clip_text_encoder(config.text_hidden), tiny_t5_encoder(config.text_hidden)
    finally:
        torch.random.set_rng_state(state)
    vae = AutoencoderKL.from_pretrained(base_model() / "vae")
    tokenizer = tiny_clip_tokenizer(CLIP_MAX_LENGTH)
    pipe = FluxKontextPipeline(
        scheduler=tiny_dynamic_shift_scheduler(),
        vae=vae,
        text_encoder=clip,
        tokenizer=tokenizer,
        text_encoder_2=t5,
        tokenizer_2=tiny_t5_tokenizer(),
        transformer=transformer,
    )
    pipe.tokenizer_max_length = CLIP_MAX_LENGTH
    return pipe


def _sigma_density(u: torch.Tensor, mu: float) -> torch.Tensor:
    """Flow times distributed like the sampler's grid: the scheduler's exponential time shift of a uniform ``u``."""
    return math.exp(mu) / (math.exp(mu) + (1 / u.clamp(1e-4, 1 - 1e-4) - 1))


def pretrain_edit_model(config: EditPretrainConfig | None = None, force: bool = False, quiet: bool = False) -> Path:
    """Build (or reuse from the cache) the editing base model; returns its ``save_pretrained`` folder."""
    config = config or EditPretrainConfig()
    out = edit_model_path(config)
    if (out / "model_index.json").is_file() and not force:
        _log(f"cached: {out}", quiet)
        return out
    start = time.perf_counter()
    threads, rng_state = torch.get_num_threads(), torch.random.get_rng_state()
    torch.set_num_threads(config.threads)
    try:
        torch.manual_seed(config.seed)
        gen = torch.Generator().manual_seed(config.seed)
        pipe = untrained_edit_pipeline(config)
        adapter = FluxKontextAdapter(pipe)
        edits = sample_edits(config.num_examples, 10_000 + config.seed)  # layouts apart from the benchmark's rows
        with torch.no_grad():
            sources = adapter.encode_images(to_tensor(np.stack([draw(e.source) for e in edits])), "cpu")
            targets = adapter.encode_images(to_tensor(np.stack([draw(e.target) for e in edits])), "cpu")
        prompts = sorted({e.prompt for e in edits})
        where = {p: i for i, p in enumerate(prompts)}
        prompt_idx = torch.tensor([where[e.prompt] for e in edits])
        mu = adapter.timestep_kwargs(1, 32)["mu"]
        _log(f"{len(edits)} edits ({', '.join(KINDS)}), {len(prompts)} instructions; flow matching", quiet)
        loss = _train(pipe, adapter, sources, targets, prompt_idx, prompts, mu, config, gen, quiet)
    finally:
        torch.set_num_threads(threads)
        torch.random.set_rng_state(rng_state)
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    pipe.save_pretrained(tmp)
    info = {"config": asdict(config), "key": config.key(), "flow_loss": loss, "seconds": time.perf_counter() - start}
    (tmp / "shapesbench.json").write_text(json.dumps(info, indent=2))
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)
    _log(f"saved {out} in {info['seconds']:.0f} s", quiet)
    return out


def _train(pipe, adapter, sources, targets, prompt_idx, prompts, mu, config, gen, quiet) -> float:
    def batch_loss() -> torch.Tensor:
        idx = torch.randint(len(targets), (config.batch_size,), generator=gen)
        x0 = targets[idx]
        eps = torch.randn(x0.shape, generator=gen)
        sigma = _sigma_density(torch.rand(x0.shape[0], generator=gen), mu)
        s = sigma.view(-1, 1, 1, 1)
        x_t = (1 - s) * x0 + s * eps
        embeds, pooled, text_ids = pipe.encode_prompt(
            prompt=prompts, prompt_2=None, device=torch.device("cpu"), max_sequence_length=MAX_SEQUENCE_LENGTH
        )
        pi = prompt_idx[idx]
        cond = FluxKontextConditioning(embeds[pi], pooled[pi], text_ids, None, sources[idx])
        return torch.nn.functional.mse_loss(adapter.predict(pipe.transformer, x_t, sigma, cond), eps - x0)

    return flow_matching([pipe.transformer, pipe.text_encoder, pipe.text_encoder_2], config, batch_loss, quiet)
