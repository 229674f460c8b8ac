"""Z-Image (``ZImagePipeline``, ``ZImageTransformer2DModel``): Z-Image and Z-Image-Turbo.

The fourth family, chosen over SANA and FLUX.2 klein because it has by far the most users of the three (Z-Image-Turbo
is among the Hub's most downloaded text-to-image models since its release, and Flow-Factory trains it) and still fits
the seam: everything it does differently stays inside the adapter.

- **Per-sample lists.** The transformer takes a list of latents ``[C, 1, H, W]`` and a list of prompt embeddings of
  each prompt's own length (no padding), and returns a list; ``predict`` converts to and from the batch tensor.
- **Velocity sign and time.** It predicts ``x0 - eps`` at ``1 - sigma`` (the pipeline negates its output and passes
  ``(1000 - t) / 1000``); ``predict`` returns the trainer's ``v = eps - x0`` at ``sigma``.
- **Guidance.** Z-Image's ``guidance_scale`` ``g`` is ``pos + g (pos - neg)``, CFG off at 0 (Turbo); the trainer's
  ``guidance_scale`` ``s`` is plain CFG (``neg + s (pos - neg)``), so the adapter passes ``g = s - 1`` (no CFG for
  ``s <= 1``). Z-Image's optional ``cfg_normalization`` / ``cfg_truncation`` are left off.
- **Prompts.** Qwen3's second-to-last hidden states of the prompt in its chat template (padding tokens dropped).
- **Sigma grid.** ``linspace(1, 1/N, N)`` with the dynamic shift ``mu`` of the image token count.
- **VAE.** FLUX's (scaling and shift factor), latents ``[B, 16, H/8, W/8]`` unpacked.

Default LoRA targets: the attention projections of every block (``to_q``, ``to_k``, ``to_v``, ``to_out.0``), as
for Qwen-Image. The patch embedder is never a target: it runs on the samples' tokens concatenated, which the
two-stream engine's per-sample taps cannot split (its assumptions, ``marble_trl.balance.engines``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from .base import vae_decode
from .flux import PackedLatentAdapter
from .loading import seeded_build
from .qwen_image import tiny_qwen_tokenizer
from .tiny import TINY_Z_IMAGE_NAME, tiny_autoencoder_kl, tiny_dynamic_shift_scheduler

Z_IMAGE_LORA_TARGETS = ("to_q", "to_k", "to_v", "to_out.0")

# The chat template of the tiny tokenizer (Qwen3's, less the tool and thinking branches the pipeline does not use).
_TINY_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@dataclass
class ZImageConditioning:
    prompt_embeds: list[torch.Tensor]  # one [tokens_i, cap_feat_dim] per row

    def index(self, idx: Any) -> ZImageConditioning:
        rows = idx.tolist() if isinstance(idx, torch.Tensor) else idx
        if isinstance(rows, slice):
            return ZImageConditioning(self.prompt_embeds[rows])
        return ZImageConditioning([self.prompt_embeds[i] for i in rows])

    def row(self, i: int) -> ZImageConditioning:
        return ZImageConditioning([self.prompt_embeds[i]])

    @classmethod
    def concat(cls, rows: list[ZImageConditioning]) -> ZImageConditioning:
        return cls([e for r in rows for e in r.prompt_embeds])

    def to(self, device) -> ZImageConditioning:
        return ZImageConditioning([e.to(device) for e in self.prompt_embeds])


class ZImageAdapter(PackedLatentAdapter):
    """Z-Image / Z-Image-Turbo behind :class:`~marble_trl.models.family.FlowModelAdapter`."""

    family = "z-image"
    pipeline_class_name = "ZImagePipeline"
    tiny_name = TINY_Z_IMAGE_NAME
    hub_ids = ("Tongyi-MAI/Z-Image", "Tongyi-MAI/Z-Image-Turbo")
    default_lora_targets = Z_IMAGE_LORA_TARGETS

    @classmethod
    def build_tiny(cls, seed: int = 0):
        return build_tiny_z_image_pipeline(seed)

    @classmethod
    def call_kwargs(cls, guidance_scale: float) -> dict:
        return {"guidance_scale": max(guidance_scale - 1.0, 0.0)}  # Z-Image's scale is ours minus 1

    def timestep_kwargs(self, num_steps: int, resolution: int) -> dict:
        kwargs = super().timestep_kwargs(num_steps, resolution)
        kwargs["sigmas"] = torch.linspace(
            1.0, 1 / num_steps, num_steps
        ).tolist()  # get_default_z_image_sigmas (float32)
        return kwargs

    def _encode(self, prompts, max_sequence_length, device, guidance_scale) -> ZImageConditioning:
        embeds = self.pipeline._encode_prompt(list(prompts), device=device, max_sequence_length=max_sequence_length)
        return ZImageConditioning(list(embeds))

    @torch.no_grad()
    def sample(self, scheduler, cond: ZImageConditioning, num_steps: int, resolution: int, generator: torch.Generator,
               guidance_scale: float = 1.0, negative: ZImageConditioning | None = None) -> torch.Tensor:  # fmt: skip
        cfg: dict = {"guidance_scale": 0.0}
        if guidance_scale > 1.0:
            if negative is None:
                raise ValueError("guidance_scale > 1 needs the negative prompt's conditioning.")
            cfg = {"guidance_scale": guidance_scale - 1.0, "negative_prompt_embeds": negative.prompt_embeds}
        out = self.call_for_latents(
            scheduler,
            num_steps,
            resolution,
            generator,
            prompt_embeds=cond.prompt_embeds,
            **cfg,
        )
        return out.images

    @staticmethod
    def predict(module: torch.nn.Module, x_t: torch.Tensor, sigma: torch.Tensor, cond: ZImageConditioning):
        time = (1.0 - sigma.expand(x_t.shape[0])).to(x_t.dtype)
        dtype = cond.prompt_embeds[0].dtype
        out = module(list(x_t.to(dtype).unsqueeze(2).unbind(0)), time, cond.prompt_embeds, return_dict=False)[0]
        return -torch.stack(out).squeeze(2).to(x_t.dtype)

    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        return vae_decode(self.pipeline.vae, latents)


def build_tiny_z_image_pipeline(seed: int = 0):
    """A random-weight ``ZImagePipeline`` from Z-Image's own classes: two blocks and one refiner block per stream,
    a 2x VAE with 16 latent channels (FLUX's layout), a tiny Qwen3 with a byte-level tokenizer."""
    from diffusers import ZImagePipeline, ZImageTransformer2DModel
    from transformers import Qwen3Config, Qwen3Model

    tokenizer = tiny_qwen_tokenizer()
    tokenizer.chat_template = _TINY_CHAT_TEMPLATE

    def build():
        transformer = ZImageTransformer2DModel(
            all_patch_size=(2,),
            all_f_patch_size=(1,),
            in_channels=16,
            dim=32,
            n_layers=2,
            n_refiner_layers=1,
            n_heads=2,
            n_kv_heads=2,
            cap_feat_dim=16,
            axes_dims=[4, 6, 6],
            axes_lens=[256, 32, 32],
        )
        vae = tiny_autoencoder_kl(16, 32, shift_factor=0.1159, scaling_factor=0.3611)  # FLUX's VAE layout
        config = Qwen3Config(
            vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32, num_hidden_layers=2,
            num_attention_heads=2, num_key_value_heads=2, head_dim=8, pad_token_id=tokenizer.pad_token_id,
            bos_token_id=tokenizer.eos_token_id, eos_token_id=tokenizer.eos_token_id,
        )  # fmt: skip
        return transformer.eval(), vae.eval(), Qwen3Model(config).eval()

    transformer, vae, text_encoder = seeded_build(seed, build)
    scheduler = tiny_dynamic_shift_scheduler()
    pipe = ZImagePipeline(
        scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer, transformer=transformer
    )
    pipe.register_to_config(_name_or_path=TINY_Z_IMAGE_NAME)
    pipe.tiny_seed = seed
    return pipe
