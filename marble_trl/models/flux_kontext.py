"""FLUX.1 Kontext (``FluxKontextPipeline``): FLUX.1 [dev] that edits a source image given an instruction.

What differs from :mod:`.flux`, read from diffusers' ``pipeline_flux_kontext.py``:

- **The source image's latents ride in the sequence.** The source is VAE-encoded (the distribution's mode, then
  ``(z - shift) * scale``), packed like the noisy latent and appended to it on the token axis; its position ids are
  the target's with the first coordinate 1. The transformer's output is cut back to the target's tokens. The
  adapter's conditioning carries the source latents (:class:`FluxKontextConditioning`), so the trainer, the rollouts
  and the training forward need nothing else: the policy is always conditioned on the image it edits.
- **The grid.** The dynamic shift ``mu`` counts the target's tokens only (as the pipeline does).
- **Sampling** goes through the pipeline's ``__call__`` with the source latents as ``image`` (a tensor with the VAE's
  latent channels skips the pipeline's resize and VAE encode), ``max_area=resolution**2`` and ``_auto_resize=False``,
  so a LoRA loaded in plain diffusers draws the same images from the same source pixels.
- **Text** does not depend on the image (CLIP + T5, as FLUX.1): the prompt-embedding cache applies unchanged.

**The source's size.** The pipeline conditions on the source snapped to the preferred Kontext resolution of its aspect
ratio (``_auto_resize``: 1024 x 1024 for a square), whatever the output size; the adapter conditions on 1024 x 1024
sources (:attr:`~.editing.EditingAdapter.source_resolution`; the tiny model on 32 x 32), which a plain-diffusers call
with a square source reproduces.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .editing import EditingAdapter, unique_images
from .flux import FluxAdapter, FluxConditioning, build_tiny_flux_pipeline, flux_velocity, image_ids, pack, unpack
from .tiny import SHAPES_EDIT_MODEL_NAME, TINY_FLUX_KONTEXT_NAME, TINY_SOURCE_RESOLUTION, shapes_edit_model_path


@dataclass
class FluxKontextConditioning(FluxConditioning):
    image_latents: torch.Tensor | None = None  # [B, C, h, w]: the source's scaled VAE latents (unpacked)


class FluxKontextAdapter(EditingAdapter, FluxAdapter):
    """FLUX.1 Kontext [dev] behind :class:`~marble_trl.models.family.FlowModelAdapter` (an editing family)."""

    family = "flux-kontext"
    pipeline_class_name = "FluxKontextPipeline"
    tiny_name = TINY_FLUX_KONTEXT_NAME
    hub_ids = ("black-forest-labs/FLUX.1-Kontext-dev",)

    @classmethod
    def build_tiny(cls, seed: int = 0):
        from diffusers import FluxKontextPipeline

        pipe = build_tiny_flux_pipeline(seed, pipeline_cls=FluxKontextPipeline, name=TINY_FLUX_KONTEXT_NAME)
        pipe.source_resolution = TINY_SOURCE_RESOLUTION
        return pipe

    @classmethod
    def load(cls, name_or_path, torch_dtype=None, tiny_seed: int = 0):
        if str(name_or_path) != SHAPES_EDIT_MODEL_NAME:
            return super().load(name_or_path, torch_dtype, tiny_seed)
        adapter = super().load(shapes_edit_model_path(), torch_dtype, tiny_seed)
        adapter.pipeline.register_to_config(_name_or_path=SHAPES_EDIT_MODEL_NAME)  # cards name it like a Hub id
        adapter.pipeline.source_resolution = TINY_SOURCE_RESOLUTION  # the world's 32 x 32 scenes
        return adapter

    @classmethod
    def edit_call_kwargs(cls, resolution: int) -> dict:
        # the output at height x width (the pipeline rescales them to max_area otherwise), the source at its size
        return {"max_area": resolution * resolution, "_auto_resize": False}

    def encode(self, prompts, max_sequence_length, device, guidance_scale=1.0, source_images=None):
        source_images = self.check_sources(prompts, source_images)
        text = self._encode_text(prompts, max_sequence_length, device, guidance_scale)
        return FluxKontextConditioning(**vars(text), image_latents=self.encode_images(source_images, device))

    @torch.no_grad()
    def encode_images(self, images: torch.Tensor, device) -> torch.Tensor:
        """``[B, 3, H, W]`` in ``[0, 1]`` -> the scaled VAE latents (``_encode_vae_image``), each distinct image once."""
        vae = self.pipeline.vae
        unique, rows = unique_images(images)
        pixels = (unique.to(device).float() * 2 - 1).to(vae.dtype)  # VaeImageProcessor.normalize, then the cast
        # in the memory layout of the pipeline's PIL -> numpy -> tensor preprocessing (channels last): the VAE's
        # convolutions round differently in the other layout (1 ulp), and a LoRA should draw in diffusers what it drew here
        pixels = pixels.contiguous(memory_format=torch.channels_last)
        latents = vae.encode(pixels).latent_dist.mode()
        latents = (latents - vae.config.shift_factor) * vae.config.scaling_factor
        return latents[torch.tensor(rows, device=latents.device)]

    @torch.no_grad()
    def sample(self, scheduler, cond: FluxKontextConditioning, num_steps: int, resolution: int,
               generator: torch.Generator, guidance_scale: float = 1.0,
               negative: FluxKontextConditioning | None = None) -> torch.Tensor:  # fmt: skip
        out = self.call_for_latents(
            scheduler,
            num_steps,
            resolution,
            generator,
            image=cond.image_latents.to(cond.prompt_embeds.dtype),
            prompt_embeds=cond.prompt_embeds,
            pooled_prompt_embeds=cond.pooled,
            guidance_scale=guidance_scale,
            max_area=resolution * resolution,
            _auto_resize=False,
        )
        side = resolution // self.pipeline.vae_scale_factor
        return unpack(out.images, side, side)

    @staticmethod
    def predict(module: torch.nn.Module, x_t: torch.Tensor, sigma: torch.Tensor, cond: FluxKontextConditioning):
        _, _, h, w = x_t.shape
        source = cond.image_latents.to(x_t.dtype)
        source_ids = image_ids(*source.shape[-2:], x_t.device, x_t.dtype)
        source_ids[:, 0] = 1  # the source's ids: the target's with the first coordinate 1
        target = pack(x_t)
        tokens = torch.cat([target, pack(source)], dim=1)
        ids = torch.cat([image_ids(h, w, x_t.device, x_t.dtype), source_ids])
        return unpack(flux_velocity(module, tokens, ids, sigma, cond)[:, : target.shape[1]], h, w)
