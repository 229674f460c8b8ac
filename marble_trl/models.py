"""Loading Stable Diffusion 3 / 3.5 pipelines, and the tiny offline SD3 pipeline used by tests and the CPU recipe.

``build_tiny_sd3_pipeline`` assembles a complete :class:`diffusers.StableDiffusion3Pipeline` with random weights from a
seed: a tiny SD3(.5) transformer, a tiny VAE, two tiny CLIP text encoders with tokenizers built from an in-memory
character vocabulary, no T5. Nothing is downloaded. It saves with ``save_pretrained`` and loads back with
``StableDiffusion3Pipeline.from_pretrained`` like any Hub checkpoint.
"""

from __future__ import annotations

import json
import os
import string
from pathlib import Path

import torch

from .distributed import zero3_init_disabled

TINY_MODEL_NAME = "tiny"
_TINY_CHARS = string.ascii_lowercase + string.digits + string.punctuation


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


def _tiny_clip_tokenizer(max_length: int = 77):
    """A CLIP tokenizer over single characters (no merges): every prompt tokenizes, nothing is downloaded."""
    from transformers import CLIPTokenizer

    specials = ["<|startoftext|>", "<|endoftext|>"]
    tokens = specials + list(_TINY_CHARS) + [c + "</w>" for c in _TINY_CHARS]
    vocab = {tok: i for i, tok in enumerate(tokens)}
    tokenizer = CLIPTokenizer(vocab=vocab, merges=[])
    tokenizer.model_max_length = max_length
    return tokenizer


def build_tiny_sd3_pipeline(
    seed: int = 0,
    sd35: bool = True,
    latent_size: int = 16,
    num_layers: int = 2,
    hidden_heads: int = 2,
    head_dim: int = 16,
    text_hidden: int = 16,
):
    """Build a tiny random-weight ``StableDiffusion3Pipeline`` (CPU, float32), deterministic from ``seed``.

    Images are ``2 * latent_size`` pixels square (the tiny VAE downsamples by 2); the transformer uses patch size 2.
    ``sd35=True`` adds SD3.5's dual attention in the first layer and RMS qk-norm.
    """
    from diffusers import (
        AutoencoderKL,
        FlowMatchEulerDiscreteScheduler,
        SD3Transformer2DModel,
        StableDiffusion3Pipeline,
    )
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection

    inner = hidden_heads * head_dim
    generator_state = torch.random.get_rng_state()
    try:
        torch.manual_seed(seed)
        transformer = SD3Transformer2DModel(
            sample_size=latent_size,
            patch_size=2,
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
        vae = AutoencoderKL(
            in_channels=3,
            out_channels=3,
            down_block_types=("DownEncoderBlock2D", "DownEncoderBlock2D"),
            up_block_types=("UpDecoderBlock2D", "UpDecoderBlock2D"),
            block_out_channels=(8, 16),
            layers_per_block=1,
            latent_channels=4,
            norm_num_groups=4,
            sample_size=2 * latent_size,
            shift_factor=0.0609,
            scaling_factor=1.5035,
            use_quant_conv=False,
            use_post_quant_conv=False,
        )

        def text_encoder():
            cfg = CLIPTextConfig(
                bos_token_id=0,
                eos_token_id=1,
                pad_token_id=1,
                hidden_size=text_hidden,
                intermediate_size=2 * text_hidden,
                layer_norm_eps=1e-5,
                num_attention_heads=2,
                num_hidden_layers=2,
                vocab_size=2 + 2 * len(_TINY_CHARS),
                max_position_embeddings=77,
                hidden_act="gelu",
                projection_dim=inner,
            )
            return CLIPTextModelWithProjection(cfg)

        text_encoder_1, text_encoder_2 = text_encoder(), text_encoder()
    finally:
        torch.random.set_rng_state(generator_state)
    for module in (transformer, vae, text_encoder_1, text_encoder_2):
        module.eval()  # as from_pretrained returns them
    scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0)
    return StableDiffusion3Pipeline(
        transformer=transformer,
        scheduler=scheduler,
        vae=vae,
        text_encoder=text_encoder_1,
        tokenizer=_tiny_clip_tokenizer(),
        text_encoder_2=text_encoder_2,
        tokenizer_2=_tiny_clip_tokenizer(),
        text_encoder_3=None,
        tokenizer_3=None,
    )


def save_tiny_sd3_pipeline(path: str | os.PathLike, seed: int = 0, **kwargs) -> Path:
    """Build the tiny pipeline and ``save_pretrained`` it to ``path`` (returns the path)."""
    path = Path(path)
    build_tiny_sd3_pipeline(seed=seed, **kwargs).save_pretrained(path)
    return path


@zero3_init_disabled()  # frozen components must not be partitioned by ZeRO-3 (marble_trl.distributed)
def load_sd3_pipeline(
    name_or_path: str | os.PathLike,
    torch_dtype: torch.dtype | None = None,
    tiny_seed: int = 0,
):
    """Load an SD3 / SD3.5 pipeline from a local folder or Hub id; ``"tiny"`` builds the offline tiny pipeline.

    A local path that does not exist is an error (it is never mistaken for a Hub id).
    """
    from diffusers import StableDiffusion3Pipeline

    name_or_path = str(name_or_path)
    if name_or_path == TINY_MODEL_NAME:
        pipe = build_tiny_sd3_pipeline(seed=tiny_seed)
        return pipe.to(dtype=torch_dtype) if torch_dtype is not None else pipe
    # A Hub id is "name" or "org/name"; anything with more parts or a path prefix is a local path.
    looks_local = name_or_path.startswith((".", "/", "~")) or name_or_path.count("/") > 1
    expanded = Path(name_or_path).expanduser()
    if looks_local and not expanded.exists():
        raise FileNotFoundError(
            f"model_name_or_path {name_or_path!r} is not an existing folder. Give a local diffusers folder, a Hub id "
            f"such as 'stabilityai/stable-diffusion-3.5-medium', or {TINY_MODEL_NAME!r} for the offline tiny model."
        )
    kwargs: dict = {"torch_dtype": torch_dtype} if torch_dtype is not None else {}
    if expanded.exists():
        kwargs.update(_absent_components(expanded))
        return StableDiffusion3Pipeline.from_pretrained(str(expanded), **kwargs)
    return StableDiffusion3Pipeline.from_pretrained(name_or_path, **kwargs)


def _absent_components(folder: Path) -> dict[str, None]:
    """Components saved as ``[null, null]`` (e.g. no T5): diffusers wants them passed explicitly as ``None``."""
    index = folder / "model_index.json"
    if not index.is_file():
        raise FileNotFoundError(f"{folder} has no model_index.json: it is not a diffusers pipeline folder.")
    entries = json.loads(index.read_text())
    return {
        name: None
        for name, value in entries.items()
        if isinstance(value, list) and len(value) == 2 and value[0] is None and value[1] is None
    }
