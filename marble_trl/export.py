"""Checkpoint -> publishable LoRA folder, and images from a base model plus a LoRA.

:func:`export_checkpoint` turns a ``checkpoint-N`` folder into a folder ready for the Hub: the LoRA (raw or parameter
EMA weights) in diffusers format (``pytorch_lora_weights.safetensors`` with adapter metadata, loads with
``StableDiffusion3Pipeline.load_lora_weights``) or PEFT format (``adapter_model.safetensors`` + ``adapter_config.json``,
loads with ``peft.PeftModel.from_pretrained(pipe.transformer, folder)``), ``marble_trl.json`` (base model and sampling
settings), optional sample images, and the model card (``README.md``).

:func:`generate_images` loads the base pipeline and the LoRA with diffusers' own ``load_lora_weights`` and runs the
pipeline with the training-time sampler settings, so it reproduces ``trainer.generate``.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
from pathlib import Path
from typing import Any

import torch

from .checkpoint import read_manifest
from .hub import (
    EXPORT_CONFIG_FILE,
    card_info_from_checkpoint,
    save_samples,
    write_export_config,
    write_model_card,
)

FORMATS = ("diffusers", "peft")
DIFFUSERS_WEIGHTS = "pytorch_lora_weights.safetensors"
PEFT_WEIGHTS = "adapter_model.safetensors"
_PREFIX = "transformer."


# -------------------------------------------------------------------------------------------------- LoRA files
def read_lora_file(path: str | os.PathLike) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """A diffusers LoRA file: its tensors (``transformer.``-prefixed keys) and its LoRA config (from the metadata)."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    path = Path(path)
    with safe_open(str(path), "pt") as f:
        metadata = f.metadata() or {}
    raw = metadata.get("lora_adapter_metadata")
    if raw is None:
        raise ValueError(
            f"{path} has no LoRA adapter metadata (lora_alpha would be lost); re-save it with marble_trl."
        )
    config = {k[len(_PREFIX) :]: v for k, v in json.loads(raw).items() if k.startswith(_PREFIX)}
    return load_file(str(path)), config


def write_diffusers_lora(folder: Path, tensors: dict[str, torch.Tensor], lora_config: dict[str, Any]) -> Path:
    from diffusers import StableDiffusion3Pipeline

    StableDiffusion3Pipeline.save_lora_weights(
        str(folder),
        transformer_lora_layers={k[len(_PREFIX) :]: v for k, v in tensors.items()},
        transformer_lora_adapter_metadata=lora_config,
    )
    return folder / DIFFUSERS_WEIGHTS


def write_peft_lora(
    folder: Path, tensors: dict[str, torch.Tensor], lora_config: dict[str, Any], base_model: str | None
) -> Path:
    """What ``PeftModel.save_pretrained`` writes for a LoRA on the transformer."""
    import dataclasses

    from peft import LoraConfig
    from safetensors.torch import save_file

    names = {f.name for f in dataclasses.fields(LoraConfig) if f.init}
    config = LoraConfig(**{k: v for k, v in lora_config.items() if k in names and k != "peft_type"})
    config.base_model_name_or_path = base_model
    config.save_pretrained(str(folder))
    weights = {"base_model.model." + k[len(_PREFIX) :]: v.contiguous() for k, v in tensors.items()}
    save_file(weights, str(folder / PEFT_WEIGHTS), metadata={"format": "pt"})
    return folder / PEFT_WEIGHTS


# -------------------------------------------------------------------------------------------------- generation
def generate_images(
    model: str,
    prompts: list[str],
    lora: str | os.PathLike | None = None,
    *,
    seed: int = 0,
    num_inference_steps: int | None = None,
    guidance_scale: float | None = None,
    resolution: int | None = None,
    scheduler: str | None = None,
    max_sequence_length: int | None = None,
    weight_name: str | None = None,
    tiny_seed: int = 0,
    torch_dtype: torch.dtype | None = None,
    device: str | None = None,
) -> torch.Tensor:
    """Images ``[N, 3, H, W]`` in ``[0, 1]``: ``model`` (``"tiny"``, a folder or a Hub id) plus the diffusers LoRA in
    ``lora`` (``load_lora_weights``). Unset settings come from the LoRA folder's ``marble_trl.json`` (the training
    sampler), else the pipeline's defaults; one generator seeded with ``seed`` for the whole batch."""
    from .models import load_sd3_pipeline
    from .rollout import make_scheduler

    settings = read_sampling_settings(lora)
    steps = num_inference_steps or settings.get("num_inference_steps") or 28
    guidance = guidance_scale if guidance_scale is not None else settings.get("guidance_scale", 1.0)
    resolution = resolution or settings.get("resolution")
    scheduler = scheduler or settings.get("scheduler") or "pipeline"
    max_len = max_sequence_length or settings.get("max_sequence_length") or 256
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if torch_dtype is None:
        torch_dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    # float32 is every pipeline's own dtype: no cast (diffusers warns on casts)
    pipe = load_sd3_pipeline(
        model, torch_dtype=None if torch_dtype == torch.float32 else torch_dtype, tiny_seed=tiny_seed
    )
    if lora is not None:
        folder = Path(lora)
        if weight_name is None and not (folder / DIFFUSERS_WEIGHTS).is_file() and (folder / PEFT_WEIGHTS).is_file():
            raise ValueError(
                f"{folder} holds a PEFT-format LoRA; `load_lora_weights` needs the diffusers format "
                "(marble-trl export --format diffusers)."
            )
        pipe.load_lora_weights(str(folder), weight_name=weight_name)
    pipe.scheduler = make_scheduler(scheduler, pipe.scheduler)
    pipe.set_progress_bar_config(disable=True)
    pipe.to(device)
    size = {"height": resolution, "width": resolution} if resolution else {}
    return pipe(
        prompts,
        num_inference_steps=steps,
        guidance_scale=guidance,
        max_sequence_length=max_len,
        output_type="pt",
        generator=torch.Generator().manual_seed(seed),
        **size,
    ).images.float()


def read_sampling_settings(lora: str | os.PathLike | None) -> dict[str, Any]:
    path = Path(lora) / EXPORT_CONFIG_FILE if lora is not None else None
    if path is None or not path.is_file():
        return {}
    return json.loads(path.read_text(encoding="utf-8")).get("sampling", {})


def slug(text: str, limit: int = 40) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")[:limit] or "image"


def generate_to_folder(model: str, prompts: list[str], output: str | os.PathLike, **kwargs) -> list[Path]:
    """:func:`generate_images`, written as ``output/000-<prompt>.png`` ... plus ``output/prompts.json``."""
    from .rewards.images import to_pil

    output = Path(output)
    output.mkdir(parents=True, exist_ok=True)
    images = generate_images(model, prompts, **kwargs)
    paths = []
    for i, (image, prompt) in enumerate(zip(to_pil(images), prompts)):
        path = output / f"{i:03d}-{slug(prompt)}.png"
        image.save(path)
        paths.append(path)
    record = {"model": model, "lora": str(kwargs.get("lora")), "seed": kwargs.get("seed", 0)}
    record["images"] = {p.name: prompt for p, prompt in zip(paths, prompts)}
    (output / "prompts.json").write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
    return paths


# -------------------------------------------------------------------------------------------------- export
def export_checkpoint(
    checkpoint: str | os.PathLike,
    output: str | os.PathLike,
    *,
    ema: bool = False,
    fmt: str = "diffusers",
    base_model: str | None = None,
    sample_prompts: list[str] | None = None,
    model: str | None = None,
    tiny_seed: int = 0,
    seed: int = 0,
    repo_id: str | None = None,
    license: str | None = None,
    overwrite: bool = False,
) -> Path:
    """Write a publishable LoRA folder from ``checkpoint`` (a ``checkpoint-N`` folder). Returns ``output``.

    ``ema`` exports the parameter EMA instead of the trained weights. ``sample_prompts`` renders sample images with
    ``model`` (default: the checkpoint's base model) plus the exported LoRA, through ``load_lora_weights``.
    """
    if fmt not in FORMATS:
        raise ValueError(f"format must be one of {FORMATS}, got {fmt!r}.")
    checkpoint, output = Path(checkpoint), Path(output)
    manifest = read_manifest(checkpoint)
    if output.exists() and any(output.iterdir()) and not overwrite:
        raise FileExistsError(f"{output} exists and is not empty (pass overwrite=True / --overwrite).")
    files = manifest["files"]
    if ema and not files.get("param_ema"):
        raise ValueError(f"{checkpoint} has no parameter EMA: the run used param_ema=False.")
    tensors, lora_config = read_lora_file(checkpoint / (files["param_ema"] if ema else files["lora"]))
    base = base_model or manifest.get("base_model")
    output.mkdir(parents=True, exist_ok=True)
    for stale in (DIFFUSERS_WEIGHTS, PEFT_WEIGHTS, "adapter_config.json"):
        (output / stale).unlink(missing_ok=True)
    if fmt == "diffusers":
        write_diffusers_lora(output, tensors, lora_config)
    else:
        write_peft_lora(output, tensors, lora_config, base)
    info = card_info_from_checkpoint(
        checkpoint, base_model=base, weights="ema" if ema else "raw", lora_format=fmt, repo_id=repo_id, license=license
    )
    write_export_config(output, info, source=str(checkpoint.resolve()))
    if sample_prompts:
        model = model or base
        if model is None:
            raise ValueError("Sample images need the base model: pass model= / --model.")
        with tempfile.TemporaryDirectory() as tmp:
            lora_dir = output
            if fmt == "peft":  # render through diffusers' loader all the same
                lora_dir = Path(tmp)
                write_diffusers_lora(lora_dir, tensors, lora_config)
                write_export_config(lora_dir, info)
            images = generate_images(model, list(sample_prompts), lora_dir, seed=seed, tiny_seed=tiny_seed)
        info.samples = save_samples(images, list(sample_prompts), output)
    write_model_card(info, output)
    return output
