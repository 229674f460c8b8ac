"""The model-family seam: what the trainer, the evaluation and the export need from a flow-matching model.

A family adapter wraps one loaded diffusers pipeline. The trainer talks only to this protocol: it never builds SD3
embeddings or calls a transformer itself. To add a family (FLUX.1, Qwen-Image, Wan, ...), implement the protocol in
``models/<family>.py`` and add the class to :data:`FAMILIES` (CONTRIBUTING.md, "Adding a model family").

The conditioning object returned by :meth:`FlowModelAdapter.encode` is the family's own (SD3: pooled CLIP + the joint
sequence); the trainer only slices it with ``.index(rows)`` and hands it back.
"""

from __future__ import annotations

import os
from typing import Any, ClassVar, Protocol, runtime_checkable

import torch

from .sd3 import SD3Adapter


@runtime_checkable
class Conditioning(Protocol):
    def index(self, idx: Any) -> Conditioning: ...


@runtime_checkable
class FlowModelAdapter(Protocol):
    """One flow-matching text-to-image (or video) family, bound to a loaded pipeline."""

    family: ClassVar[str]  # the family's name, e.g. "sd3"
    default_lora_targets: ClassVar[tuple[str, ...]]  # module-name suffixes of the paper-style LoRA
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

    def encode(self, prompts: list[str], max_sequence_length: int, device: torch.device) -> Conditioning: ...

    def sample(self, scheduler: Any, cond: Conditioning, num_steps: int, resolution: int, generator: torch.Generator,
               guidance_scale: float = 1.0, negative: Conditioning | None = None) -> torch.Tensor:  # fmt: skip
        """Clean latents ``x0`` of one rollout per row of ``cond`` with ``scheduler`` (no gradients)."""

    def predict(
        self, module: torch.nn.Module, x_t: torch.Tensor, sigma: torch.Tensor, cond: Conditioning
    ) -> torch.Tensor:
        """The velocity ``v = eps - x0`` of ``module`` (the transformer, or its DDP/DeepSpeed wrapper) at ``sigma``."""

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Images ``[B, 3, H, W]`` in ``[0, 1]`` (float32), the reward input format."""

    def save_lora(
        self, folder: str | os.PathLike, layers: dict[str, torch.Tensor], metadata: dict | None, weight_name=None
    ) -> None:
        """Write the LoRA in the family's diffusers format (loadable with the pipeline's ``load_lora_weights``), in
        ``folder/weight_name`` (default: the family's standard file name)."""


FAMILIES: tuple[type, ...] = (SD3Adapter,)


def adapter_for(pipeline: Any) -> FlowModelAdapter:
    """The family adapter of a loaded pipeline (an error that names the supported pipelines otherwise)."""
    for family in FAMILIES:
        if family.handles(pipeline):
            return family(pipeline)
    names = ", ".join(f.pipeline_class_name for f in FAMILIES)
    raise TypeError(f"{type(pipeline).__name__} is not a supported pipeline (supported: {names}).")


def load_model(name_or_path: str | os.PathLike, torch_dtype: torch.dtype | None = None, tiny_seed: int = 0):
    """The adapter of the pipeline at ``name_or_path`` (SD3 / SD3.5 folders and Hub ids, ``tiny``, ``shapes``)."""
    return SD3Adapter.load(name_or_path, torch_dtype, tiny_seed)
