"""The offline models: the tiny random SD3 pipeline (tests, smoke recipes) and the ``shapes`` model (the ShapesBench
base model shipped in the package, the README's main job).

``build_tiny_sd3_pipeline`` assembles a complete :class:`diffusers.StableDiffusion3Pipeline` with random weights from a
seed: a tiny SD3(.5) transformer, a tiny VAE, two tiny CLIP text encoders with tokenizers built from an in-memory
character vocabulary, no T5 (the pipeline then uses zeros for the T5 part of the prompt embedding). Nothing is
downloaded.

``save_tiny_sd3_pipeline(folder, seed=0)`` writes it as a diffusers folder that loads with plain
``StableDiffusion3Pipeline.from_pretrained(folder)``, like any Hub checkpoint: the saved pipeline carries a placeholder
T5 (``text_encoder_3``, ``tokenizer_3``) whose output is exactly zero, so it generates the same images as the built one
(diffusers' SD3 loader refuses a folder without T5 unless ``text_encoder_3=None, tokenizer_3=None`` are passed).
"""

from __future__ import annotations

import os
import string
from pathlib import Path

import torch

from ..artifacts import SHIPPED_WEIGHTS

TINY_MODEL_NAME = "tiny"
# Every family's offline random model (models/<family>.py builds it): usable as --model_name_or_path like "tiny".
TINY_FLUX_NAME = "tiny-flux"
TINY_WAN_NAME = "tiny-wan"
TINY_QWEN_IMAGE_NAME = "tiny-qwen-image"
TINY_Z_IMAGE_NAME = "tiny-z-image"
TINY_FLUX_KONTEXT_NAME = "tiny-flux-kontext"
TINY_QWEN_IMAGE_EDIT_NAME = "tiny-qwen-image-edit"
TINY_SOURCE_RESOLUTION = 32  # the tiny editing models' source images (the real ones condition on about 1024 x 1024)
TINY_MODEL_NAMES = (
    TINY_MODEL_NAME,
    TINY_FLUX_NAME,
    TINY_WAN_NAME,
    TINY_QWEN_IMAGE_NAME,
    TINY_Z_IMAGE_NAME,
    TINY_FLUX_KONTEXT_NAME,
    TINY_QWEN_IMAGE_EDIT_NAME,
)
# The ShapesBench base model shipped inside the package (marble_trl/shapesbench/weights/shapes): a tiny SD3.5-
# architecture pipeline pretrained on the ShapesBench world, the README's main job (docs/shapesbench.md).
SHAPES_MODEL_NAME = "shapes"
# Its editing sibling (marble_trl/shapesbench/weights/shapes-edit): a tiny FLUX.1 Kontext pipeline pretrained on the
# ShapesBench editing world (marble_trl.shapesbench.edit_pretrain), conditioned on 32 x 32 sources.
SHAPES_EDIT_MODEL_NAME = "shapes-edit"


def is_tiny(name: str | None) -> bool:
    """Whether ``name`` is one of the offline tiny models (rebuilt from a seed, never on the Hub)."""
    return name in TINY_MODEL_NAMES


def _shipped_model(name: str, rebuild: str) -> Path:
    folder = SHIPPED_WEIGHTS / name
    if not (folder / "model_index.json").is_file():
        raise FileNotFoundError(
            f"The shipped {name!r} model is missing from {folder}: reinstall marble_trl, or rebuild it with `{rebuild}`."
        )
    return folder


def shapes_edit_model_path() -> Path:
    """The folder of the shipped ``shapes-edit`` model (a ``save_pretrained`` folder)."""
    return _shipped_model(SHAPES_EDIT_MODEL_NAME, "python -m marble_trl.shapesbench.edit_bench ship")


def shapes_model_path() -> Path:
    """The folder of the shipped ``shapes`` model (a ``save_pretrained`` folder)."""
    return _shipped_model(SHAPES_MODEL_NAME, "python -m marble_trl.shapesbench ship")


_TINY_CHARS = string.ascii_lowercase + string.digits + string.punctuation


def tiny_clip_tokenizer(max_length: int = 77):
    """A CLIP tokenizer over single characters (no merges): every prompt tokenizes, nothing is downloaded."""
    from transformers import CLIPTokenizer

    specials = ["<|startoftext|>", "<|endoftext|>"]
    tokens = specials + list(_TINY_CHARS) + [c + "</w>" for c in _TINY_CHARS]
    vocab = {tok: i for i, tok in enumerate(tokens)}
    tokenizer = CLIPTokenizer(vocab=vocab, merges=[])
    tokenizer.model_max_length = max_length
    return tokenizer


def tiny_t5_tokenizer():
    """A T5 tokenizer over single characters (a unigram vocabulary of the tiny character set): no download."""
    from transformers import T5TokenizerFast

    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("\u2581", -2.0)]
    pieces += [(c, -3.0) for c in _TINY_CHARS + string.ascii_uppercase]
    return T5TokenizerFast(vocab=pieces, extra_ids=0)


def tiny_t5_encoder(d_model: int, umt5: bool = False):
    """A random two-layer T5 (or UMT5, Wan's) encoder over :func:`tiny_t5_tokenizer`'s vocabulary."""
    from transformers import T5Config, T5EncoderModel, UMT5Config, UMT5EncoderModel

    config_cls, model_cls = (UMT5Config, UMT5EncoderModel) if umt5 else (T5Config, T5EncoderModel)
    config = config_cls(
        vocab_size=len(tiny_t5_tokenizer()),
        d_model=d_model,
        d_kv=8,
        d_ff=2 * d_model,
        num_layers=2,
        num_heads=2,
        relative_attention_num_buckets=8,
        pad_token_id=0,
        eos_token_id=1,
        decoder_start_token_id=0,
    )
    return model_cls(config).eval()


def tiny_clip_text_encoder(hidden: int, projection_dim: int | None = None):
    """A random two-layer CLIP text encoder over :func:`tiny_clip_tokenizer`'s vocabulary (with a projection head
    when ``projection_dim`` is given, as SD3's; without, as FLUX's)."""
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    cfg = CLIPTextConfig(
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=1,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        layer_norm_eps=1e-5,
        num_attention_heads=2,
        num_hidden_layers=2,
        vocab_size=2 + 2 * len(_TINY_CHARS),
        max_position_embeddings=77,
        hidden_act="gelu",
        projection_dim=projection_dim or hidden,
    )
    return (CLIPTextModelWithProjection(cfg) if projection_dim else CLIPTextModel(cfg)).eval()


def tiny_autoencoder_kl(latent_channels: int, sample_size: int, shift_factor: float, scaling_factor: float):
    """A random two-block ``AutoencoderKL`` that downsamples by 2 (SD3's and FLUX's VAE class, without quant convs)."""
    from diffusers import AutoencoderKL

    return AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D", "DownEncoderBlock2D"),
        up_block_types=("UpDecoderBlock2D", "UpDecoderBlock2D"),
        block_out_channels=(8, 16),
        layers_per_block=1,
        latent_channels=latent_channels,
        norm_num_groups=4,
        sample_size=sample_size,
        shift_factor=shift_factor,
        scaling_factor=scaling_factor,
        use_quant_conv=False,
        use_post_quant_conv=False,
    )


def tiny_dynamic_shift_scheduler():
    """The Euler scheduler with dynamic shifting of the tiny packed-latent models (FLUX, Qwen-Image, Z-Image), its
    ``mu`` range scaled to their 4-256 image tokens."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    return FlowMatchEulerDiscreteScheduler(
        shift=3.0, use_dynamic_shifting=True, base_image_seq_len=16, max_image_seq_len=256
    )


def _placeholder_t5(d_model: int):
    """A one-layer T5 encoder whose output is exactly zero (its final RMS norm has zero weight) and a T5 tokenizer
    over three special tokens (every word is ``<unk>``): the embeddings SD3 uses when it has no T5, as real
    ``text_encoder_3`` / ``tokenizer_3`` components, so the saved folder has the standard SD3 layout."""
    from transformers import T5Config, T5EncoderModel, T5TokenizerFast

    config = T5Config(
        vocab_size=3,
        d_model=d_model,
        d_kv=8,
        d_ff=2 * d_model,
        num_layers=1,
        num_heads=2,
        relative_attention_num_buckets=8,
        pad_token_id=0,
        eos_token_id=1,
        decoder_start_token_id=0,
    )
    encoder = T5EncoderModel(config)
    with torch.no_grad():
        encoder.encoder.final_layer_norm.weight.zero_()
    tokenizer = T5TokenizerFast(vocab=[("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0)], extra_ids=0)
    return encoder, tokenizer


def build_tiny_sd3_pipeline(
    seed: int = 0,
    sd35: bool = True,
    latent_size: int = 16,
    num_layers: int = 2,
    hidden_heads: int = 2,
    head_dim: int = 16,
    text_hidden: int = 16,
    placeholder_t5: bool = False,
    patch_size: int = 2,
):
    """Build a tiny random-weight ``StableDiffusion3Pipeline`` (CPU, float32), deterministic from ``seed``.

    Images are ``2 * latent_size`` pixels square (the tiny VAE downsamples by 2); the transformer sees
    ``(latent_size / patch_size)^2`` image tokens (patch size 2 by default, as SD3's).
    ``sd35=True`` adds SD3.5's dual attention in the first layer and RMS qk-norm. ``placeholder_t5=True`` adds a T5
    whose output is exactly zero (the same images; what :func:`save_tiny_sd3_pipeline` saves so that plain
    ``from_pretrained`` loads the folder); by default there is no T5.
    """
    from diffusers import FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel, StableDiffusion3Pipeline

    inner = hidden_heads * head_dim
    generator_state = torch.random.get_rng_state()
    try:
        torch.manual_seed(seed)
        transformer = SD3Transformer2DModel(
            sample_size=latent_size,
            patch_size=patch_size,
            in_channels=4,
            num_layers=num_layers,
            attention_head_dim=head_dim,
            num_attention_heads=hidden_heads,
            joint_attention_dim=2 * text_hidden,
            caption_projection_dim=inner,
            pooled_projection_dim=2 * inner,
            out_channels=4,
            pos_embed_max_size=latent_size,
            dual_attention_layers=(0,) if sd35 else (),
            qk_norm="rms_norm" if sd35 else None,
        )
        vae = tiny_autoencoder_kl(4, 2 * latent_size, shift_factor=0.0609, scaling_factor=1.5035)

        def text_encoder():
            return tiny_clip_text_encoder(text_hidden, projection_dim=inner)

        text_encoder_1, text_encoder_2 = text_encoder(), text_encoder()
        text_encoder_3, tokenizer_3 = _placeholder_t5(2 * text_hidden) if placeholder_t5 else (None, None)
    finally:
        torch.random.set_rng_state(generator_state)
    for module in (transformer, vae, text_encoder_1, text_encoder_2, text_encoder_3):
        if module is not None:
            module.eval()  # as from_pretrained returns them
    scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0)
    pipe = StableDiffusion3Pipeline(
        transformer=transformer,
        scheduler=scheduler,
        vae=vae,
        text_encoder=text_encoder_1,
        tokenizer=tiny_clip_tokenizer(),
        text_encoder_2=text_encoder_2,
        tokenizer_2=tiny_clip_tokenizer(),
        text_encoder_3=text_encoder_3,
        tokenizer_3=tokenizer_3,
    )
    # The name the run records as its base model (manifest, marble_trl.json, model card), with the seed that
    # rebuilds it: `marble-trl export --sample_prompts` and `generate` load it again from these two.
    pipe.register_to_config(_name_or_path=TINY_MODEL_NAME)
    pipe.tiny_seed = seed
    return pipe


def save_tiny_sd3_pipeline(path: str | os.PathLike, seed: int = 0, **kwargs) -> Path:
    """Build the tiny pipeline (with the zero-output placeholder T5) and ``save_pretrained`` it to ``path``; returns
    the path. The folder loads with plain ``StableDiffusion3Pipeline.from_pretrained(path)`` (or
    ``load_sd3_pipeline(path)``) and generates the images of ``build_tiny_sd3_pipeline(seed)``."""
    path = Path(path)
    kwargs.setdefault("placeholder_t5", True)
    build_tiny_sd3_pipeline(seed=seed, **kwargs).save_pretrained(path)
    return path


def tiny_seed_of(pipeline) -> int | None:
    """The seed of an offline tiny pipeline (:data:`TINY_MODEL_NAMES`; ``None`` for any other pipeline)."""
    return (
        getattr(pipeline, "tiny_seed", None) if getattr(pipeline, "name_or_path", None) in TINY_MODEL_NAMES else None
    )
