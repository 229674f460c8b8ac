"""The model-family seam: what the trainer, the evaluation and the export need from a flow-matching model.

A family adapter wraps one loaded diffusers pipeline. The trainer talks only to this protocol: it never builds prompt
embeddings or calls a transformer itself. The families: SD3 / SD3.5 (``sd3``), FLUX.1 (``flux``), Wan 2.1 / 2.2
(``wan``, video), Qwen-Image (``qwen_image``), Z-Image (``z_image``), and the editing families FLUX.1 Kontext
(``flux_kontext``) and Qwen-Image-Edit (``qwen_image_edit``). To add one, subclass
:class:`~marble_trl.models.base.DiffusersFlowAdapter` in ``models/<family>.py`` and add the class to :data:`FAMILIES`
(docs/adding-a-model-family.md).

The conditioning object returned by :meth:`FlowModelAdapter.encode` is the family's own (SD3: pooled CLIP + the joint
sequence); the trainer only slices it with ``.index(rows)`` and hands it back.
"""

from __future__ import annotations

import os
from typing import Any, ClassVar, Protocol, runtime_checkable

import torch

from .flux import FluxAdapter
from .flux_kontext import FluxKontextAdapter
from .loading import local_folder, pipeline_class_name
from .qwen_image import QwenImageAdapter
from .qwen_image_edit import QwenImageEditAdapter
from .sd3 import SD3Adapter
from .tiny import SHAPES_EDIT_MODEL_NAME, SHAPES_MODEL_NAME
from .wan import WanAdapter
from .z_image import ZImageAdapter


@runtime_checkable
class Conditioning(Protocol):
    def index(self, idx: Any) -> Conditioning: ...


@runtime_checkable
class FlowModelAdapter(Protocol):
    """One flow-matching text-to-image (or video) family, bound to a loaded pipeline."""

    family: ClassVar[str]  # the family's name, e.g. "sd3"
    pipeline_class_name: ClassVar[str]  # the diffusers pipeline class it wraps (model_index.json's _class_name)
    tiny_name: ClassVar[str | None]  # its offline random model, e.g. "tiny-flux"
    hub_ids: ClassVar[tuple[str, ...]]  # its published Hub repos (the family is known offline, e.g. for a preflight)
    default_lora_targets: ClassVar[tuple[str, ...]]  # module-name suffixes of the community's LoRA for the family
    guidance: ClassVar[str]  # "cfg" (guidance_scale > 1: CFG with the negative prompt) or "embedded" (FLUX.1-dev)
    video: ClassVar[bool]  # decode returns videos [B, F, 3, H, W] instead of images [B, 3, H, W]
    editing: ClassVar[bool]  # encode takes each prompt's source image (source_images=): an image-editing family
    pipeline: Any

    @classmethod
    def load(cls, name_or_path: str | os.PathLike, torch_dtype: torch.dtype | None = None, tiny_seed: int = 0) -> Any:
        """The adapter around the pipeline loaded from a folder, a Hub id or an offline model name."""

    @classmethod
    def handles(cls, pipeline: Any) -> bool:
        """Whether ``pipeline`` is of this family."""

    @property
    def transformer(self) -> torch.nn.Module: ...

    @property
    def latent_factor(self) -> int:
        """Pixels per token side (VAE downsampling x patch size): resolutions must be multiples of it."""

    def needs_negative(self, guidance_scale: float) -> bool:
        """Whether rollouts at ``guidance_scale`` need the negative prompt's conditioning."""

    def timestep_kwargs(self, num_steps: int, resolution: int) -> dict[str, Any]:
        """The family pipeline's extra ``scheduler.set_timesteps`` arguments (custom sigmas, dynamic-shift ``mu``)."""

    def guided_velocity(self, v_cond: torch.Tensor, v_uncond: torch.Tensor, scale: float) -> torch.Tensor:
        """The pipeline's CFG combination (plain CFG, or the family's variant: Qwen-Image rescales)."""

    @classmethod
    def call_kwargs(cls, guidance_scale: float) -> dict[str, Any]:
        """The pipeline ``__call__`` arguments that mean the trainer's ``guidance_scale`` (model cards)."""

    def encode(
        self,
        prompts: list[str],
        max_sequence_length: int,
        device: torch.device,
        guidance_scale: float = 1.0,
        source_images: torch.Tensor | None = None,
    ) -> Conditioning:
        """One row per prompt; ``guidance_scale`` matters only to embedded-guidance families (it is part of the
        conditioning that :meth:`predict` sees). An editing family needs ``source_images`` (``[B, 3, H, W]`` in
        ``[0, 1]``, one per prompt) and carries what its transformer sees of them in the conditioning; the others
        refuse them."""

    def sample(self, scheduler: Any, cond: Conditioning, num_steps: int, resolution: int, generator: torch.Generator,
               guidance_scale: float = 1.0, negative: Conditioning | None = None) -> torch.Tensor:  # fmt: skip
        """Clean latents ``x0`` of one rollout per row of ``cond`` with ``scheduler`` (no gradients)."""

    def predict(
        self, module: torch.nn.Module, x_t: torch.Tensor, sigma: torch.Tensor, cond: Conditioning
    ) -> torch.Tensor:
        """The velocity ``v = eps - x0`` of ``module`` (the transformer, or its DDP/DeepSpeed wrapper) at flow time
        ``sigma`` (``[B]``), in the adapter's latent space (the space of :meth:`sample`'s output)."""

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Images ``[B, 3, H, W]`` (videos ``[B, F, 3, H, W]``) in ``[0, 1]`` (float32), the reward input format."""

    def save_lora(
        self, folder: str | os.PathLike, layers: dict[str, torch.Tensor], metadata: dict | None, weight_name=None
    ) -> None:
        """Write the LoRA in the family's diffusers format (loadable with the pipeline's ``load_lora_weights``), in
        ``folder/weight_name`` (default: the family's standard file name)."""


FAMILIES: tuple[type, ...] = (
    SD3Adapter,
    FluxAdapter,
    WanAdapter,
    QwenImageAdapter,
    ZImageAdapter,
    FluxKontextAdapter,
    QwenImageEditAdapter,
)


def supported_pipelines() -> str:
    return ", ".join(f.pipeline_class_name for f in FAMILIES)


def family_of_pipeline_class(class_name: str) -> type:
    """The family of a diffusers pipeline class name (SD3's for an unknown one: cards of old runs)."""
    return next((f for f in FAMILIES if f.pipeline_class_name == class_name), SD3Adapter)


def adapter_for(pipeline: Any) -> FlowModelAdapter:
    """The family adapter of a loaded pipeline (an error that names the supported pipelines otherwise)."""
    for family in FAMILIES:
        if family.handles(pipeline):
            return family(pipeline)
    raise TypeError(f"{type(pipeline).__name__} is not a supported pipeline (supported: {supported_pipelines()}).")


def family_of(name_or_path: str | os.PathLike) -> type:
    """The family class of an offline model name, a local diffusers folder or a Hub id (by its ``_class_name``)."""
    name = str(name_or_path)
    for family in FAMILIES:
        if name == family.tiny_name:
            return family
    if name == SHAPES_MODEL_NAME:
        return SD3Adapter
    if name == SHAPES_EDIT_MODEL_NAME:
        return FluxKontextAdapter
    if local_folder(name) is None:
        for family in FAMILIES:
            if name in family.hub_ids:  # a published repo: no model_index.json download needed
                return family
    class_name = pipeline_class_name(name)
    for family in FAMILIES:
        if family.pipeline_class_name == class_name:
            return family
    raise ValueError(
        f"{name}: {class_name} is not a supported pipeline (supported: {supported_pipelines()}). "
        "docs/adding-a-model-family.md says how to add one."
    )


def load_model(name_or_path: str | os.PathLike, torch_dtype: torch.dtype | None = None, tiny_seed: int = 0):
    """The adapter of the pipeline at ``name_or_path``: an offline name (``tiny``, ``tiny-flux``, ..., ``shapes``),
    a local diffusers folder or a Hub id, its family picked from ``model_index.json``'s ``_class_name``."""
    return family_of(name_or_path).load(name_or_path, torch_dtype, tiny_seed)
