"""``marble-trl generate``."""

from __future__ import annotations

import argparse
from pathlib import Path

from .train import DTYPES


def _generate_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="marble-trl generate", description="Images from a base model plus a LoRA.")
    p.add_argument(
        "--model",
        default="tiny",
        help="An offline model ('tiny', 'tiny-flux', ...), a local diffusers folder or a Hub id (docs/models.md).",
    )
    p.add_argument("--lora", help="A diffusers-format LoRA folder (export output, output_dir, checkpoint-N).")
    p.add_argument("--prompts", nargs="+", required=True, help="One image per prompt.")
    p.add_argument(
        "--source_images",
        nargs="+",
        help="An editing model's images to edit: one for every prompt, or one per prompt (paths).",
    )
    p.add_argument("--output", required=True, help="Folder for 000-<prompt>.png ... and prompts.json.")
    p.add_argument("--seed", type=int, default=0, help="Seed of the one generator used for the whole batch.")
    p.add_argument("--steps", type=int, help="Sampler steps (default: the LoRA's marble_trl.json, else 28).")
    p.add_argument(
        "--num_frames", type=int, help="Frames per video (video families; default: the LoRA's, else the model's)."
    )
    p.add_argument("--guidance_scale", type=float, help="CFG scale (default: the training setting, else 1.0).")
    p.add_argument("--resolution", type=int, help="Image size (default: the training setting, else the model's).")
    p.add_argument("--scheduler", help="euler, heun, dpm2, pipeline or a diffusers scheduler class name.")
    p.add_argument("--max_sequence_length", type=int, help="T5 prompt length (default: the training setting).")
    p.add_argument("--weight_name", help="LoRA file inside --lora (e.g. param_ema.safetensors in a checkpoint).")
    p.add_argument(
        "--tiny_seed", type=int, help="Seed of the tiny model (--model tiny; default: the --lora folder's, else 0)."
    )
    p.add_argument("--torch_dtype", choices=DTYPES, default="auto", help="'auto': bf16 on CUDA, else float32.")
    p.add_argument("--device", help="Default: cuda if available, else cpu.")
    return p


def generate_command(argv: list[str]) -> list[Path]:
    import torch

    from ..publish.export import generate_to_folder

    a = _generate_parser().parse_args(argv)
    dtype = None if a.torch_dtype == "auto" else getattr(torch, a.torch_dtype)
    paths = generate_to_folder(
        a.model, a.prompts, a.output, lora=a.lora, seed=a.seed, num_inference_steps=a.steps,
        guidance_scale=a.guidance_scale, resolution=a.resolution, scheduler=a.scheduler,
        max_sequence_length=a.max_sequence_length, weight_name=a.weight_name, tiny_seed=a.tiny_seed,
        torch_dtype=dtype, device=a.device, num_frames=a.num_frames, source_images=a.source_images,
    )  # fmt: skip
    print(
        f"[marble-trl] wrote {len(paths)} {'videos' if paths and paths[0].suffix != '.png' else 'images'} to {a.output}"
    )
    return paths
