"""Evaluation: deterministic images for a prompt set, scored by a list of rewards, summarised across models.

``marble-trl evaluate`` (:func:`evaluate_models`) compares the base model and LoRAs / checkpoints on equal terms: the
same prompts and the same deterministic images (:mod:`marble_trl.evaluation.images`: the noise of image ``i`` of prompt
``p`` seeded from ``(seed, p, i)``), scored by the same rewards (:mod:`marble_trl.evaluation.results`: the summaries,
tables and charts). It writes, under ``--output``:

- ``<model>/scores.jsonl``: one line per (prompt, image) with each reward's score (``null`` = not applicable); a rerun
  reuses the rows already there and generates only the missing ones (``<model>/settings.json`` guards against mixing
  settings);
- ``<model>/images/``: the images of the first ``--grid_prompts`` prompts, and ``<model>/grid.png`` tiling them
  (each captioned with its prompt and scores);
- ``comparison.png``: those images side by side, one column per model, one row per (prompt, image), same seeds;
- ``results.md`` and ``results.csv``: per model, each reward's mean and standard error, and the paper's composite
  (the mean over rewards of the model's z-score against the compared models; :mod:`marble_trl.evaluation.scores`);
- ``rewards.png``: a bar chart of each reward's mean and standard error per model (needs matplotlib).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..artifacts import EVAL_SETTINGS_FILE, LORA_FILE, PEFT_WEIGHTS_FILE
from ..data.source_images import SOURCE_IMAGES_COLUMN
from ..models.editing import beside
from ..persistence.full_weights import is_full_finetune, load_full_transformer
from .images import generate_eval_images, sample_seed, save_file_grid
from .results import save_comparison, save_reward_chart, summarize_scores, write_results

SCORES_FILE = "scores.jsonl"
GRID_FILE = "grid.png"
COMPARISON_FILE = "comparison.png"
REWARD_CHART_FILE = "rewards.png"
BASE_MODEL_NAME = "base"


@dataclass
class EvalSettings:
    """Sampler and scoring settings of ``marble-trl evaluate`` (recorded per model in ``settings.json``)."""

    reward_funcs: list[str]
    num_images_per_prompt: int = 1
    num_sample_steps: int = 40
    scheduler: str = "euler"
    guidance_scale: float = 1.0
    negative_prompt: str = ""
    resolution: int | None = None
    max_sequence_length: int | None = None
    seed: int = 0
    batch_size: int = 8
    grid_prompts: int = 8
    reward_kwargs: dict[str, dict[str, Any]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.reward_funcs:
            raise ValueError("reward_funcs is empty: name at least one reward (--reward_funcs brightness ...).")
        for name, value, low in (
            ("num_images_per_prompt", self.num_images_per_prompt, 1),
            ("num_sample_steps", self.num_sample_steps, 1),
            ("batch_size", self.batch_size, 1),
            ("grid_prompts", self.grid_prompts, 0),
        ):
            if value < low:
                raise ValueError(f"{name} must be >= {low}, got {value}.")
        if self.guidance_scale < 1.0:
            raise ValueError(f"guidance_scale must be >= 1.0 (1.0 = CFG-free), got {self.guidance_scale}.")


@dataclass
class ModelSpec:
    """One compared model: the base model (``lora=None``) or the base plus a LoRA folder."""

    name: str
    lora: str | None = None
    weight_name: str | None = None


def model_specs(loras: Sequence[str], include_base: bool = True, weight_name: str | None = None) -> list[ModelSpec]:
    """The compared models, named ``base`` and by folder (``parent/folder`` when folder names collide)."""
    specs = [ModelSpec(BASE_MODEL_NAME)] if include_base else []
    paths = [Path(p).expanduser() for p in loras]
    for path in paths:
        if not path.is_dir():
            raise FileNotFoundError(
                f"--lora {str(path)!r} is not a folder: give a LoRA folder (output_dir, checkpoint-N, an export)."
            )
    names = [p.resolve().name for p in paths]
    for path, name in zip(paths, names):
        if names.count(name) > 1 or name == BASE_MODEL_NAME:
            name = f"{path.resolve().parent.name}-{name}"
        specs.append(ModelSpec(name, str(path), weight_name))
    seen: dict[str, int] = {}
    for spec in specs:
        n = seen.get(spec.name, 0)
        seen[spec.name] = n + 1
        if n:
            spec.name = f"{spec.name}-{n + 1}"
    if not specs:
        raise ValueError("Nothing to evaluate: give --lora folders, or keep the base model.")
    return specs


def editing_sources(pipe, dataset):
    """An editing model's reader of the prompt set's ``source_images`` (every row checked first), else ``None``."""
    from ..data.source_images import SourceImageLoader, check_source_images
    from ..models import adapter_for

    adapter = adapter_for(pipe)
    if not adapter.editing:
        return None
    check_source_images(dataset, name="prompt set")
    return SourceImageLoader(adapter.source_resolution)


def _safe_dirname(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in name)


def _read_scores(path: Path) -> dict[tuple[int, int], dict[str, Any]]:
    rows: dict[tuple[int, int], dict[str, Any]] = {}
    if not path.is_file():
        return rows
    for line in path.read_text(encoding="utf-8").splitlines():
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut by an interrupted run: regenerated
        rows[(int(row["prompt_index"]), int(row["image_index"]))] = row
    return rows


def _check_settings(folder: Path, settings: dict[str, Any]) -> None:
    path = folder / EVAL_SETTINGS_FILE
    if path.is_file():
        old = json.loads(path.read_text(encoding="utf-8"))
        if old != settings:
            diff = sorted(k for k in set(old) | set(settings) if old.get(k) != settings.get(k))
            raise ValueError(
                f"{folder} holds scores made with other settings ({', '.join(diff)} differ); use another --output, or "
                f"delete {folder} to rescore."
            )
    folder.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(settings, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def evaluate_models(
    model: str,
    models: Sequence[ModelSpec],
    dataset,
    settings: EvalSettings,
    output: str | os.PathLike,
    *,
    tiny_seed: int = 0,
    torch_dtype: torch.dtype | None = None,
    device: str | None = None,
    progress: bool = True,
) -> list[dict[str, Any]]:
    """Score every model on every (prompt, image) of ``dataset``; write the per-model files and the results tables.

    Returns the result rows (one per model: ``model``, ``{reward}/mean``, ``{reward}/sem``, ``composite``).
    """
    from tqdm.auto import tqdm

    from ..data.prompts import check_prompt_dataset
    from ..models import TINY_MODEL_NAMES, load_model
    from ..publish.export import read_sampling_settings
    from ..rewards import resolve_reward_funcs, reward_name, score_rewards
    from ..rewards.images import to_pil
    from ..rollout.solvers import make_scheduler

    funcs = resolve_reward_funcs(list(settings.reward_funcs), settings.reward_kwargs)  # unknown names fail first
    check_prompt_dataset(dataset, name="prompt set")
    names = [reward_name(f) for f in funcs]
    output = Path(output)
    output.mkdir(parents=True, exist_ok=True)
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if torch_dtype is None:
        torch_dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    pipe = None
    prompts = list(dataset["prompt"])
    extra = [c for c in dataset.column_names if c != "prompt"]
    columns_all = {c: list(dataset[c]) for c in extra}
    sources = columns_all.get("source")
    n_img = settings.num_images_per_prompt
    items = [(p, i) for p in range(len(prompts)) for i in range(n_img)]
    grid_n = min(settings.grid_prompts, len(prompts))
    # One resolution and prompt length for every model (compared on equal terms): given, else the first LoRA's
    # training settings (marble_trl.json), else the pipeline's default size and 256 tokens.
    first = next((read_sampling_settings(m.lora) for m in models if m.lora), {})
    resolution = settings.resolution or first.get("resolution")
    max_len = settings.max_sequence_length or first.get("max_sequence_length") or 256
    results = []
    sheet_cells: list[tuple[str, list[Path], list[dict[str, Any]]]] = []
    for spec in models:
        folder = output / _safe_dirname(spec.name)
        record = {
            "model": model,
            "tiny_seed": tiny_seed if model in TINY_MODEL_NAMES else None,
            "lora": str(Path(spec.lora).resolve()) if spec.lora else None,
            "weight_name": spec.weight_name,
            "prompts": prompts,
            "rewards": names,
            "num_images_per_prompt": n_img,
            "num_sample_steps": settings.num_sample_steps,
            "scheduler": settings.scheduler,
            "guidance_scale": settings.guidance_scale,
            "negative_prompt": settings.negative_prompt,
            "resolution": resolution,
            "max_sequence_length": max_len,
            "seed": settings.seed,
        }
        _check_settings(folder, record)
        done = _read_scores(folder / SCORES_FILE)
        todo = [it for it in items if it not in done]
        images_dir = folder / "images"
        todo_grid = [
            (p, i) for p in range(grid_n) for i in range(n_img) if not (images_dir / f"{p:05d}-{i:02d}.png").is_file()
        ]
        todo = sorted(set(todo) | set(todo_grid))
        if todo:
            if pipe is None:
                pipe = load_model(
                    model, torch_dtype=None if torch_dtype == torch.float32 else torch_dtype, tiny_seed=tiny_seed
                ).pipeline
                pipe.set_progress_bar_config(disable=True)
                pipe.to(device)
                scheduler = make_scheduler(settings.scheduler, pipe.scheduler)
                source_loader = editing_sources(pipe, dataset)
            base_transformer = pipe.transformer
            full = spec.lora is not None and is_full_finetune(spec.lora)
            if full:  # a full fine-tune: its transformer replaces the base's for this model
                pipe.transformer = load_full_transformer(pipe, spec.lora, spec.weight_name)
            elif spec.lora is not None:
                lora_dir = Path(spec.lora)
                if spec.weight_name is None and not (lora_dir / LORA_FILE).is_file():
                    hint = (
                        " It holds a PEFT-format LoRA; export it with --format diffusers."
                        if (lora_dir / PEFT_WEIGHTS_FILE).is_file()
                        else ""
                    )
                    raise FileNotFoundError(f"--lora {lora_dir} has no {LORA_FILE}.{hint}")
                pipe.load_lora_weights(str(lora_dir), weight_name=spec.weight_name)
            res = resolution or pipe.default_sample_size * pipe.vae_scale_factor
            images_dir.mkdir(parents=True, exist_ok=True)
            try:
                with (folder / SCORES_FILE).open("a", encoding="utf-8") as f:
                    bar = tqdm(total=len(todo), desc=f"evaluate {spec.name}", unit="img", disable=not progress)
                    for start in range(0, len(todo), settings.batch_size):
                        chunk = todo[start : start + settings.batch_size]
                        batch_prompts = [prompts[p] for p, _ in chunk]
                        batch_sources = None  # an editing model edits each row's source image
                        if source_loader is not None:
                            batch_sources = source_loader([columns_all[SOURCE_IMAGES_COLUMN][p] for p, _ in chunk])
                        images = generate_eval_images(
                            pipe,
                            scheduler,
                            batch_prompts,
                            [sample_seed(settings.seed, p, i) for p, i in chunk],
                            num_steps=settings.num_sample_steps,
                            resolution=res,
                            guidance_scale=settings.guidance_scale,
                            negative_prompt=settings.negative_prompt,
                            max_sequence_length=max_len,
                            device=device,
                            source_images=batch_sources,
                        )
                        for (p, i), pil in zip(chunk, to_pil(images)):
                            if p < grid_n:
                                pil.save(images_dir / f"{p:05d}-{i:02d}.png")
                        need = [j for j, it in enumerate(chunk) if it not in done]
                        if need:
                            cols = {c: [columns_all[c][chunk[j][0]] for j in need] for c in extra}
                            if batch_sources is not None:  # the rewards get the source beside each edit
                                cols[SOURCE_IMAGES_COLUMN] = beside(batch_sources[need], images[need])
                            scores = score_rewards(funcs, [batch_prompts[j] for j in need], images[need], cols, names)
                            for col, j in enumerate(need):
                                p, i = chunk[j]
                                values = [None if math.isnan(v) else v for v in scores[:, col].tolist()]
                                row = {"prompt_index": p, "image_index": i, "prompt": prompts[p]}
                                row.update(
                                    {"seed": sample_seed(settings.seed, p, i), "scores": dict(zip(names, values))}
                                )
                                f.write(json.dumps(row) + "\n")
                                done[(p, i)] = row
                            f.flush()
                        bar.update(len(chunk))
                    bar.close()
            finally:
                if full:
                    pipe.transformer = base_transformer
                elif spec.lora is not None:
                    pipe.unload_lora_weights()
        rows = [done[it]["scores"] for it in items]
        row_sources = [sources[p] for p, _ in items] if sources is not None else None
        summary = summarize_scores(names, rows, row_sources)
        result: dict[str, Any] = {"model": spec.name, "lora": spec.lora or "", "images": len(items)}
        for name in names:
            result[f"{name}/mean"] = summary[f"{name}/mean"]
            result[f"{name}/sem"] = summary[f"{name}/sem"]
        # with several prompt sources, each reward's mean on each source where it applies (the papers read PickScore
        # on DrawBench, GenEval on its test split...: the named mixture paper_eval)
        result.update({k: v for k, v in summary.items() if k.count("/") == 2})
        results.append(result)
        if grid_n:
            grid_items = [(p, i) for p in range(grid_n) for i in range(n_img)]
            files = [images_dir / f"{p:05d}-{i:02d}.png" for p, i in grid_items]
            grid_scores = [done[it]["scores"] for it in grid_items]
            save_file_grid(
                files, n_img if n_img > 1 else grid_n, folder / GRID_FILE,
                prompts=[prompts[p] for p, _ in grid_items], scores=grid_scores,
            )  # fmt: skip
            sheet_cells.append((spec.name, files, grid_scores))
    write_results(results, names, output)
    if sheet_cells:
        grid_items = [(p, i) for p in range(grid_n) for i in range(n_img)]
        labels = [
            [prompts[p], f"prompt {p}, image {i}, seed {sample_seed(settings.seed, p, i)}"] for p, i in grid_items
        ]
        save_comparison(sheet_cells, labels, output / COMPARISON_FILE)
    save_reward_chart(results, names, output / REWARD_CHART_FILE)
    return results
