"""``marble-trl evaluate``."""

from __future__ import annotations

import argparse
import dataclasses
import json

from .train import DTYPES


def _evaluate_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="marble-trl evaluate",
        description="Score a base model and LoRAs / checkpoints on a prompt set: results.md, results.csv, per-model "
        "scores.jsonl (resumable), captioned image grids, comparison.png (models side by side) and rewards.png.",
    )
    p.add_argument(
        "--model",
        default="tiny",
        help="An offline model ('tiny', 'tiny-flux', ...), a local diffusers folder or a Hub id (docs/models.md).",
    )
    p.add_argument(
        "--lora",
        nargs="*",
        default=[],
        help="LoRA folders to compare (output_dir, checkpoint-N, export folders; a full fine-tune's too: its "
        "transformer/ replaces the base's); each is one model, named by folder.",
    )
    p.add_argument("--no_base", action="store_true", help="Do not evaluate the base model alone.")
    p.add_argument(
        "--weight_name", help="LoRA file inside each --lora folder (e.g. param_ema.safetensors in a checkpoint)."
    )
    p.add_argument(
        "--prompts",
        nargs="+",
        default=["bundled"],
        help="Prompt source(s): 'bundled', a prompt set ('drawbench', 'pickscore_test', 'ocr_test', 'geneval_test', "
        "...: `marble-trl datasets list`), the mixture 'marble_5rewards_test', a .txt/.json/.jsonl/.csv/.parquet "
        "file or a Hub dataset id (several: concatenated, with a 'source' column).",
    )
    p.add_argument("--split", default="test", help="Split of a Hub dataset id.")
    p.add_argument("--prompt_column", default="prompt", help="Column holding the prompts.")
    p.add_argument("--max_prompts", type=int, help="Use only the first this many prompts of each source.")
    p.add_argument("--reward_funcs", nargs="+", required=True, help="Reward names or dotted paths (docs/rewards.md).")
    p.add_argument("--reward_kwargs", help="Per-reward options as a JSON object keyed by reward name.")
    p.add_argument("--num_images_per_prompt", type=int, default=1, help="Images per prompt, each with its own seed.")
    p.add_argument("--num_sample_steps", type=int, default=40, help="Sampler steps (reference evaluation: 40).")
    p.add_argument("--scheduler", default="euler", help="euler (reference), heun, dpm2, pipeline or a class name.")
    p.add_argument("--guidance_scale", type=float, default=1.0, help="CFG scale (reference evaluation: 1.0).")
    p.add_argument("--negative_prompt", default="", help="Negative prompt (with --guidance_scale > 1).")
    p.add_argument(
        "--resolution", type=int, help="Image size (default: the first LoRA's training size, else the model's)."
    )
    p.add_argument("--max_sequence_length", type=int, help="T5 prompt length (default: the LoRA's, else 256).")
    p.add_argument("--seed", type=int, default=0, help="Image i of prompt p uses noise seeded from (seed, p, i).")
    p.add_argument("--batch_size", type=int, default=8, help="Images per pipeline call.")
    p.add_argument("--grid_prompts", type=int, default=8, help="Prompts in grid.png and comparison.png (0: none).")
    p.add_argument("--output", required=True, help="Folder for results.md, results.csv and one folder per model.")
    p.add_argument("--tiny_seed", type=int, default=0, help="Seed of the tiny model (--model tiny).")
    p.add_argument("--torch_dtype", choices=DTYPES, default="auto", help="'auto': bf16 on CUDA, else float32.")
    p.add_argument("--device", help="Default: cuda if available, else cpu.")
    p.add_argument("--no_progress", action="store_true", help="No progress bar.")
    return p


def evaluate_command(argv: list[str]) -> list[dict]:
    import torch

    from ..data.sources import PromptSource, load_prompt_sources, named_mixture
    from ..evaluation.run import EvalSettings, evaluate_models, model_specs
    from ..evaluation.scores import markdown_table

    a = _evaluate_parser().parse_args(argv)
    try:
        reward_kwargs = json.loads(a.reward_kwargs) if a.reward_kwargs else {}
    except json.JSONDecodeError as err:
        raise ValueError(f"--reward_kwargs must be a JSON object keyed by reward name: {err}.") from err
    settings = EvalSettings(
        reward_funcs=a.reward_funcs, num_images_per_prompt=a.num_images_per_prompt,
        num_sample_steps=a.num_sample_steps, scheduler=a.scheduler, guidance_scale=a.guidance_scale,
        negative_prompt=a.negative_prompt, resolution=a.resolution, max_sequence_length=a.max_sequence_length,
        seed=a.seed, batch_size=a.batch_size, grid_prompts=a.grid_prompts, reward_kwargs=reward_kwargs,
    )  # fmt: skip
    models = model_specs(a.lora, include_base=not a.no_base, weight_name=a.weight_name)
    sources = []
    for path in a.prompts:  # a named mixture contributes its sources (labelled as the mixture labels them)
        for source in named_mixture(path) or [PromptSource(path=path, split=a.split, prompt_column=a.prompt_column)]:
            sources.append(dataclasses.replace(source, max_prompts=a.max_prompts))
    dataset = load_prompt_sources(sources)
    dtype = None if a.torch_dtype == "auto" else getattr(torch, a.torch_dtype)
    results = evaluate_models(
        a.model, models, dataset, settings, a.output, tiny_seed=a.tiny_seed, torch_dtype=dtype, device=a.device,
        progress=not a.no_progress,
    )  # fmt: skip
    columns = ["model", *[f"{n}/mean" for n in a.reward_funcs if f"{n}/mean" in results[0]], "composite"]
    print(markdown_table(results, columns), end="")
    print(f"[marble-trl] evaluated {len(models)} model(s) on {len(dataset)} prompts -> {a.output}")
    return results
