"""Loading Stable Diffusion 3 / 3.5 pipelines, and the tiny offline SD3 pipeline used by tests and the CPU recipe.

``build_tiny_sd3_pipeline`` assembles a complete :class:`diffusers.StableDiffusion3Pipeline` with random weights from a
seed: a tiny SD3(.5) transformer, a tiny VAE, two tiny CLIP text encoders with tokenizers built from an in-memory
character vocabulary, no T5 (the pipeline then uses zeros for the T5 part of the prompt embedding). Nothing is
downloaded.

``save_tiny_sd3_pipeline(folder, seed=0)`` writes it as a diffusers folder that loads with plain
``StableDiffusion3Pipeline.from_pretrained(folder)``, like any Hub checkpoint: the saved pipeline carries a placeholder
T5 (``text_encoder_3``, ``tokenizer_3``) whose output is exactly zero, so it generates the same images as the built one
(diffusers' SD3 loader refuses a folder without T5 unless ``text_encoder_3=None, tokenizer_3=None`` are passed).
``load_sd3_pipeline`` loads either kind of folder.
"""

from __future__ import annotations

import json
import os
import string
from pathlib import Path

import torch

from .distributed import zero3_init_disabled

TINY_MODEL_NAME = "tiny"
# The ShapesBench base model shipped inside the package (marble_trl/shapesbench/weights/shapes): a tiny SD3.5-
# architecture pipeline pretrained on the ShapesBench world, the README's main job (docs/shapesbench.md).
SHAPES_MODEL_NAME = "shapes"


def shapes_model_path() -> Path:
    """The folder of the shipped ``shapes`` model (a ``save_pretrained`` folder)."""
    from .shapesbench.shipped import WEIGHTS

    folder = WEIGHTS / SHAPES_MODEL_NAME
    if not (folder / "model_index.json").is_file():
        raise FileNotFoundError(
            f"The shipped 'shapes' model is missing from {folder}: reinstall marble_trl, or rebuild it with "
            "`python -m marble_trl.shapesbench ship`."
        )
    return folder


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
):
    """Build a tiny random-weight ``StableDiffusion3Pipeline`` (CPU, float32), deterministic from ``seed``.

    Images are ``2 * latent_size`` pixels square (the tiny VAE downsamples by 2); the transformer uses patch size 2.
    ``sd35=True`` adds SD3.5's dual attention in the first layer and RMS qk-norm. ``placeholder_t5=True`` adds a T5
    whose output is exactly zero (the same images; what :func:`save_tiny_sd3_pipeline` saves so that plain
    ``from_pretrained`` loads the folder); by default there is no T5.
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
        tokenizer=_tiny_clip_tokenizer(),
        text_encoder_2=text_encoder_2,
        tokenizer_2=_tiny_clip_tokenizer(),
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
    """The seed of a pipeline built by :func:`build_tiny_sd3_pipeline` (``None`` for any other pipeline)."""
    return getattr(pipeline, "tiny_seed", None) if getattr(pipeline, "name_or_path", None) == TINY_MODEL_NAME else None


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
        pipe = build_tiny_sd3_pipeline(seed=tiny_seed)
        if torch_dtype is not None and torch_dtype != torch.float32:
            # Built in float32. nn.Module.to, not ModelMixin.to: diffusers' warns that it would keep "[]" in float32.
            for component in pipe.components.values():
                if isinstance(component, torch.nn.Module):
                    torch.nn.Module.to(component, dtype=torch_dtype)
        return pipe
    # A Hub id is "name" or "org/name"; anything with more parts or a path prefix is a local path.
    looks_local = name_or_path.startswith((".", "/", "~")) or name_or_path.count("/") > 1
    expanded = Path(name_or_path).expanduser()
    if looks_local and not expanded.exists():
        raise FileNotFoundError(
            f"model_name_or_path {name_or_path!r} is not an existing folder. Give a local diffusers folder, a Hub id "
            f"such as 'stabilityai/stable-diffusion-3.5-medium', or {TINY_MODEL_NAME!r} / {SHAPES_MODEL_NAME!r} for the offline models."
        )
    kwargs: dict = {"torch_dtype": torch_dtype} if torch_dtype is not None else {}
    if name_or_path == SHAPES_MODEL_NAME:
        folder = shapes_model_path()
        pipe = StableDiffusion3Pipeline.from_pretrained(str(folder), **kwargs, **_absent_components(folder))
        pipe.register_to_config(_name_or_path=SHAPES_MODEL_NAME)  # cards and adapters name it like a Hub id
        return pipe
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
