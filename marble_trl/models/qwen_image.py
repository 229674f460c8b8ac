"""Qwen-Image (``QwenImagePipeline``, ``QwenImageTransformer2DModel``).

What differs from SD3:

- **Prompts.** Qwen2.5-VL's last hidden states of the prompt inside the pipeline's chat template (the template's
  first 34 tokens dropped), padded to the batch's longest prompt with an attention mask (``None`` when no row is
  padded).
- **Packed latents** (2x2 patches, as FLUX) of a video-shaped VAE latent ``[B, C, 1, H, W]``; the adapter's latent
  space is the unpacked ``[B, C, H, W]``, ``decode`` adds the frame axis and applies the VAE's latent mean and std.
- **Guidance.** ``guidance_scale > 1`` is the pipeline's *true CFG* (``true_cfg_scale`` with the negative prompt),
  which rescales the guided velocity of each token to the norm of the conditional one
  (:meth:`QwenImageAdapter.guided_velocity`). Guidance-distilled checkpoints (``guidance_embeds``) are not supported.
- **Sigma grid.** ``linspace(1, 1/N, N)`` with the dynamic shift ``mu`` of the image token count, as FLUX.
- **Timestep.** The transformer takes the flow time ``sigma``.

Default LoRA targets: those of diffusers' ``train_dreambooth_lora_qwen_image.py`` (``to_k``, ``to_q``, ``to_v``,
``to_out.0``: the image stream's attention projections of every block).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import RowConditioning, vae_denormalize
from .flux import PackedLatentAdapter, pack, unpack
from .loading import seeded_build
from .tiny import TINY_QWEN_IMAGE_NAME, tiny_dynamic_shift_scheduler

QWEN_IMAGE_LORA_TARGETS = ("to_k", "to_q", "to_v", "to_out.0")


@dataclass
class QwenImageConditioning(RowConditioning):
    prompt_embeds: torch.Tensor  # [B, tokens, hidden]
    mask: torch.Tensor | None  # [B, tokens] (1 = a real token), None when no row is padded

    def row(self, i: int) -> QwenImageConditioning:
        length = int(self.mask[i].sum()) if self.mask is not None else self.prompt_embeds.shape[1]
        return QwenImageConditioning(self.prompt_embeds[i : i + 1, :length], None)

    @classmethod
    def concat(cls, rows: list[QwenImageConditioning]) -> QwenImageConditioning:
        """As ``QwenImagePipeline.encode_prompt`` batches them: zero-padded to the longest, mask ``None`` if none is."""
        lengths = [r.prompt_embeds.shape[1] for r in rows]
        longest = max(lengths)
        embeds = torch.cat(
            [torch.nn.functional.pad(r.prompt_embeds, (0, 0, 0, longest - n)) for r, n in zip(rows, lengths)]
        )
        if min(lengths) == longest:
            return cls(embeds, None)
        mask = torch.stack([torch.arange(longest, device=embeds.device) < n for n in lengths]).long()
        return cls(embeds, mask)


class QwenImageAdapter(PackedLatentAdapter):
    """Qwen-Image behind :class:`~marble_trl.models.family.FlowModelAdapter`."""

    family = "qwen-image"
    pipeline_class_name = "QwenImagePipeline"
    tiny_name = TINY_QWEN_IMAGE_NAME
    hub_ids = ("Qwen/Qwen-Image",)
    default_lora_targets = QWEN_IMAGE_LORA_TARGETS

    def __init__(self, pipeline) -> None:
        if pipeline.transformer.config.get("guidance_embeds", False):
            raise ValueError(
                "Guidance-distilled Qwen-Image transformers (guidance_embeds=True) are not supported yet."
            )
        super().__init__(pipeline)

    @classmethod
    def build_tiny(cls, seed: int = 0):
        return build_tiny_qwen_image_pipeline(seed)

    def _encode(self, prompts, max_sequence_length, device, guidance_scale) -> QwenImageConditioning:
        embeds, mask = self.pipeline.encode_prompt(
            prompt=prompts, device=device, num_images_per_prompt=1, max_sequence_length=max_sequence_length
        )
        return QwenImageConditioning(embeds, mask)

    @classmethod
    def call_kwargs(cls, guidance_scale: float) -> dict:
        return {"true_cfg_scale": guidance_scale, "negative_prompt": " "} if guidance_scale > 1.0 else {}

    @staticmethod
    def guided_velocity(v_cond: torch.Tensor, v_uncond: torch.Tensor, scale: float) -> torch.Tensor:
        """The pipeline's true CFG: the guided velocity rescaled, token by token, to the conditional one's norm."""
        b, _, h, w = v_cond.shape
        cond, uncond = pack(v_cond), pack(v_uncond)
        guided = uncond + scale * (cond - uncond)
        guided = guided * (cond.norm(dim=-1, keepdim=True) / guided.norm(dim=-1, keepdim=True))
        return unpack(guided, h, w)

    @torch.no_grad()
    def sample(self, scheduler, cond: QwenImageConditioning, num_steps: int, resolution: int,
               generator: torch.Generator, guidance_scale: float = 1.0,
               negative: QwenImageConditioning | None = None) -> torch.Tensor:  # fmt: skip
        cfg = {}
        if guidance_scale > 1.0:
            if negative is None:
                raise ValueError("guidance_scale > 1 needs the negative prompt's conditioning.")
            cfg = dict(negative_prompt_embeds=negative.prompt_embeds, negative_prompt_embeds_mask=negative.mask)
            if negative.mask is None:  # the pipeline tells CFG on from a given negative mask
                cfg["negative_prompt_embeds_mask"] = torch.ones(negative.prompt_embeds.shape[:2], dtype=torch.long,
                                                                device=negative.prompt_embeds.device)  # fmt: skip
        out = self.call_for_latents(
            scheduler,
            num_steps,
            resolution,
            generator,
            prompt_embeds=cond.prompt_embeds,
            prompt_embeds_mask=cond.mask,
            true_cfg_scale=guidance_scale,
            **cfg,
        )
        side = resolution // self.pipeline.vae_scale_factor
        return unpack(out.images, side, side)

    @staticmethod
    def predict(module: torch.nn.Module, x_t: torch.Tensor, sigma: torch.Tensor, cond: QwenImageConditioning):
        _, _, h, w = x_t.shape
        return unpack(qwen_velocity(module, pack(x_t), [(1, h // 2, w // 2)], sigma, cond), h, w)

    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        vae = self.pipeline.vae
        images = vae.decode(vae_denormalize(vae, latents[:, :, None]), return_dict=False)[0][:, :, 0]
        return (images.float() / 2 + 0.5).clamp(0, 1)


VISION_SPECIALS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")


def qwen_velocity(module: torch.nn.Module, tokens: torch.Tensor, shapes: list, sigma: torch.Tensor, cond):
    """The Qwen-Image transformer's output on packed ``tokens`` made of the latents of ``shapes`` (``(frames, h, w)``
    each, in packed units: Qwen-Image-Edit appends the source's to the target's)."""
    return module(
        hidden_states=tokens,
        timestep=sigma.expand(tokens.shape[0]).to(tokens.dtype),
        encoder_hidden_states=cond.prompt_embeds,
        encoder_hidden_states_mask=cond.mask,
        img_shapes=[shapes] * tokens.shape[0],
        return_dict=False,
    )[0]


def tiny_qwen_tokenizer(vision: bool = False):
    """A byte-level BPE tokenizer without merges (one token per byte) and Qwen's chat specials (and, with ``vision``,
    Qwen2.5-VL's vision specials, for Qwen-Image-Edit's image prompts): no download."""
    from tokenizers.pre_tokenizers import ByteLevel
    from transformers import Qwen2Tokenizer

    vocab = {c: i for i, c in enumerate(sorted(ByteLevel.alphabet()))}
    specials = ["<|im_start|>", "<|im_end|>", *(VISION_SPECIALS if vision else ())]
    for special in ("<|endoftext|>", *specials):
        vocab[special] = len(vocab)
    tokenizer = Qwen2Tokenizer(
        vocab=vocab, merges=[], unk_token=None, eos_token="<|im_end|>", pad_token="<|endoftext|>"
    )
    tokenizer.add_special_tokens({"additional_special_tokens": specials})
    return tokenizer


def qwen_image_components(tokenizer):
    """The tiny Qwen-Image's transformer, VAE and Qwen2.5-VL (random weights; call under a seed); the VL model's
    special-token ids are ``tokenizer``'s when it has the vision specials (Qwen-Image-Edit's)."""
    from diffusers import AutoencoderKLQwenImage, QwenImageTransformer2DModel
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    vocab, pad, eos = len(tokenizer), tokenizer.pad_token_id, tokenizer.eos_token_id
    ids = {name: vocab - k for name, k in (("vision_start_token_id", 4), ("vision_end_token_id", 5),
                                           ("image_token_id", 7), ("video_token_id", 8))}  # fmt: skip
    if "<|image_pad|>" in tokenizer.get_vocab():
        ids = {
            "vision_start_token_id": tokenizer.convert_tokens_to_ids("<|vision_start|>"),
            "vision_end_token_id": tokenizer.convert_tokens_to_ids("<|vision_end|>"),
            "image_token_id": tokenizer.convert_tokens_to_ids("<|image_pad|>"),
            "video_token_id": tokenizer.convert_tokens_to_ids("<|video_pad|>"),
        }
    transformer = QwenImageTransformer2DModel(
        patch_size=2,
        in_channels=64,
        out_channels=16,
        num_layers=2,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=16,
        guidance_embeds=False,
        axes_dims_rope=(4, 4, 8),
    )
    vae = AutoencoderKLQwenImage(
        base_dim=4, z_dim=16, dim_mult=[1, 1, 1], num_res_blocks=1, temperal_downsample=[False, True]
    )
    config = Qwen2_5_VLConfig(
        text_config={
            "hidden_size": 16, "intermediate_size": 16, "num_hidden_layers": 2, "num_attention_heads": 2,
            "num_key_value_heads": 2, "vocab_size": vocab, "bos_token_id": eos, "eos_token_id": eos,
            "pad_token_id": pad, "rope_theta": 1000000.0,
            "rope_scaling": {"mrope_section": [1, 1, 2], "rope_type": "default", "type": "default"},
        },
        vision_config={"depth": 1, "hidden_size": 16, "intermediate_size": 16, "num_heads": 2, "out_hidden_size": 16},
        hidden_size=16, vocab_size=vocab, vision_token_id=vocab - 6, **ids,
    )  # fmt: skip
    return transformer.eval(), vae.eval(), Qwen2_5_VLForConditionalGeneration(config).eval()


def build_tiny_qwen_image_pipeline(seed: int = 0):
    """A random-weight ``QwenImagePipeline`` from Qwen-Image's own classes (as diffusers' tests build one): two
    blocks, a Qwen-Image VAE with 4x compression and 16 latent channels, a tiny Qwen2.5-VL."""
    from diffusers import QwenImagePipeline

    tokenizer = tiny_qwen_tokenizer()
    transformer, vae, text_encoder = seeded_build(seed, lambda: qwen_image_components(tokenizer))
    scheduler = tiny_dynamic_shift_scheduler()
    pipe = QwenImagePipeline(
        scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer, transformer=transformer
    )
    # The pipeline drops the template's first 34 tokens (its system part under Qwen's tokenizer); the byte-level tiny
    # tokenizer spells that part in more tokens: drop all of them, so that the prompt's tokens come first (the tiny
    # model built by name; a saved folder reloads with the pipeline's default 34).
    prefix = pipe.prompt_template_encode.split("{}")[0]
    pipe.prompt_template_encode_start_idx = len(tokenizer(prefix).input_ids)
    pipe.register_to_config(_name_or_path=TINY_QWEN_IMAGE_NAME)
    pipe.tiny_seed = seed
    return pipe
