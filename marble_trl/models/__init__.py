"""Model families (:mod:`.family`: the protocol the trainer talks to; :mod:`.base`: what the diffusers adapters
share), SD3 / SD3.5 (:mod:`.sd3`), FLUX.1 (:mod:`.flux`), the editing families (:mod:`.editing`, :mod:`.flux_kontext`,
:mod:`.qwen_image_edit`) and the offline models (:mod:`.tiny`: ``tiny``, ``shapes``;
each family module builds its own ``tiny-<family>``)."""

from .family import FAMILIES, Conditioning, FlowModelAdapter, adapter_for, family_of, load_model
from .flux import FluxAdapter, build_tiny_flux_pipeline
from .flux_kontext import FluxKontextAdapter
from .qwen_image import QwenImageAdapter, build_tiny_qwen_image_pipeline
from .qwen_image_edit import QwenImageEditAdapter, build_tiny_qwen_image_edit_pipeline
from .sd3 import (
    DEFAULT_LORA_TARGETS,
    PromptEmbeddings,
    SD3Adapter,
    decode_latents,
    encode_prompts,
    load_sd3_pipeline,
    predict_velocity,
    sample_latents,
)
from .tiny import (
    SHAPES_MODEL_NAME,
    TINY_MODEL_NAME,
    TINY_MODEL_NAMES,
    build_tiny_sd3_pipeline,
    save_tiny_sd3_pipeline,
    shapes_model_path,
    tiny_seed_of,
)
from .wan import WanAdapter, build_tiny_wan_pipeline
from .z_image import ZImageAdapter, build_tiny_z_image_pipeline

__all__ = [
    "DEFAULT_LORA_TARGETS",
    "FAMILIES",
    "SHAPES_MODEL_NAME",
    "TINY_MODEL_NAME",
    "TINY_MODEL_NAMES",
    "FluxAdapter",
    "FluxKontextAdapter",
    "QwenImageEditAdapter",
    "build_tiny_qwen_image_edit_pipeline",
    "WanAdapter",
    "QwenImageAdapter",
    "ZImageAdapter",
    "build_tiny_z_image_pipeline",
    "build_tiny_qwen_image_pipeline",
    "build_tiny_wan_pipeline",
    "build_tiny_flux_pipeline",
    "family_of",
    "Conditioning",
    "FlowModelAdapter",
    "PromptEmbeddings",
    "SD3Adapter",
    "adapter_for",
    "build_tiny_sd3_pipeline",
    "decode_latents",
    "encode_prompts",
    "load_model",
    "load_sd3_pipeline",
    "predict_velocity",
    "sample_latents",
    "save_tiny_sd3_pipeline",
    "shapes_model_path",
    "tiny_seed_of",
]
