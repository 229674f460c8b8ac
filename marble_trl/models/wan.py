"""Wan 2.1 / 2.2 text-to-video (``WanPipeline``, ``WanTransformer3DModel``): the first video family.

What differs from SD3:

- **Video latents** ``[B, C, F', H', W']`` (``F' = (F - 1) / 4 + 1`` for Wan's VAE); :meth:`WanAdapter.decode`
  returns videos ``[B, F, 3, H, W]`` in ``[0, 1]``, the reward contract's video format (``marble_trl.rewards.video``:
  image rewards are lifted to videos, ``videos``-taking rewards get them whole).
- **Prompts.** UMT5-XXL sequences, zero-padded to ``max_sequence_length`` (Wan: 512; the pipeline's default 226).
- **Timestep.** The transformer takes ``1000 sigma`` (the scheduler's timesteps); Wan 2.2 TI2V-5B's
  ``expand_timesteps`` gives one timestep per latent token.
- **CFG** with the negative prompt (``guidance_scale > 1``), as the pipeline does it.
- **Scheduler.** Wan checkpoints ship ``UniPCMultistepScheduler`` with flow sigmas and ``flow_shift``; the rollout
  solvers read ``flow_shift`` as the flow-matching ``shift`` (:func:`marble_trl.rollout.solvers.flow_config`).

Not supported: Wan 2.2 A14B's two experts (``transformer_2`` with ``boundary_ratio``): one LoRA per expert and the
switch at the boundary time would change the trainer's one-policy assumption; the adapter refuses such a pipeline.

Default LoRA targets: the attention projections of every block (self- and cross-attention), as the community's Wan
LoRA trainers (Flow-GRPO, DiffSynth) use.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import DiffusersFlowAdapter, RowConditioning, vae_denormalize
from .loading import seeded_build
from .tiny import TINY_WAN_NAME, tiny_t5_encoder, tiny_t5_tokenizer

WAN_LORA_TARGETS = ("to_q", "to_k", "to_v", "to_out.0")
WAN_DEFAULT_FRAMES = 81  # the pipeline's default (5 s at 16 fps)


@dataclass
class WanConditioning(RowConditioning):
    prompt_embeds: torch.Tensor  # [B, tokens, text_dim] (UMT5, zero-padded)


class WanAdapter(DiffusersFlowAdapter):
    """Wan 2.1 / 2.2 (single transformer) text-to-video behind :class:`~marble_trl.models.family.FlowModelAdapter`."""

    family = "wan"
    pipeline_class_name = "WanPipeline"
    tiny_name = TINY_WAN_NAME
    hub_ids = (
        "Wan-AI/Wan2.1-T2V-1.3B-Diffusers",
        "Wan-AI/Wan2.1-T2V-14B-Diffusers",
        "Wan-AI/Wan2.2-T2V-A14B-Diffusers",
        "Wan-AI/Wan2.2-TI2V-5B-Diffusers",
    )
    default_lora_targets = WAN_LORA_TARGETS
    video = True

    def __init__(self, pipeline, num_frames: int | None = None) -> None:
        if getattr(pipeline, "transformer_2", None) is not None:
            raise ValueError(
                "This Wan pipeline has two experts (transformer_2, Wan 2.2 A14B); marble_trl trains one transformer. "
                "Use Wan 2.1 or Wan 2.2 TI2V-5B, or pass the pipeline with transformer_2=None and boundary_ratio=None "
                "to train the high-noise expert alone."
            )
        super().__init__(pipeline)
        self.num_frames = num_frames or getattr(pipeline, "tiny_num_frames", WAN_DEFAULT_FRAMES)

    @classmethod
    def build_tiny(cls, seed: int = 0):
        return build_tiny_wan_pipeline(seed)

    @property
    def latent_factor(self) -> int:
        return self.pipeline.vae_scale_factor_spatial * self.pipeline.transformer.config.patch_size[-1]

    def _encode(self, prompts, max_sequence_length, device, guidance_scale) -> WanConditioning:
        embeds, _ = self.pipeline.encode_prompt(
            prompt=prompts, do_classifier_free_guidance=False, max_sequence_length=max_sequence_length, device=device
        )
        return WanConditioning(embeds)

    @torch.no_grad()
    def sample(self, scheduler, cond: WanConditioning, num_steps: int, resolution: int, generator: torch.Generator,
               guidance_scale: float = 1.0, negative: WanConditioning | None = None) -> torch.Tensor:  # fmt: skip
        if guidance_scale > 1.0 and negative is None:
            raise ValueError("guidance_scale > 1 needs the negative prompt's conditioning.")
        out = self.call_for_latents(
            scheduler,
            num_steps,
            resolution,
            generator,
            prompt_embeds=cond.prompt_embeds,
            negative_prompt_embeds=negative.prompt_embeds if guidance_scale > 1.0 else None,
            guidance_scale=guidance_scale,
            num_frames=self.num_frames,
        )
        return out.frames

    def predict(self, module: torch.nn.Module, x_t: torch.Tensor, sigma: torch.Tensor, cond: WanConditioning):
        timestep = sigma.expand(x_t.shape[0]) * 1000.0
        if self.pipeline.config.get("expand_timesteps", False):  # Wan 2.2 TI2V: one timestep per latent token
            _, p_t, p_h, p_w = (1, *self.pipeline.transformer.config.patch_size)
            f, h, w = x_t.shape[2] // p_t, x_t.shape[3] // p_h, x_t.shape[4] // p_w
            timestep = timestep[:, None].expand(-1, f * h * w)
        return module(
            hidden_states=x_t, timestep=timestep, encoder_hidden_states=cond.prompt_embeds, return_dict=False
        )[0]

    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        vae = self.pipeline.vae
        video = vae.decode(vae_denormalize(vae, latents), return_dict=False)[0]  # [B, 3, F, H, W] in [-1, 1]
        return (video.float().permute(0, 2, 1, 3, 4) / 2 + 0.5).clamp(0, 1)


def build_tiny_wan_pipeline(seed: int = 0, num_frames: int = 5):
    """A random-weight ``WanPipeline`` from Wan's own classes (as diffusers' tests build one): two blocks, a Wan VAE
    with 4x spatial and 2x temporal compression, a tiny UMT5; videos of ``num_frames`` frames by default."""
    from diffusers import AutoencoderKLWan, FlowMatchEulerDiscreteScheduler, WanPipeline, WanTransformer3DModel

    def build():
        transformer = WanTransformer3DModel(
            patch_size=(1, 2, 2),
            num_attention_heads=2,
            attention_head_dim=12,
            in_channels=16,
            out_channels=16,
            text_dim=32,
            freq_dim=32,
            ffn_dim=32,
            num_layers=2,
            cross_attn_norm=True,
            qk_norm="rms_norm_across_heads",
            rope_max_seq_len=32,
        )
        vae = AutoencoderKLWan(
            base_dim=3,
            z_dim=16,
            dim_mult=[1, 1, 1],
            num_res_blocks=1,
            temperal_downsample=[False, True],
            scale_factor_spatial=4,
            scale_factor_temporal=2,
        )
        return transformer.eval(), vae.eval(), tiny_t5_encoder(32, umt5=True)

    transformer, vae, text_encoder = seeded_build(seed, build)
    pipe = WanPipeline(
        tokenizer=tiny_t5_tokenizer(),
        text_encoder=text_encoder,
        vae=vae,
        scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
        transformer=transformer,
    )
    pipe.register_to_config(_name_or_path=TINY_WAN_NAME)
    pipe.tiny_seed = seed
    pipe.tiny_num_frames = num_frames
    return pipe
