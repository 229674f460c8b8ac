"""Stable Diffusion 3 / 3.5 (``StableDiffusion3Pipeline``, ``SD3Transformer2DModel``): the first model family.

Loading, prompt conditioning (CLIP-L + CLIP-G pooled and the T5 sequence, computed once per distinct prompt),
rollouts through the pipeline's own ``__call__`` with precomputed embeddings and ``output_type="latent"`` (any
diffusers flow scheduler: DiffusionNFT needs only the final clean latents), the velocity of the transformer at flow
time ``sigma`` and decoding for the rewards. :class:`SD3Adapter` puts them behind the
:class:`~marble_trl.models.family.FlowModelAdapter` protocol that the trainer talks to.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from ..distributed import zero3_init_disabled
from .base import DiffusersFlowAdapter, RowConditioning, call_pipeline_for_latents, save_diffusers_lora, vae_decode
from .loading import cast_built, from_pretrained
from .tiny import SHAPES_MODEL_NAME, TINY_MODEL_NAME, build_tiny_sd3_pipeline, shapes_model_path

# The attention projections of every joint block (image and text streams); the paper's LoRA targets.
DEFAULT_LORA_TARGETS = [
    "attn.to_q",
    "attn.to_k",
    "attn.to_v",
    "attn.to_out.0",
    "attn.add_q_proj",
    "attn.add_k_proj",
    "attn.add_v_proj",
    "attn.to_add_out",
]


def predict_velocity(
    transformer: torch.nn.Module,
    x_t: torch.Tensor,
    sigma: torch.Tensor,
    prompt_embeds: torch.Tensor,
    pooled: torch.Tensor,
) -> torch.Tensor:
    """The SD3 transformer's velocity ``v = eps - x0`` at flow time ``sigma`` (diffusers: ``timestep = 1000 sigma``)."""
    return transformer(
        hidden_states=x_t,
        timestep=sigma * 1000.0,
        encoder_hidden_states=prompt_embeds,
        pooled_projections=pooled,
        return_dict=False,
    )[0]


@dataclass
class PromptEmbeddings(RowConditioning):
    """SD3's prompt conditioning: the joint sequence and the pooled CLIP vector, one row per sample."""

    prompt_embeds: torch.Tensor  # [B, tokens, joint_attention_dim]
    pooled: torch.Tensor  # [B, pooled_projection_dim]


@torch.no_grad()
def encode_prompts(pipeline, prompts: list[str], max_sequence_length: int, device: torch.device) -> PromptEmbeddings:
    """Encode each distinct prompt once and expand back to ``prompts`` (groups repeat a prompt G times)."""
    unique = list(dict.fromkeys(prompts))
    embeds, _, pooled, _ = pipeline.encode_prompt(
        prompt=unique,
        prompt_2=None,
        prompt_3=None,
        device=device,
        num_images_per_prompt=1,
        do_classifier_free_guidance=False,
        max_sequence_length=max_sequence_length,
    )
    where = {p: i for i, p in enumerate(unique)}
    idx = torch.tensor([where[p] for p in prompts], device=embeds.device)
    return PromptEmbeddings(embeds[idx], pooled[idx])


@torch.no_grad()
def sample_latents(
    pipeline,
    scheduler,
    embeddings: PromptEmbeddings,
    num_steps: int,
    resolution: int,
    generator: torch.Generator,
    guidance_scale: float = 1.0,
    negative: PromptEmbeddings | None = None,
) -> torch.Tensor:
    """Run the ODE solver from fresh noise and return the clean latents ``x0`` (transformer space)."""
    kwargs = {}
    if guidance_scale > 1.0:
        if negative is None:
            raise ValueError("guidance_scale > 1 needs negative prompt embeddings.")
        kwargs = dict(negative_prompt_embeds=negative.prompt_embeds, negative_pooled_prompt_embeds=negative.pooled)
    out = call_pipeline_for_latents(
        pipeline,
        scheduler,
        num_steps,
        resolution,
        generator,
        prompt_embeds=embeddings.prompt_embeds,
        pooled_prompt_embeds=embeddings.pooled,
        guidance_scale=guidance_scale,
        **kwargs,
    )
    return out.images


@torch.no_grad()
def decode_latents(pipeline, latents: torch.Tensor) -> torch.Tensor:
    """Clean latents -> images ``[B, 3, H, W]`` in ``[0, 1]`` (float32), the reward input format."""
    return vae_decode(pipeline.vae, latents)


@zero3_init_disabled()  # frozen components must not be partitioned by ZeRO-3 (marble_trl.distributed)
def load_sd3_pipeline(
    name_or_path: str | os.PathLike,
    torch_dtype: torch.dtype | None = None,
    tiny_seed: int = 0,
):
    """Load an SD3 / SD3.5 pipeline from a local folder or Hub id; ``"tiny"`` builds the offline tiny pipeline,
    ``"shapes"`` loads the ShapesBench base model shipped in the package.

    A local path that does not exist is an error (it is never mistaken for a Hub id).
    """
    from diffusers import StableDiffusion3Pipeline

    name_or_path = str(name_or_path)
    if name_or_path == TINY_MODEL_NAME:
        return cast_built(build_tiny_sd3_pipeline(seed=tiny_seed), torch_dtype)
    if name_or_path == SHAPES_MODEL_NAME:
        pipe = from_pretrained(StableDiffusion3Pipeline, shapes_model_path(), torch_dtype)
        pipe.register_to_config(_name_or_path=SHAPES_MODEL_NAME)  # cards and adapters name it like a Hub id
        return pipe
    return from_pretrained(StableDiffusion3Pipeline, name_or_path, torch_dtype)


def save_sd3_lora(folder, layers: dict[str, torch.Tensor], metadata: dict | None, weight_name: str | None = None):
    """SD3's LoRA file (:func:`~marble_trl.models.base.save_diffusers_lora`), loadable with
    ``StableDiffusion3Pipeline.load_lora_weights``."""
    from diffusers import StableDiffusion3Pipeline

    save_diffusers_lora(StableDiffusion3Pipeline, folder, layers, metadata, weight_name)


class SD3Adapter(DiffusersFlowAdapter):
    """The SD3 / SD3.5 family behind :class:`~marble_trl.models.family.FlowModelAdapter`."""

    family = "sd3"
    pipeline_class_name = "StableDiffusion3Pipeline"
    tiny_name = TINY_MODEL_NAME
    hub_ids = (
        "stabilityai/stable-diffusion-3-medium-diffusers",
        "stabilityai/stable-diffusion-3.5-medium",
        "stabilityai/stable-diffusion-3.5-large",
        "stabilityai/stable-diffusion-3.5-large-turbo",
    )
    default_lora_targets = tuple(DEFAULT_LORA_TARGETS)

    @classmethod
    def load(cls, name_or_path: str | os.PathLike, torch_dtype: torch.dtype | None = None, tiny_seed: int = 0):
        return cls(load_sd3_pipeline(name_or_path, torch_dtype, tiny_seed))

    @classmethod
    def build_tiny(cls, seed: int = 0):
        return build_tiny_sd3_pipeline(seed=seed)

    @classmethod
    def handles(cls, pipeline) -> bool:
        return type(pipeline).__name__ == cls.pipeline_class_name or hasattr(pipeline, "text_encoder_3")

    def _encode(self, prompts, max_sequence_length, device, guidance_scale) -> PromptEmbeddings:
        return encode_prompts(self.pipeline, prompts, max_sequence_length, device)

    def sample(self, scheduler, cond: PromptEmbeddings, num_steps: int, resolution: int, generator: torch.Generator,
               guidance_scale: float = 1.0, negative: PromptEmbeddings | None = None) -> torch.Tensor:  # fmt: skip
        return sample_latents(
            self.pipeline, scheduler, cond, num_steps, resolution, generator, guidance_scale, negative
        )

    @staticmethod
    def predict(
        module: torch.nn.Module, x_t: torch.Tensor, sigma: torch.Tensor, cond: PromptEmbeddings
    ) -> torch.Tensor:
        return predict_velocity(module, x_t, sigma, cond.prompt_embeds, cond.pooled)

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        return decode_latents(self.pipeline, latents)
