"""What every diffusers family adapter shares: loading (offline tiny name, local folder, Hub id), the family test, the
per-distinct-prompt encoding cache, the LoRA writer and the conditioning's row indexing.

A family module (``sd3.py``, ``flux.py``, ``wan.py``, ...) subclasses :class:`DiffusersFlowAdapter` and writes only
what differs: ``_encode`` (distinct prompts -> conditioning), ``sample``, ``predict``, ``decode`` and ``build_tiny``.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from contextlib import contextmanager, nullcontext
from typing import Any, ClassVar

import torch

from ..artifacts import LORA_KEY_PREFIX
from ..distributed import zero3_init_disabled
from ..rollout.solvers import pinned_grid, training_sigmas
from .loading import cast_built, from_pretrained
from .prompt_cache import encoders_visiting


@dataclasses.dataclass
class RowConditioning:
    """A conditioning whose tensor fields have one row per sample; fields named in ``shared`` are not per sample
    (e.g. FLUX's text position ids) and ``None`` fields stay ``None``."""

    shared: ClassVar[tuple[str, ...]] = ()

    def index(self, idx: Any):
        values = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            values[f.name] = value if value is None or f.name in self.shared else value[idx]
        return type(self)(**values)

    # The prompt-embedding cache (marble_trl.models.prompt_cache) stores single rows and joins them again.
    def row(self, i: int):
        """Row ``i`` alone, as the family would encode that prompt by itself (padding of other rows removed)."""
        return self.index([i])

    @classmethod
    def concat(cls, rows: list):
        """The rows of a batch joined back (the inverse of :meth:`row` over a batch)."""
        values = {}
        for f in dataclasses.fields(cls):
            first = getattr(rows[0], f.name)
            if first is None or f.name in cls.shared:
                values[f.name] = first
            elif isinstance(first, list):
                values[f.name] = [item for r in rows for item in getattr(r, f.name)]
            else:
                values[f.name] = torch.cat([getattr(r, f.name) for r in rows])
        return cls(**values)

    def to(self, device: torch.device | str):
        """The same conditioning with every tensor on ``device``."""
        values = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, torch.Tensor):
                value = value.to(device)
            elif isinstance(value, list):
                value = [v.to(device) for v in value]
            values[f.name] = value
        return type(self)(**values)


class _OncePerKind(logging.Filter):
    """Lets the first record of each kind through (the prompt truncation warning, Qwen-Image's missing-mask notice),
    marked as not repeated, and drops the rest: a pipeline's encode runs every step and would repeat them."""

    KINDS = ("was truncated because", "prompt_embeds_mask")

    def __init__(self) -> None:
        super().__init__()
        self.seen: set[str] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        kind = next((k for k in self.KINDS if k in message), None)
        if kind is None:
            return True
        if kind in self.seen:
            return False
        self.seen.add(kind)
        record.msg, record.args = f"{message} (logged once per run)", ()
        return True


_ONCE = _OncePerKind()


def reset_quiet_repeats() -> None:
    """Let each kind through once more (a new run: the trainer calls it when it is built)."""
    _ONCE.seen.clear()


def quiet_repeats(module: str) -> None:
    """Install :class:`_OncePerKind` on a pipeline module's logger (once)."""
    logger = logging.getLogger(module)
    if _ONCE not in logger.filters:
        logger.addFilter(_ONCE)


def unique_index(prompts: list[str]) -> tuple[list[str], list[int]]:
    """The distinct prompts in first-seen order, and each prompt's row among them (groups repeat a prompt G times)."""
    unique = list(dict.fromkeys(prompts))
    where = {p: i for i, p in enumerate(unique)}
    return unique, [where[p] for p in prompts]


class DiffusersFlowAdapter:
    """The shared half of a :class:`~marble_trl.models.family.FlowModelAdapter` for a diffusers pipeline."""

    family: ClassVar[str]
    pipeline_class_name: ClassVar[str]  # the diffusers pipeline class (model_index.json's _class_name)
    tiny_name: ClassVar[str | None] = None  # the offline random model's name (tests, smoke runs)
    hub_ids: ClassVar[tuple[str, ...]] = ()  # the family's published Hub repos: recognised without a download
    default_lora_targets: ClassVar[tuple[str, ...]]
    # "cfg": guidance_scale > 1 is classifier-free guidance with the negative prompt (a second forward per step);
    # "embedded": guidance-distilled (FLUX.1-dev), guidance_scale is the transformer's guidance input.
    guidance: ClassVar[str] = "cfg"
    video: ClassVar[bool] = False  # decode returns videos [B, F, 3, H, W]
    # An editing family (FLUX.1 Kontext, Qwen-Image-Edit): encode takes each row's source image, and the
    # conditioning carries what the transformer sees of it (marble_trl.models.editing).
    editing: ClassVar[bool] = False

    @classmethod
    def edit_call_kwargs(cls, resolution: int) -> dict[str, Any]:
        """An editing family's extra ``__call__`` arguments (model cards); none for text-to-image families."""
        return {}

    def __init__(self, pipeline) -> None:
        self.pipeline = pipeline
        quiet_repeats(type(pipeline).__module__)
        reset_quiet_repeats()
        # marble_trl.models.prompt_cache: a PromptEmbeddingCache when one is installed; True when the text encoders
        # live in CPU memory and visit the device to encode.
        self.prompt_cache = None
        self.text_encoders_offloaded = False

    # ---------------------------------------------------------------------------------------------- loading
    @classmethod
    def pipeline_class(cls):
        import diffusers

        return getattr(diffusers, cls.pipeline_class_name)

    @classmethod
    def build_tiny(cls, seed: int = 0):
        raise NotImplementedError(f"{cls.family} has no offline tiny model")

    @classmethod
    def load(cls, name_or_path: str | os.PathLike, torch_dtype: torch.dtype | None = None, tiny_seed: int = 0):
        # Frozen components must not be partitioned by ZeRO-3 (marble_trl.distributed), the tiny models' neither.
        with zero3_init_disabled():
            if cls.tiny_name is not None and str(name_or_path) == cls.tiny_name:
                return cls(cast_built(cls.build_tiny(seed=tiny_seed), torch_dtype))
            return cls(from_pretrained(cls.pipeline_class(), name_or_path, torch_dtype))

    @classmethod
    def handles(cls, pipeline) -> bool:
        return type(pipeline).__name__ == cls.pipeline_class_name

    # ---------------------------------------------------------------------------------------------- the model
    @property
    def transformer(self) -> torch.nn.Module:
        return self.pipeline.transformer

    @property
    def latent_factor(self) -> int:
        """Pixels per transformer token side: the VAE's downsampling times the patch size."""
        patch = self.pipeline.transformer.config.patch_size
        patch = patch[-1] if isinstance(patch, (tuple, list)) else patch
        return self.pipeline.vae_scale_factor * patch

    def needs_negative(self, guidance_scale: float) -> bool:
        """Whether rollouts at ``guidance_scale`` need the negative prompt's conditioning (CFG families only)."""
        return self.guidance == "cfg" and guidance_scale > 1.0

    @classmethod
    def call_kwargs(cls, guidance_scale: float) -> dict[str, Any]:
        """The family pipeline's ``__call__`` arguments for the trainer's ``guidance_scale`` (model cards' snippets)."""
        return {"guidance_scale": guidance_scale}

    @staticmethod
    def guided_velocity(v_cond: torch.Tensor, v_uncond: torch.Tensor, scale: float) -> torch.Tensor:
        """The family pipeline's CFG combination of the conditional and negative velocities (plain CFG here)."""
        return v_uncond + scale * (v_cond - v_uncond)

    def timestep_kwargs(self, num_steps: int, resolution: int) -> dict[str, Any]:
        """What the family's pipeline passes to ``scheduler.set_timesteps`` besides the step count (custom sigmas,
        the dynamic-shift ``mu``): the training grid must be the rollout's grid."""
        return {}

    def encode(
        self,
        prompts: list[str],
        max_sequence_length: int,
        device: torch.device,
        guidance_scale: float = 1.0,
        source_images: torch.Tensor | None = None,
    ):
        """Each distinct prompt encoded once (or read from :attr:`prompt_cache`), expanded back to ``prompts``;
        ``source_images`` (``[B, 3, H, W]`` in ``[0, 1]``) only for an editing family."""
        if source_images is not None:
            raise ValueError(
                f"{type(self.pipeline).__name__} generates from text alone, but source_images were given (a "
                "'source_images' column?): train an editing model (FLUX.1 Kontext, Qwen-Image-Edit) or drop the column."
            )
        return self._encode_text(prompts, max_sequence_length, device, guidance_scale)

    def _encode_text(self, prompts: list[str], max_sequence_length: int, device: torch.device, guidance_scale: float):
        unique, rows = unique_index(prompts)
        if self.prompt_cache is not None:
            cond = self.prompt_cache.lookup(unique, max_sequence_length, device, guidance_scale)
        else:
            with self.text_encoding(device):
                cond = self._encode(unique, max_sequence_length, device, guidance_scale)
        return cond.index(torch.tensor(rows))

    @contextmanager
    def text_encoding(self, device: torch.device):
        """No gradients, and the text encoders on ``device`` when they live offloaded in CPU memory."""
        visiting = encoders_visiting(self.pipeline, device) if self.text_encoders_offloaded else nullcontext()
        with torch.no_grad(), visiting:
            yield

    def _encode(self, prompts: list[str], max_sequence_length: int, device: torch.device, guidance_scale: float):
        raise NotImplementedError

    def training_grid(self, num_steps: int, resolution: int) -> torch.Tensor:
        """The sigmas DiffusionNFT trains on and every rollout solver evaluates the transformer at: the pipeline's
        Euler grid with the family's ``set_timesteps`` arguments (:func:`marble_trl.rollout.solvers.training_sigmas`)."""
        return training_sigmas(self.pipeline.scheduler, num_steps, **self.timestep_kwargs(num_steps, resolution))

    def call_for_latents(self, scheduler, num_steps: int, resolution: int, generator: torch.Generator, **kwargs):
        """:func:`call_pipeline_for_latents` on this adapter's pipeline, on the family's training grid."""
        grid = self.training_grid(num_steps, resolution)
        return call_pipeline_for_latents(self.pipeline, scheduler, num_steps, resolution, generator, grid, **kwargs)

    # ---------------------------------------------------------------------------------------------- LoRA files
    def save_lora(
        self, folder: str | os.PathLike, layers: dict[str, torch.Tensor], metadata: dict | None, weight_name=None
    ) -> None:
        save_diffusers_lora(self.pipeline_class(), folder, layers, metadata, weight_name)


def call_pipeline_for_latents(
    pipe, scheduler, num_steps: int, resolution: int, generator: torch.Generator, grid=None, **kwargs
):
    """The pipeline's own ``__call__`` for ``num_steps`` steps of square ``resolution`` images with ``scheduler``
    swapped in, ``output_type="latent"`` (the pipeline's scheduler is restored afterwards), on the training ``grid``
    (default: the pipeline's Euler grid without family arguments, SD3's); ``kwargs``: the family's conditioning and
    guidance arguments."""
    if grid is None:
        grid = training_sigmas(pipe.scheduler, num_steps)
    original = pipe.scheduler
    pipe.scheduler = scheduler
    try:
        with pinned_grid(scheduler, grid):
            return pipe(
                num_inference_steps=num_steps,
                height=resolution,
                width=resolution,
                generator=generator,
                output_type="latent",
                return_dict=True,
                **kwargs,
            )
    finally:
        pipe.scheduler = original


def vae_decode(vae, latents: torch.Tensor) -> torch.Tensor:
    """Latents of a scaling/shift-factor VAE (SD3's, FLUX's) -> images ``[B, 3, H, W]`` in ``[0, 1]`` (float32)."""
    scaled = latents.to(vae.dtype) / vae.config.scaling_factor + vae.config.get("shift_factor", 0.0)
    return (vae.decode(scaled, return_dict=False)[0].float() / 2 + 0.5).clamp(0, 1)


def _latent_stats(vae, latents: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    shape = (1, vae.config.z_dim, 1, 1, 1)
    mean = torch.tensor(vae.config.latents_mean).view(shape).to(latents.device, dtype)
    return mean, torch.tensor(vae.config.latents_std).view(shape).to(latents.device, dtype)


def vae_denormalize(vae, latents: torch.Tensor) -> torch.Tensor:
    """Latents ``[B, C, F, H, W]`` of a mean/std-normalised VAE (Wan's, Qwen-Image's) back to the VAE's scale."""
    mean, std = _latent_stats(vae, latents, vae.dtype)
    return latents.to(vae.dtype) * std + mean


def vae_normalize(vae, latents: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`vae_denormalize`, in the latents' dtype (the pipelines' ``_encode_vae_image``)."""
    mean, std = _latent_stats(vae, latents, latents.dtype)
    return (latents - mean) / std


def save_diffusers_lora(
    pipeline_cls, folder, layers: dict[str, torch.Tensor], metadata: dict | None, weight_name=None
):
    """The one writer of LoRA files: ``layers`` under diffusers' keys (with or without the ``transformer.`` prefix)
    and the LoRA config as metadata, in ``folder/weight_name`` (default ``pytorch_lora_weights.safetensors``), through
    the family pipeline's own ``save_lora_weights`` so that its ``load_lora_weights`` reads it back."""
    unprefixed = {k.removeprefix(LORA_KEY_PREFIX): v for k, v in layers.items()}
    pipeline_cls.save_lora_weights(
        str(folder),
        transformer_lora_layers=unprefixed,
        transformer_lora_adapter_metadata=metadata,
        **({"weight_name": weight_name} if weight_name else {}),
    )
    # diffusers writes through a private temporary file (mode 0600): give the LoRA the mode of every other file
    path = os.path.join(str(folder), weight_name or "pytorch_lora_weights.safetensors")
    if os.path.isfile(path):
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(path, 0o666 & ~umask)
