"""FLUX.1 (``FluxPipeline``, ``FluxTransformer2DModel``): dev (guidance-distilled) and schnell.

What differs from SD3, and how the adapter keeps the trainer unaware of it:

- **Packed latents.** The transformer sees 2x2 patches of the VAE latent as a token sequence with image position
  ids. The adapter's latent space is the *unpacked* VAE latent ``[B, C, H, W]``; ``predict`` packs ``x_t``, builds the
  position ids from its size and unpacks the velocity. Packing is a permutation, so the NFT loss (a mean over
  elements) is unchanged by it.
- **Guidance embedding, not CFG.** FLUX.1-dev is guidance-distilled: ``guidance_scale`` is an input of the
  transformer (one forward, no negative prompt), in rollouts *and* in the training forward, so the policy trained is
  the one sampled. schnell has no guidance input and ignores it. (``FluxPipeline``'s ``true_cfg_scale`` is not used.)
- **Dynamic shifting.** The pipeline draws the sigma grid ``linspace(1, 1/N, N)`` shifted by ``mu``, which grows with
  the image token count; :meth:`FluxAdapter.timestep_kwargs` hands the same to the training grid.
- **Prompts.** CLIP-L pooled vector + T5-XXL sequence (``max_sequence_length`` <= 512), text position ids all zero.
- **Timestep.** The transformer takes the flow time ``sigma`` itself (it multiplies by 1000 inside).

Default LoRA targets: those of diffusers' ``train_dreambooth_lora_flux.py`` (attention of both streams and the
dual-stream blocks' feed-forwards; ``attn.to_q/k/v`` also match the single-stream blocks).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import DiffusersFlowAdapter, RowConditioning, vae_decode
from .loading import seeded_build
from .tiny import (
    TINY_FLUX_NAME,
    tiny_autoencoder_kl,
    tiny_clip_text_encoder,
    tiny_clip_tokenizer,
    tiny_dynamic_shift_scheduler,
    tiny_t5_encoder,
    tiny_t5_tokenizer,
)

FLUX_LORA_TARGETS = (
    "attn.to_k",
    "attn.to_q",
    "attn.to_v",
    "attn.to_out.0",
    "attn.add_k_proj",
    "attn.add_q_proj",
    "attn.add_v_proj",
    "attn.to_add_out",
    "ff.net.0.proj",
    "ff.net.2",
    "ff_context.net.0.proj",
    "ff_context.net.2",
)


@dataclass
class FluxConditioning(RowConditioning):
    prompt_embeds: torch.Tensor  # [B, tokens, joint_attention_dim] (T5)
    pooled: torch.Tensor  # [B, pooled_projection_dim] (CLIP)
    text_ids: torch.Tensor  # [tokens, 3], the same for every row
    guidance: torch.Tensor | None  # [B] embedded guidance (dev), None without a guidance input (schnell)

    shared = ("text_ids",)


def pack(latents: torch.Tensor) -> torch.Tensor:
    """``[B, C, H, W]`` -> ``[B, H/2 * W/2, 4C]`` (``FluxPipeline._pack_latents``)."""
    b, c, h, w = latents.shape
    latents = latents.view(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5)
    return latents.reshape(b, (h // 2) * (w // 2), c * 4)


def unpack(tokens: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """The inverse of :func:`pack` for a latent of ``height x width``."""
    b, _, channels = tokens.shape
    tokens = tokens.view(b, height // 2, width // 2, channels // 4, 2, 2).permute(0, 3, 1, 4, 2, 5)
    return tokens.reshape(b, channels // 4, height, width)


def image_ids(height: int, width: int, device, dtype) -> torch.Tensor:
    """The packed tokens' position ids ``[H/2 * W/2, 3]`` (``FluxPipeline._prepare_latent_image_ids``)."""
    ids = torch.zeros(height // 2, width // 2, 3)
    ids[..., 1] += torch.arange(height // 2)[:, None]
    ids[..., 2] += torch.arange(width // 2)[None, :]
    return ids.reshape(-1, 3).to(device=device, dtype=dtype)


def flux_velocity(module: torch.nn.Module, tokens: torch.Tensor, ids: torch.Tensor, sigma: torch.Tensor, cond):
    """The FLUX transformer's output on packed ``tokens`` with position ids ``ids`` (FLUX.1 Kontext appends the
    source's tokens to the target's)."""
    return module(
        hidden_states=tokens,
        timestep=sigma.expand(tokens.shape[0]),  # FLUX takes sigma; it scales by 1000 itself
        guidance=cond.guidance,
        pooled_projections=cond.pooled,
        encoder_hidden_states=cond.prompt_embeds,
        txt_ids=cond.text_ids,
        img_ids=ids,
        return_dict=False,
    )[0]


def flux_timestep_kwargs(scheduler_config, num_steps: int, image_tokens: int) -> dict:
    """``FluxPipeline.__call__``'s ``set_timesteps`` arguments: its sigma list and the dynamic shift ``mu``."""
    import numpy as np
    from diffusers.pipelines.flux.pipeline_flux import calculate_shift

    kwargs: dict = {}
    if not scheduler_config.get("use_flow_sigmas", False):
        kwargs["sigmas"] = np.linspace(1.0, 1 / num_steps, num_steps)
    kwargs["mu"] = calculate_shift(
        image_tokens,
        scheduler_config.get("base_image_seq_len", 256),
        scheduler_config.get("max_image_seq_len", 4096),
        scheduler_config.get("base_shift", 0.5),
        scheduler_config.get("max_shift", 1.15),
    )
    return kwargs


class PackedLatentAdapter(DiffusersFlowAdapter):
    """What FLUX, Qwen-Image and Z-Image share: 2x2-packed latents (pixels per token: the VAE's factor times 2) and
    the sigma grid ``linspace(1, 1/N, N)`` with the dynamic shift ``mu`` of the image token count."""

    @property
    def latent_factor(self) -> int:
        return self.pipeline.vae_scale_factor * 2  # the VAE's downsampling times the 2x2 packing

    def timestep_kwargs(self, num_steps: int, resolution: int) -> dict:
        side = resolution // self.latent_factor
        return flux_timestep_kwargs(self.pipeline.scheduler.config, num_steps, side * side)


class FluxAdapter(PackedLatentAdapter):
    """FLUX.1 [dev] / [schnell] behind :class:`~marble_trl.models.family.FlowModelAdapter`."""

    family = "flux"
    pipeline_class_name = "FluxPipeline"
    tiny_name = TINY_FLUX_NAME
    hub_ids = ("black-forest-labs/FLUX.1-dev", "black-forest-labs/FLUX.1-schnell", "black-forest-labs/FLUX.1-Krea-dev")
    default_lora_targets = FLUX_LORA_TARGETS
    guidance = "embedded"

    @classmethod
    def build_tiny(cls, seed: int = 0):
        return build_tiny_flux_pipeline(seed)

    def _encode(self, prompts, max_sequence_length, device, guidance_scale) -> FluxConditioning:
        embeds, pooled, text_ids = self.pipeline.encode_prompt(
            prompt=prompts,
            prompt_2=None,
            device=device,
            num_images_per_prompt=1,
            max_sequence_length=max_sequence_length,
        )
        guidance = None
        if self.transformer.config.guidance_embeds:
            guidance = torch.full((len(prompts),), float(guidance_scale), device=embeds.device, dtype=torch.float32)
        return FluxConditioning(embeds, pooled, text_ids, guidance)

    @torch.no_grad()
    def sample(self, scheduler, cond: FluxConditioning, num_steps: int, resolution: int, generator: torch.Generator,
               guidance_scale: float = 1.0, negative: FluxConditioning | None = None) -> torch.Tensor:  # fmt: skip
        out = self.call_for_latents(
            scheduler,
            num_steps,
            resolution,
            generator,
            prompt_embeds=cond.prompt_embeds,
            pooled_prompt_embeds=cond.pooled,
            guidance_scale=guidance_scale,
        )
        side = resolution // self.pipeline.vae_scale_factor
        return unpack(out.images, side, side)

    @staticmethod
    def predict(module: torch.nn.Module, x_t: torch.Tensor, sigma: torch.Tensor, cond: FluxConditioning):
        _, _, h, w = x_t.shape
        return unpack(flux_velocity(module, pack(x_t), image_ids(h, w, x_t.device, x_t.dtype), sigma, cond), h, w)

    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        return vae_decode(self.pipeline.vae, latents)


def build_tiny_flux_pipeline(
    seed: int = 0, latent_size: int = 16, guidance_embeds: bool = True, pipeline_cls=None, name: str = TINY_FLUX_NAME
):
    """A random-weight ``FluxPipeline`` from FLUX's own classes (as diffusers' tests build one): one dual- and one
    single-stream block, a 2x VAE with 4 latent channels (images ``2 * latent_size`` square), tiny CLIP and T5.
    ``guidance_embeds=True`` is FLUX.1-dev's layout, ``False`` schnell's; ``pipeline_cls``: another pipeline of the
    same components (``FluxKontextPipeline``), registered as ``name``."""
    from diffusers import FluxPipeline, FluxTransformer2DModel

    pipeline_cls = pipeline_cls or FluxPipeline

    def build():
        transformer = FluxTransformer2DModel(
            patch_size=1,
            in_channels=16,
            num_layers=1,
            num_single_layers=1,
            attention_head_dim=16,
            num_attention_heads=2,
            joint_attention_dim=32,
            pooled_projection_dim=16,
            guidance_embeds=guidance_embeds,
            axes_dims_rope=(4, 4, 8),
        )
        vae = tiny_autoencoder_kl(4, 2 * latent_size, shift_factor=0.1159, scaling_factor=0.3611)
        return transformer.eval(), vae.eval(), tiny_clip_text_encoder(16), tiny_t5_encoder(32)

    transformer, vae, clip, t5 = seeded_build(seed, build)
    scheduler = tiny_dynamic_shift_scheduler()
    pipe = pipeline_cls(
        scheduler=scheduler,
        vae=vae,
        text_encoder=clip,
        tokenizer=tiny_clip_tokenizer(),
        text_encoder_2=t5,
        tokenizer_2=tiny_t5_tokenizer(),
        transformer=transformer,
    )
    pipe.register_to_config(_name_or_path=name)
    pipe.tiny_seed = seed
    return pipe
