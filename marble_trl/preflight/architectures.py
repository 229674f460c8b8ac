"""The published architectures of the model families, built on the meta device (no weights, no download): exact
parameter counts for ``marble-trl check`` and for the memory benchmarks (``benchmarks/memory_estimate.py``,
``benchmarks/family_memory.py``), which import them from here.

Each transformer is the diffusers class with its flagship checkpoint's configuration (SD3.5 Medium's from METHOD.md
section 6; the diffusers classes' defaults are FLUX.1-dev's, Qwen-Image's, Wan2.1-T2V-14B's and Z-Image's), each text
encoder the transformers class with its ``config.json`` values written out below, each VAE its published
configuration. The reward models' CLIPs are here too (PickScore and HPSv2.1: CLIP ViT-H/14; CLIPScore and the
aesthetic predictor: CLIP ViT-L/14).

Build inside ``torch.device("meta")`` (:func:`on_meta`), and import everything first: importing ``marble_trl`` under
the meta device fails (module-level tensors).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

GIB = 1024**3

# SD3.5 Medium's transformer (METHOD.md section 6).
SD35M = dict(
    sample_size=128,
    patch_size=2,
    in_channels=16,
    num_layers=24,
    attention_head_dim=64,
    num_attention_heads=24,
    joint_attention_dim=4096,
    caption_projection_dim=1536,
    pooled_projection_dim=2048,
    out_channels=16,
    pos_embed_max_size=384,
    dual_attention_layers=tuple(range(13)),
    qk_norm="rms_norm",
)


def count(module: torch.nn.Module) -> int:
    """Number of parameters (works on the meta device)."""
    return sum(p.numel() for p in module.parameters())


def on_meta(build: Callable[[], torch.nn.Module]) -> torch.nn.Module:
    """``build()`` with every tensor on the meta device: shapes without memory."""
    with torch.device("meta"):
        return build()


# ------------------------------------------------------------------------------------------------ text encoders, VAEs
def clip_l(projection: bool = False):
    """CLIP ViT-L/14's text tower (SD3's has the projection, FLUX's not)."""
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    config = CLIPTextConfig(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
                            projection_dim=768, hidden_act="quick_gelu")  # fmt: skip
    return (CLIPTextModelWithProjection if projection else CLIPTextModel)(config)


def clip_g():
    """OpenCLIP bigG/14's text tower with its projection (SD3's second encoder)."""
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection

    return CLIPTextModelWithProjection(CLIPTextConfig(hidden_size=1280, intermediate_size=5120, num_hidden_layers=32,
                                                      num_attention_heads=20, projection_dim=1280, hidden_act="gelu"))  # fmt: skip


def t5_xxl(umt5: bool = False):
    """T5-XXL's encoder (SD3, FLUX), or UMT5-XXL's (Wan)."""
    from transformers import T5Config, T5EncoderModel, UMT5Config, UMT5EncoderModel

    config_cls, model_cls = (UMT5Config, UMT5EncoderModel) if umt5 else (T5Config, T5EncoderModel)
    return model_cls(config_cls(vocab_size=256384 if umt5 else 32128, d_model=4096, d_kv=64, d_ff=10240,
                                num_layers=24, num_heads=64, feed_forward_proj="gated-gelu"))  # fmt: skip


def qwen25_vl_7b():
    """Qwen2.5-VL-7B (Qwen-Image's text encoder)."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    return Qwen2_5_VLForConditionalGeneration(Qwen2_5_VLConfig(
        text_config=dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                         num_key_value_heads=4, vocab_size=152064,
                         rope_scaling={"mrope_section": [16, 24, 24], "rope_type": "default", "type": "default"}),
        vision_config=dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, out_hidden_size=3584),
        vocab_size=152064, hidden_size=3584))  # fmt: skip


def qwen3_4b():
    """Qwen3-4B (Z-Image's text encoder)."""
    from transformers import Qwen3Config, Qwen3Model

    return Qwen3Model(Qwen3Config(vocab_size=151936, hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
                                  num_attention_heads=32, num_key_value_heads=8, head_dim=128))  # fmt: skip


def flux_vae():
    """The 16-channel VAE of SD3 / SD3.5, FLUX.1 and Z-Image."""
    from diffusers import AutoencoderKL

    return AutoencoderKL(down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
                         block_out_channels=(128, 256, 512, 512), layers_per_block=2, latent_channels=16,
                         use_quant_conv=False, use_post_quant_conv=False)  # fmt: skip


def clip_model(text_dim, text_layers, text_heads, vision_dim, vision_layers, vision_heads, proj, patch=14):
    """A whole transformers ``CLIPModel`` (the reward models), from its tower sizes."""
    from transformers import CLIPConfig, CLIPModel

    config = CLIPConfig(
        text_config=dict(hidden_size=text_dim, intermediate_size=4 * text_dim, num_hidden_layers=text_layers,
                         num_attention_heads=text_heads),
        vision_config=dict(hidden_size=vision_dim, intermediate_size=4 * vision_dim, num_hidden_layers=vision_layers,
                           num_attention_heads=vision_heads, patch_size=patch, image_size=224),
        projection_dim=proj,
    )  # fmt: skip
    return CLIPModel(config)


def clip_vit_h14():
    return clip_model(1024, 24, 16, 1280, 32, 16, 1024)


def clip_vit_l14():
    return clip_model(768, 12, 12, 1024, 24, 16, 768)


def geneval_models():
    """The in-process GenEval reward's two models: Mask2Former Swin-S for COCO instances
    (facebook/mask2former-swin-small-coco-instance: 68.7 M parameters, the paper's 69 M) and CLIP ViT-L/14."""
    from transformers import Mask2FormerConfig, Mask2FormerForUniversalSegmentation, SwinConfig

    swin = SwinConfig(embed_dim=96, depths=[2, 2, 18, 2], num_heads=[3, 6, 12, 24], window_size=7,
                      out_features=["stage1", "stage2", "stage3", "stage4"])  # fmt: skip
    config = Mask2FormerConfig(backbone_config=swin, num_labels=80, num_queries=100, decoder_layers=10)
    return torch.nn.ModuleList([Mask2FormerForUniversalSegmentation(config), clip_vit_l14()])


# Reward models whose default weights are of known architecture: name -> builder.
REWARD_MODELS: dict[str, Callable[[], torch.nn.Module]] = {
    "pickscore": clip_vit_h14,  # yuvalkirstain/PickScore_v1
    "hpsv2": clip_vit_h14,  # HPSv2.1, open_clip ViT-H-14 run as a transformers CLIPModel
    "clipscore": clip_vit_l14,  # openai/clip-vit-large-patch14
    "clip_directional": clip_vit_l14,  # the same CLIP (an editing reward)
    "aesthetic": clip_vit_l14,  # the same CLIP, plus a 0.9 M parameter MLP (not counted)
    "geneval": geneval_models,  # its default detector and CLIP (detector_name_or_path, clip_name_or_path)
}


# ------------------------------------------------------------------------------------------------ transformers
@dataclass(frozen=True)
class Architecture:
    """One published transformer of a family, with its frozen companions.

    ``build(**overrides)`` makes the transformer (on the current device: wrap in :func:`on_meta`); ``blocks`` are
    the configuration keys counting its blocks; ``width`` its hidden size; ``text_encoders`` and ``vae`` build the
    other frozen models; ``measured`` names its entry in the shipped measurements (``measured_memory.json``)."""

    name: str
    family: str
    hub_ids: tuple[str, ...]
    build: Callable[..., torch.nn.Module]
    blocks: dict[str, int]
    width: int
    text_encoders: dict[str, Callable[[], torch.nn.Module]]
    vae: Callable[[], torch.nn.Module]
    measured: str | None = None
    notes: tuple[str, ...] = field(default=())

    def tokens(self, resolution: int, max_sequence_length: int, num_frames: int | None = None) -> int:
        """Tokens of one sample in the transformer's sequence (what activations scale with): image tokens (16 pixels
        per token side: the VAE's 8 times the 2x2 patch) plus the text tokens that join the sequence."""
        image = (resolution // 16) ** 2
        source = (1024 // 16) ** 2  # an editing family's source tokens: both pipelines condition on ~1024 x 1024
        vision = (1024 // 28) ** 2  # Qwen-Image-Edit's prompt holds the source's vision tokens (14 px x 2x2 merge)
        if self.family == "flux-kontext":
            return image + source + max_sequence_length
        if self.family == "qwen-image-edit":
            return image + source + vision + min(max_sequence_length, 128)
        if self.family == "wan":  # the text enters by cross-attention; 4 frames per latent frame after the first
            frames = num_frames if num_frames is not None else 81
            return image * ((frames - 1) // 4 + 1)
        if self.family == "sd3":
            return image + 77 + max_sequence_length  # CLIP's 77 + T5's sequence
        if self.family == "flux":
            return image + max_sequence_length  # T5 padded to max_sequence_length
        return image + min(max_sequence_length, 128)  # Qwen-Image, Z-Image: each prompt's length (measured at 128)


def _sd3(**overrides):
    from diffusers import SD3Transformer2DModel

    return SD3Transformer2DModel(**{**SD35M, **overrides})


def _flux(guidance: bool) -> Callable[..., torch.nn.Module]:
    def build(**overrides):
        from diffusers import FluxTransformer2DModel

        return FluxTransformer2DModel(guidance_embeds=guidance, **overrides)

    return build


def _diffusers_default(class_name: str) -> Callable[..., torch.nn.Module]:
    def build(**overrides):
        import diffusers

        return getattr(diffusers, class_name)(**overrides)

    return build


def _qwen_image_vae():
    from diffusers import AutoencoderKLQwenImage

    return AutoencoderKLQwenImage()


def _wan_vae():
    from diffusers import AutoencoderKLWan

    return AutoencoderKLWan()


ARCHITECTURES: tuple[Architecture, ...] = (
    Architecture(
        "SD3.5-Medium", "sd3", ("stabilityai/stable-diffusion-3.5-medium",), _sd3, {"num_layers": 24}, 1536,
        {"clip_l": lambda: clip_l(projection=True), "clip_g": clip_g, "t5_xxl": t5_xxl}, flux_vae, "SD3.5-Medium",
    ),
    Architecture(
        "FLUX.1-dev", "flux", ("black-forest-labs/FLUX.1-dev", "black-forest-labs/FLUX.1-Krea-dev"), _flux(True),
        {"num_layers": 19, "num_single_layers": 38}, 3072, {"clip_l": clip_l, "t5_xxl": t5_xxl}, flux_vae,
        "FLUX.1-dev",
    ),
    Architecture(
        "FLUX.1-schnell", "flux", ("black-forest-labs/FLUX.1-schnell",), _flux(False),
        {"num_layers": 19, "num_single_layers": 38}, 3072, {"clip_l": clip_l, "t5_xxl": t5_xxl}, flux_vae,
        "FLUX.1-dev", ("activations: FLUX.1-dev's measurement (the same blocks, without the guidance embedding)",),
    ),
    Architecture(
        "Qwen-Image", "qwen-image", ("Qwen/Qwen-Image",), _diffusers_default("QwenImageTransformer2DModel"),
        {"num_layers": 60}, 3072, {"qwen2.5_vl_7b": qwen25_vl_7b}, _qwen_image_vae, "Qwen-Image",
    ),
    Architecture(
        "FLUX.1-Kontext-dev", "flux-kontext", ("black-forest-labs/FLUX.1-Kontext-dev",), _flux(True),
        {"num_layers": 19, "num_single_layers": 38}, 3072, {"clip_l": clip_l, "t5_xxl": t5_xxl}, flux_vae,
        "FLUX.1-dev", ("activations: FLUX.1-dev's per-token measurement, over the target's and the source's tokens",),
    ),
    Architecture(
        "Qwen-Image-Edit", "qwen-image-edit", ("Qwen/Qwen-Image-Edit",),
        _diffusers_default("QwenImageTransformer2DModel"), {"num_layers": 60}, 3072, {"qwen2.5_vl_7b": qwen25_vl_7b},
        _qwen_image_vae, "Qwen-Image",
        ("activations: Qwen-Image's per-token measurement, over the target's, the source's and the prompt's vision "
         "tokens",),
    ),
    Architecture(
        "Wan2.1-T2V-14B", "wan", ("Wan-AI/Wan2.1-T2V-14B-Diffusers",), _diffusers_default("WanTransformer3DModel"),
        {"num_layers": 40}, 5120, {"umt5_xxl": lambda: t5_xxl(umt5=True)}, _wan_vae, "Wan2.1-T2V-14B",
    ),
    Architecture(
        "Z-Image", "z-image", ("Tongyi-MAI/Z-Image", "Tongyi-MAI/Z-Image-Turbo"),
        _diffusers_default("ZImageTransformer2DModel"), {"n_layers": 30}, 3840, {"qwen3_4b": qwen3_4b}, flux_vae,
        "Z-Image",
    ),
)  # fmt: skip


def architecture_named(name: str) -> Architecture:
    for arch in ARCHITECTURES:
        if arch.name == name:
            return arch
    raise KeyError(f"No recorded architecture {name!r} (known: {[a.name for a in ARCHITECTURES]}).")


def architecture_of_hub_id(hub_id: str) -> Architecture | None:
    """The recorded architecture of a published repo, ``None`` for one not recorded here."""
    return next((a for a in ARCHITECTURES if hub_id in a.hub_ids), None)


def block_parameters(transformer: torch.nn.Module) -> tuple[int, int]:
    """``(largest block, root)`` parameter counts: the blocks are the modules of the classes in diffusers'
    ``_no_split_modules`` (what FSDP2 wraps one by one), the root everything else."""
    names = set(getattr(transformer, "_no_split_modules", None) or ())
    blocks = [count(m) for m in transformer.modules() if type(m).__name__ in names]
    return (max(blocks) if blocks else 0), count(transformer) - sum(blocks)


def frozen_counts(arch: Architecture) -> dict[str, Any]:
    """Parameter counts of an architecture's text encoders and VAE (each built on the meta device)."""
    out = {name: count(on_meta(make)) for name, make in arch.text_encoders.items()}
    out["vae"] = count(on_meta(arch.vae))
    return out


def lora_parameter_count(transformer: torch.nn.Module, lora_config) -> int:
    """Parameters of the trainable LoRA adapter, added under the trainer's adapter name with peft (the old-policy
    adapter the trainer adds next has the same shape; :func:`marble_trl.policy.lora.add_policy_adapters` copies values, which
    the meta device does not hold). peft raises when no module matches. ``transformer`` is modified."""
    from ..policy.lora import TRAIN_ADAPTER, lora_parameters

    on = next(transformer.parameters()).device
    with torch.device(on) if on.type == "meta" else contextlib.nullcontext():  # peft makes its layers on CPU else
        transformer.add_adapter(lora_config, adapter_name=TRAIN_ADAPTER)
    return sum(p.numel() for p in lora_parameters(transformer, TRAIN_ADAPTER).values())
