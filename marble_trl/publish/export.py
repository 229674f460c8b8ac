"""Checkpoint -> publishable LoRA folder, and images from a base model plus a LoRA.

:func:`export_checkpoint` turns a run folder (a ``checkpoint-N`` folder, or the final ``output_dir`` of a run) into a
folder ready for the Hub, atomically: the LoRA (raw weights, or the parameter EMA of a checkpoint) in diffusers format
(``pytorch_lora_weights.safetensors`` with adapter metadata, loads with
``StableDiffusion3Pipeline.load_lora_weights``) or PEFT format (``adapter_model.safetensors`` + ``adapter_config.json``,
loads with ``peft.PeftModel.from_pretrained(pipe.transformer, folder)``), ``marble_trl.json`` (base model and sampling
settings, the tiny model's seed), optional sample images, and the model card (``README.md``).

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

from ..artifacts import (
    EXPORT_CONFIG_FILE,
    LORA_FILE,
    LORA_KEY_PREFIX,
    MANIFEST_FILE,
    MODEL_CARD_FILE,
    PEFT_CONFIG_FILE,
    PEFT_WEIGHTS_FILE,
    SAMPLES_DIR,
    TRANSFORMER_DIR,
)
from ..evaluation.samples import save_samples
from ..models.sd3 import save_sd3_lora
from ..persistence.checkpoint import checksum_mismatches, read_manifest
from ..persistence.full_weights import is_full_finetune, load_full_transformer
from .card import write_model_card
from .export_full import export_full
from .run_info import card_info_from_checkpoint, read_export_config, write_export_config
from .staging import staged_folder

FORMATS = ("diffusers", "peft")


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
    config = {k[len(LORA_KEY_PREFIX) :]: v for k, v in json.loads(raw).items() if k.startswith(LORA_KEY_PREFIX)}
    return load_file(str(path)), config


def write_diffusers_lora(folder: Path, tensors: dict[str, torch.Tensor], lora_config: dict[str, Any]) -> Path:
    # Every family's transformer LoRA file has this one format (``transformer.``-prefixed diffusers keys and the
    # adapter metadata), which each family pipeline's load_lora_weights reads (tested for every family).
    save_sd3_lora(folder, tensors, lora_config)
    return folder / LORA_FILE


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
    weights = {"base_model.model." + k[len(LORA_KEY_PREFIX) :]: v.contiguous() for k, v in tensors.items()}
    save_file(weights, str(folder / PEFT_WEIGHTS_FILE), metadata={"format": "pt"})
    return folder / PEFT_WEIGHTS_FILE


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
    tiny_seed: int | None = None,
    torch_dtype: torch.dtype | None = None,
    device: str | None = None,
    negative_prompt: str | None = None,
    num_frames: int | None = None,
    source_images: Any = None,
) -> torch.Tensor:
    """Images ``[N, 3, H, W]`` in ``[0, 1]``: ``model`` (``"tiny"``, a folder or a Hub id) plus the diffusers LoRA in
    ``lora`` (``load_lora_weights``). Unset settings come from the LoRA folder's ``marble_trl.json`` (the training
    sampler), else the pipeline's defaults; one generator seeded with ``seed`` for the whole batch. ``tiny_seed``
    (model ``"tiny"``) defaults to the seed the LoRA folder records, else 0. An editing model edits ``source_images``
    (paths, PIL images or a ``[N, 3, H, W]`` tensor in ``[0, 1]``: one per prompt, or one for every prompt)."""
    from ..models import load_model
    from ..models.editing import source_kwargs
    from ..rollout.solvers import make_scheduler

    settings = read_sampling_settings(lora)
    if tiny_seed is None:
        tiny_seed = int((read_export_config(lora) if lora is not None else {}).get("tiny_seed") or 0)
    steps = num_inference_steps or settings.get("num_inference_steps") or 28
    guidance = guidance_scale if guidance_scale is not None else settings.get("guidance_scale", 1.0)
    resolution = resolution or settings.get("resolution")
    scheduler = scheduler or settings.get("scheduler") or "pipeline"
    max_len = max_sequence_length or settings.get("max_sequence_length") or 256
    negative_prompt = negative_prompt if negative_prompt is not None else settings.get("negative_prompt") or ""
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if torch_dtype is None:
        torch_dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    # float32 is every pipeline's own dtype: no cast (diffusers warns on casts)
    adapter = load_model(model, torch_dtype=None if torch_dtype == torch.float32 else torch_dtype, tiny_seed=tiny_seed)
    pipe = adapter.pipeline
    if lora is not None and is_full_finetune(lora):  # use_peft=False: the fine-tuned transformer replaces the base's
        pipe.transformer = load_full_transformer(pipe, lora, weight_name)
    elif lora is not None:
        folder = Path(lora)
        if weight_name is None and not (folder / LORA_FILE).is_file() and (folder / PEFT_WEIGHTS_FILE).is_file():
            raise ValueError(
                f"{folder} holds a PEFT-format LoRA; `load_lora_weights` needs the diffusers format "
                "(marble-trl export --format diffusers)."
            )
        pipe.load_lora_weights(str(folder), weight_name=weight_name)
    pipe.set_progress_bar_config(disable=True)
    pipe.to(device)
    if num_frames is not None or settings.get("num_frames"):
        adapter.num_frames = num_frames or settings["num_frames"]
    # Through the family adapter, as the trainer samples: the same conditioning, guidance convention and sampler.
    resolution = resolution or pipe.default_sample_size * pipe.vae_scale_factor
    sources = source_kwargs(adapter, edit_sources(adapter, source_images, len(prompts)))
    cond = adapter.encode(list(prompts), max_len, torch.device(device), guidance, **sources)
    negative = None
    if adapter.needs_negative(guidance):
        negative = adapter.encode([negative_prompt] * len(prompts), max_len, torch.device(device), **sources)
    latents = adapter.sample(
        make_scheduler(scheduler, pipe.scheduler), cond, steps, resolution, torch.Generator().manual_seed(seed),
        guidance, negative,
    )  # fmt: skip
    return adapter.decode(latents).float()


def edit_sources(adapter, source_images: Any, count: int) -> torch.Tensor | None:
    """An editing model's source pixels for ``count`` prompts (one image repeated for all, or one each); ``None``
    for a text-to-image model, which refuses them."""
    from ..data.source_images import SourceImageLoader
    from ..models.editing import repeat_sources

    if not adapter.editing:
        if source_images is not None:
            raise ValueError("source_images are for editing models; this one generates from text alone.")
        return None
    if source_images is None:
        raise ValueError(
            f"{type(adapter.pipeline).__name__} edits images: give the image(s) to edit (--source_images / "
            "source_images=), one for every prompt or one per prompt."
        )
    return repeat_sources(SourceImageLoader(adapter.source_resolution)(source_images), count)


def read_sampling_settings(lora: str | os.PathLike | None) -> dict[str, Any]:
    path = Path(lora) / EXPORT_CONFIG_FILE if lora is not None else None
    if path is None or not path.is_file():
        return {}
    return json.loads(path.read_text(encoding="utf-8")).get("sampling", {})


def slug(text: str, limit: int = 40) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")[:limit] or "image"


def generate_to_folder(model: str, prompts: list[str], output: str | os.PathLike, **kwargs) -> list[Path]:
    """:func:`generate_images`, written as ``output/000-<prompt>.png`` ... (videos: ``.mp4`` or ``.gif``) plus
    ``output/prompts.json``."""
    from ..evaluation.samples import write_video
    from ..rewards.images import to_pil

    output = Path(output)
    output.mkdir(parents=True, exist_ok=True)
    images = generate_images(model, prompts, **kwargs)
    paths = []
    if images.ndim == 5:
        paths = [write_video(v, output / f"{i:03d}-{slug(p)}") for i, (v, p) in enumerate(zip(images, prompts))]
    for i, (image, prompt) in enumerate(zip(to_pil(images) if images.ndim == 4 else [], prompts)):
        path = output / f"{i:03d}-{slug(prompt)}.png"
        image.save(path)
        paths.append(path)
    record = {"model": model, "lora": str(kwargs.get("lora")), "seed": kwargs.get("seed", 0)}
    record["images"] = {p.name: prompt for p, prompt in zip(paths, prompts)}
    (output / "prompts.json").write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
    return paths


# -------------------------------------------------------------------------------------------------- export
# What an export folder holds: the only entries `overwrite` may replace.
EXPORT_ENTRIES = {LORA_FILE, PEFT_WEIGHTS_FILE, PEFT_CONFIG_FILE, EXPORT_CONFIG_FILE, MODEL_CARD_FILE, SAMPLES_DIR,
                  TRANSFORMER_DIR}  # fmt: skip


def read_run_folder(folder: str | os.PathLike, ema: bool = False) -> dict[str, Any]:
    """The LoRA file to export from ``folder`` and what the folder records about it.

    ``folder`` is a ``checkpoint-N`` folder (its manifest names the files, the parameter EMA included) or any folder
    with the trained LoRA and a ``marble_trl.json``: a run's final ``output_dir``, an export folder.
    """
    folder = Path(folder)
    if not folder.is_dir():
        raise FileNotFoundError(f"{str(folder)!r} does not exist.")
    config = read_export_config(folder)
    if (folder / MANIFEST_FILE).is_file() or not config:
        if not config and not (folder / MANIFEST_FILE).is_file() and (folder / LORA_FILE).is_file():
            raise ValueError(
                f"{folder} has {LORA_FILE} but neither {MANIFEST_FILE} (a checkpoint) nor {EXPORT_CONFIG_FILE} "
                "(a run's output_dir): it was not written by marble_trl."
            )
        manifest = read_manifest(folder)  # the clear error for other folders (tmp-checkpoint-N, ...)
        files = manifest["files"]
        bad = [m for m in checksum_mismatches(folder, manifest) if m.startswith(str(folder / files["lora"])) or (
            files.get("param_ema") and m.startswith(str(folder / files["param_ema"])))]  # fmt: skip
        if bad:
            raise ValueError(f"Not exporting {folder}: {bad[0]}. Export an earlier checkpoint-N instead.")
        if ema and not files.get("param_ema"):
            raise ValueError(f"{folder} has no parameter EMA: the run used param_ema=False.")
        return {"kind": "checkpoint", "lora": folder / (files["param_ema"] if ema else files["lora"])}
    if ema:
        raise ValueError(
            f"{folder} is a run's output folder, which holds only the trained LoRA: the parameter EMA is saved in "
            "checkpoints. Export --ema from a checkpoint-N folder (a run with param_ema=True and save_strategy "
            "'steps' or 'epoch')."
        )
    if not (folder / LORA_FILE).is_file():
        raise ValueError(f"{folder} has {EXPORT_CONFIG_FILE} but no {LORA_FILE} (the diffusers-format LoRA).")
    return {"kind": "run", "lora": folder / LORA_FILE}


def export_checkpoint(
    checkpoint: str | os.PathLike,
    output: str | os.PathLike,
    *,
    ema: bool = False,
    fmt: str = "diffusers",
    base_model: str | None = None,
    sample_prompts: list[str] | None = None,
    model: str | None = None,
    tiny_seed: int | None = None,
    seed: int = 0,
    repo_id: str | None = None,
    license: str | None = None,
    overwrite: bool = False,
    source_images: Any = None,
) -> Path:
    """Write a publishable LoRA folder from a run folder ``checkpoint`` (a ``checkpoint-N`` folder or a run's final
    ``output_dir``). Returns ``output``.

    ``ema`` exports the parameter EMA instead of the trained weights (checkpoints only). ``sample_prompts`` renders
    sample images with ``model`` (default: the run's base model; ``tiny`` with its recorded seed unless
    ``tiny_seed`` is given) plus the exported LoRA, through ``load_lora_weights``; an editing model's samples edit
    ``source_images`` (one for every prompt, or one per prompt).

    The folder is written next to ``output`` under a temporary name and renamed at the end: when anything fails
    (say, rendering the samples) no partial ``output`` is left, and an ``output`` being replaced (``overwrite``) is
    kept as it was.
    """
    if fmt not in FORMATS:
        raise ValueError(f"format must be one of {FORMATS}, got {fmt!r}.")
    source, output = Path(checkpoint), Path(output)
    if is_full_finetune(source):  # use_peft=False: the fine-tuned transformer, not a LoRA
        _check_output(source, output, overwrite)
        return export_full(
            source, output, ema=ema, fmt=fmt, base_model=base_model, sample_prompts=sample_prompts, model=model,
            tiny_seed=tiny_seed, seed=seed, repo_id=repo_id, license=license, render=generate_images,
            source_images=source_images,
        )  # fmt: skip
    found = read_run_folder(source, ema=ema)
    _check_output(source, output, overwrite)
    info = card_info_from_checkpoint(
        source, base_model=base_model, lora_format=fmt, repo_id=repo_id, license=license, tiny_seed=tiny_seed
    )
    if found["kind"] == "checkpoint":
        info.weights = "ema" if ema else "raw"
    base = info.base_model
    render_model = model or base
    if sample_prompts and render_model is None:
        raise ValueError(
            f"Sample images need the base model, and {source} records none: pass --model (or --base_model)."
        )
    tensors, lora_config = read_lora_file(found["lora"])
    with staged_folder(output) as staging:
        if fmt == "diffusers":
            write_diffusers_lora(staging, tensors, lora_config)
        else:
            write_peft_lora(staging, tensors, lora_config, base)
        write_export_config(staging, info, source=str(source.resolve()))
        if sample_prompts:
            with tempfile.TemporaryDirectory() as tmp:
                lora_dir = staging
                if fmt == "peft":  # render through diffusers' loader all the same
                    lora_dir = Path(tmp)
                    write_diffusers_lora(lora_dir, tensors, lora_config)
                    write_export_config(lora_dir, info)
                images = generate_images(
                    render_model, list(sample_prompts), lora_dir, seed=seed, tiny_seed=info.tiny_seed or 0,
                    source_images=source_images,
                )  # fmt: skip
            info.samples = save_samples(images, list(sample_prompts), staging)
        write_model_card(info, staging)
    return output


def _check_output(source: Path, output: Path, overwrite: bool) -> None:
    """``output`` may be new or empty; with ``overwrite``, a previous export (nothing but export files)."""
    if not output.exists():
        return
    if not output.is_dir():
        raise FileExistsError(f"{output} exists and is not a folder.")
    entries = {p.name for p in output.iterdir()}
    if not entries:
        return
    if not overwrite:
        raise FileExistsError(f"{output} exists and is not empty (pass overwrite=True / --overwrite to replace it).")
    resolved = output.resolve()
    if resolved == source.resolve() or resolved in source.resolve().parents:
        raise ValueError(f"--output {output} holds the folder being exported ({source}); choose another folder.")
    others = sorted(entries - EXPORT_ENTRIES)
    if others:
        raise FileExistsError(
            f"{output} holds files an export does not write ({', '.join(others[:5])}): --overwrite replaces only a "
            "previous export folder. Choose another --output."
        )
