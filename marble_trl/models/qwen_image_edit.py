"""Qwen-Image-Edit (``QwenImageEditPipeline``): Qwen-Image that edits a source image given an instruction.

What differs from :mod:`.qwen_image`, read from diffusers' ``pipeline_qwenimage_edit.py``:

- **The prompt sees the image.** Qwen2.5-VL encodes the instruction inside the edit template with the source image's
  vision tokens (the processor's ``images=``), so a prompt's conditioning depends on its image: rows are encoded per
  distinct (prompt, image) pair, and the negative prompt is encoded with each row's image too. The prompt-embedding
  cache (``cache_prompt_embeddings``) is refused for this family.
- **The source latents ride in the sequence**, normalised with the VAE's latent mean and std, packed and appended to
  the noisy latent; ``img_shapes`` lists both, and the output is cut back to the target's tokens.
- **The source's size.** The pipeline conditions on the source resized to about one megapixel at its aspect ratio
  (``calculate_dimensions(1024 * 1024, ratio)``, multiples of 32) for both the VAE and the VL encoder, whatever the
  output size: the adapter conditions on 1024 x 1024 sources (:attr:`~.editing.EditingAdapter.source_resolution`), so
  a LoRA trained here sees what it sees in plain diffusers. The offline tiny model conditions on 32 x 32 sources.
- **Sampling** is the pipeline's loop written out (its ``__call__`` reads ``image.size`` as a PIL image's and cannot
  take the training's batch of tensors): the same noise, grid, ``timestep / 1000``, true CFG with the per-token norm
  rescale and scheduler steps (tests/test_editing.py compares it with ``__call__``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..rollout.solvers import pinned_grid
from .base import vae_normalize
from .editing import EditingAdapter, unique_images
from .flux import pack, unpack
from .loading import seeded_build
from .qwen_image import QwenImageAdapter, QwenImageConditioning, qwen_image_components, qwen_velocity
from .tiny import TINY_QWEN_IMAGE_EDIT_NAME, TINY_SOURCE_RESOLUTION, tiny_dynamic_shift_scheduler

PIPELINE_CONDITION_AREA = 1024 * 1024  # QwenImageEditPipeline.__call__'s calculate_dimensions(1024 * 1024, ratio)


def condition_size(area: int, ratio: float = 1.0) -> tuple[int, int]:
    """``(width, height)`` of the source as the pipeline conditions on it (``calculate_dimensions``)."""
    width = math.sqrt(area * ratio)
    height = width / ratio
    return round(width / 32) * 32, round(height / 32) * 32


@dataclass
class QwenImageEditConditioning(QwenImageConditioning):
    image_latents: torch.Tensor | None = None  # [B, C, h, w]: the source's normalised VAE latents (unpacked)

    def row(self, i: int) -> QwenImageEditConditioning:
        text = super().row(i)
        return QwenImageEditConditioning(text.prompt_embeds, text.mask, self.image_latents[i : i + 1])

    @classmethod
    def concat(cls, rows: list[QwenImageEditConditioning]) -> QwenImageEditConditioning:
        text = QwenImageConditioning.concat([QwenImageConditioning(r.prompt_embeds, r.mask) for r in rows])
        return cls(text.prompt_embeds, text.mask, torch.cat([r.image_latents for r in rows]))


class QwenImageEditAdapter(EditingAdapter, QwenImageAdapter):
    """Qwen-Image-Edit behind :class:`~marble_trl.models.family.FlowModelAdapter` (an editing family)."""

    family = "qwen-image-edit"
    pipeline_class_name = "QwenImageEditPipeline"
    tiny_name = TINY_QWEN_IMAGE_EDIT_NAME
    hub_ids = ("Qwen/Qwen-Image-Edit",)
    editing = True
    pipeline_source_resolution = condition_size(PIPELINE_CONDITION_AREA)[0]
    prompt_sees_image = True

    @classmethod
    def build_tiny(cls, seed: int = 0):
        return build_tiny_qwen_image_edit_pipeline(seed)

    def encode(self, prompts, max_sequence_length, device, guidance_scale=1.0, source_images=None):
        source_images = self.check_sources(prompts, source_images)
        if self.prompt_cache is not None:
            raise ValueError(
                "cache_prompt_embeddings: Qwen-Image-Edit's prompt conditioning depends on the source image; turn "
                "the cache off (offload_text_encoders still frees the accelerator between encodings)."
            )
        pixels, image_rows = unique_images(source_images)
        pairs = list(dict.fromkeys(zip(prompts, image_rows)))  # each distinct (prompt, image) encoded once
        where = {pair: i for i, pair in enumerate(pairs)}
        embeds, mask = self._encode_pairs(pairs, pixels, max_sequence_length, device)
        latents = self.encode_images(pixels, device)
        rows = torch.tensor([where[pair] for pair in zip(prompts, image_rows)])
        cond = QwenImageEditConditioning(embeds, mask, latents[torch.tensor([k for _, k in pairs])])
        return cond.index(rows)

    def _encode_pairs(self, pairs, pixels: torch.Tensor, max_sequence_length: int, device):
        from ..rewards.images import to_pil

        pil = to_pil(pixels)
        with self.text_encoding(device):
            return self.pipeline.encode_prompt(
                prompt=[p for p, _ in pairs],
                image=[pil[k] for _, k in pairs],
                device=device,
                num_images_per_prompt=1,
                max_sequence_length=max_sequence_length,
            )

    @torch.no_grad()
    def encode_images(self, pixels: torch.Tensor, device) -> torch.Tensor:
        """``[B, 3, H, W]`` in ``[0, 1]`` -> the normalised VAE latents ``[B, C, h, w]`` (``_encode_vae_image``)."""
        vae = self.pipeline.vae
        x = (pixels.to(device).float() * 2 - 1).to(vae.dtype)[:, :, None]  # VaeImageProcessor.normalize; frames
        return vae_normalize(vae, vae.encode(x).latent_dist.mode())[:, :, 0]

    @torch.no_grad()
    def sample(self, scheduler, cond: QwenImageEditConditioning, num_steps: int, resolution: int,
               generator: torch.Generator, guidance_scale: float = 1.0,
               negative: QwenImageEditConditioning | None = None) -> torch.Tensor:  # fmt: skip
        from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit import retrieve_timesteps
        from diffusers.utils.torch_utils import randn_tensor

        if guidance_scale > 1.0 and negative is None:
            raise ValueError("guidance_scale > 1 needs the negative prompt's conditioning.")
        transformer = self.transformer
        device, dtype = cond.prompt_embeds.device, cond.prompt_embeds.dtype
        b = cond.prompt_embeds.shape[0]
        side = resolution // self.pipeline.vae_scale_factor
        channels = transformer.config.in_channels // 4
        noise = randn_tensor((b, 1, channels, side, side), generator=generator, device=device, dtype=dtype)
        latents = pack(noise[:, 0])  # the pipeline's _pack_latents of [B, 1, C, H, W]
        grid = self.training_grid(num_steps, resolution)
        with pinned_grid(scheduler, grid):
            timesteps, _ = retrieve_timesteps(
                scheduler, num_steps, device, **self.timestep_kwargs(num_steps, resolution)
            )
            scheduler.set_begin_index(0)
            for t in timesteps:
                sigma = t.expand(b).to(latents.dtype) / 1000
                x = unpack(latents, side, side)
                velocity = self.predict(transformer, x, sigma, cond)
                if guidance_scale > 1.0:
                    v_neg = self.predict(transformer, x, sigma, negative)
                    velocity = self.guided_velocity(velocity, v_neg, guidance_scale)
                latents = scheduler.step(pack(velocity), t, latents, return_dict=False)[0]
        return unpack(latents, side, side)

    @staticmethod
    def predict(module: torch.nn.Module, x_t: torch.Tensor, sigma: torch.Tensor, cond: QwenImageEditConditioning):
        _, _, h, w = x_t.shape
        source = cond.image_latents.to(x_t.dtype)
        sh, sw = source.shape[-2:]
        target = pack(x_t)
        tokens = torch.cat([target, pack(source)], dim=1)
        shapes = [(1, h // 2, w // 2), (1, sh // 2, sw // 2)]
        return unpack(qwen_velocity(module, tokens, shapes, sigma, cond)[:, : target.shape[1]], h, w)


def tiny_qwen_vl_processor(tokenizer):
    """A ``Qwen2VLProcessor`` for the tiny model: the PIL image processor at a fixed 56 x 56 (4 vision tokens).

    transformers checks a processor's video processor class even when none is given, and that class needs
    torchvision; the tiny model has no video input, so the check is skipped for ``video_processor=None`` only."""
    from unittest import mock

    from transformers import Qwen2VLProcessor
    from transformers.models.qwen2_vl import Qwen2VLImageProcessorPil

    check = Qwen2VLProcessor.check_argument_for_proper_class

    def check_except_absent_video(self, name, argument):
        return None if name == "video_processor" and argument is None else check(self, name, argument)

    image_processor = Qwen2VLImageProcessorPil(min_pixels=56 * 56, max_pixels=56 * 56)
    with mock.patch.object(Qwen2VLProcessor, "check_argument_for_proper_class", check_except_absent_video):
        return Qwen2VLProcessor(image_processor=image_processor, tokenizer=tokenizer)


def build_tiny_qwen_image_edit_pipeline(seed: int = 0):
    """A random-weight ``QwenImageEditPipeline`` from Qwen-Image-Edit's own classes: the tiny Qwen-Image's
    transformer, VAE and Qwen2.5-VL (with its one-block vision tower, fed by a tiny Qwen2-VL processor)."""
    from diffusers import QwenImageEditPipeline

    from .qwen_image import tiny_qwen_tokenizer

    tokenizer = tiny_qwen_tokenizer(vision=True)
    transformer, vae, text_encoder = seeded_build(seed, lambda: qwen_image_components(tokenizer))
    pipe = QwenImageEditPipeline(
        scheduler=tiny_dynamic_shift_scheduler(),
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        processor=tiny_qwen_vl_processor(tokenizer),
        transformer=transformer,
    )
    # As the tiny Qwen-Image: drop the template's whole system part (its byte-level tokens), so the image and the
    # prompt come first.
    prefix = pipe.prompt_template_encode.split("<|vision_start|>")[0]
    pipe.prompt_template_encode_start_idx = len(tokenizer(prefix).input_ids)
    pipe.source_resolution = TINY_SOURCE_RESOLUTION
    pipe.register_to_config(_name_or_path=TINY_QWEN_IMAGE_EDIT_NAME)
    pipe.tiny_seed = seed
    return pipe
