"""Export of a full fine-tune (``use_peft=False``): a run folder's ``transformer/`` (the whole fine-tuned transformer,
a diffusers model folder) with ``marble_trl.json``, the model card and optional sample images. The LoRA export is
:mod:`.export`'s; :func:`~.export.export_checkpoint` hands a full run's folder here."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from ..artifacts import MANIFEST_FILE, TRANSFORMER_DIR
from ..evaluation.samples import save_samples
from ..persistence.checkpoint import checksum_mismatches, read_manifest
from ..persistence.full_weights import overwrite_from_file
from .card import write_model_card
from .run_info import card_info_from_checkpoint, write_export_config
from .staging import staged_folder


def export_full(
    source: Path,
    output: Path,
    *,
    ema: bool,
    fmt: str,
    base_model: str | None,
    sample_prompts: list[str] | None,
    model: str | None,
    tiny_seed: int | None,
    seed: int,
    repo_id: str | None,
    license: str | None,
    render,
    source_images=None,
) -> Path:
    """Write ``output`` from the full run folder ``source``, atomically; ``render`` draws the samples
    (``generate_images``; an editing model's edit ``source_images``)."""
    if fmt != "diffusers":
        raise ValueError(f"{source} is a full fine-tune: it exports as a diffusers model folder (--format diffusers).")
    ema_file = None
    if (source / MANIFEST_FILE).is_file():
        manifest = read_manifest(source)
        files = manifest["files"]
        exported = [str(source / TRANSFORMER_DIR), *([str(source / files["param_ema"])] if ema else [])]
        bad = [m for m in checksum_mismatches(source, manifest) if m.startswith(tuple(exported))]
        if bad:
            raise ValueError(f"Not exporting {source}: {bad[0]}. Export an earlier checkpoint-N instead.")
        if ema and not files.get("param_ema"):
            raise ValueError(f"{source} has no parameter EMA: the run used param_ema=False.")
        ema_file = files.get("param_ema") if ema else None
    elif ema:
        raise ValueError(f"{source} is a run's output folder: the parameter EMA is saved in checkpoint-N folders.")
    info = card_info_from_checkpoint(
        source, base_model=base_model, lora_format="full", repo_id=repo_id, license=license, tiny_seed=tiny_seed
    )
    info.weights = "ema" if ema else "raw"
    render_model = model or info.base_model
    if sample_prompts and render_model is None:
        raise ValueError(f"Sample images need the base model, and {source} records none: pass --model.")
    with staged_folder(output) as staging:
        write_transformer(source, staging, ema_file)
        write_export_config(staging, info, source=str(source.resolve()))
        if sample_prompts:
            images = render(render_model, list(sample_prompts), staging, seed=seed, tiny_seed=info.tiny_seed or 0,
                            source_images=source_images)  # fmt: skip
            info.samples = save_samples(images, list(sample_prompts), staging)
        write_model_card(info, staging)
    return output


def write_transformer(source: Path, staging: Path, ema_file: str | os.PathLike | None) -> None:
    """``source/transformer`` into ``staging`` as it is (bit for bit), or with the parameter EMA's weights."""
    if ema_file is None:
        shutil.copytree(source / TRANSFORMER_DIR, staging / TRANSFORMER_DIR)
        return
    from diffusers import AutoModel

    transformer = AutoModel.from_pretrained(str(source / TRANSFORMER_DIR))
    overwrite_from_file(transformer, source / ema_file)
    transformer.save_pretrained(str(staging / TRANSFORMER_DIR), safe_serialization=True)
