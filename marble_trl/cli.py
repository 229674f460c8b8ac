"""The ``marble-trl`` command.

``marble-trl train --config recipes/tiny-cpu.yaml [--field value ...]``: YAML plus command-line overrides, parsed by
TRL's ``TrlParser`` (so an ``env:`` block in the YAML sets environment variables, as with ``trl``).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from .nft_config import MarbleDiffusionNFTConfig

DTYPES = ("auto", "float32", "bfloat16", "float16")


@dataclass
class MarbleScriptArguments:
    """What to train on: the model, the prompts, the rewards."""

    model_name_or_path: str = field(
        default="tiny",
        metadata={"help": "A local diffusers SD3/SD3.5 folder, a Hub id, or 'tiny' (offline tiny model)."},
    )
    torch_dtype: str = field(
        default="auto",
        metadata={"help": "dtype of the frozen pipeline weights: 'auto' (bf16 when training in bf16), 'float32', ..."},
    )
    tiny_seed: int = field(default=0, metadata={"help": "Seed of the tiny model's random weights (model 'tiny')."})
    dataset_name: str = field(
        default="bundled",
        metadata={
            "help": "Prompts: 'bundled' (the packaged prompt file), a .txt file (one prompt per line), a "
            ".json/.jsonl/.csv/.parquet file or a Hub dataset id with a 'prompt' column."
        },
    )
    dataset_train_split: str = field(default="train", metadata={"help": "Split to train on (datasets files/ids)."})
    reward_funcs: list[str] = field(
        default_factory=list,
        metadata={
            "help": "Reward names or dotted import paths (see docs/rewards.md), e.g. brightness jpeg_compressibility."
        },
    )
    sample_grid_prompts: int = field(
        default=4, metadata={"help": "Prompts in the before/after sample grid (0 disables the grid)."}
    )
    sample_grid_seeds: int = field(default=2, metadata={"help": "Seeds per prompt in the before/after sample grid."})


def load_train_dataset(name: str, split: str = "train"):
    """Load the prompt dataset named by ``dataset_name``."""
    from .data import load_prompt_dataset

    if name == "bundled" or name.endswith(".txt"):
        return load_prompt_dataset(name)
    from datasets import load_dataset

    path = Path(name).expanduser()
    suffix = path.suffix.lstrip(".")
    if suffix in ("json", "jsonl", "csv", "parquet"):
        if not path.is_file():
            raise FileNotFoundError(f"dataset_name {name!r} does not exist.")
        return load_dataset("json" if suffix == "jsonl" else suffix, data_files=str(path), split=split)
    return load_dataset(name, split=split)


def _resolve_dtype(name: str, training_args: MarbleDiffusionNFTConfig):
    import torch

    if name not in DTYPES:
        raise ValueError(f"torch_dtype must be one of {DTYPES}, got {name!r}.")
    if name == "auto":
        return torch.bfloat16 if training_args.bf16 else (torch.float16 if training_args.fp16 else torch.float32)
    return getattr(torch, name)


def train(script_args: MarbleScriptArguments, training_args: MarbleDiffusionNFTConfig) -> dict:
    """Run one training job; writes the LoRA, ``metrics.jsonl`` and ``samples_before_after.png`` to ``output_dir``."""
    from .models import load_sd3_pipeline
    from .nft_trainer import MarbleDiffusionNFTTrainer
    from .samples import save_before_after

    if not script_args.reward_funcs:
        raise ValueError("reward_funcs is empty: name at least one reward (e.g. --reward_funcs brightness).")
    start = time.perf_counter()
    dataset = load_train_dataset(script_args.dataset_name, script_args.dataset_train_split)
    dtype = _resolve_dtype(script_args.torch_dtype, training_args)
    pipeline = load_sd3_pipeline(script_args.model_name_or_path, torch_dtype=dtype, tiny_seed=script_args.tiny_seed)
    trainer = MarbleDiffusionNFTTrainer(pipeline, script_args.reward_funcs, args=training_args, train_dataset=dataset)
    out = Path(training_args.output_dir)
    grid_prompts = list(dict.fromkeys(dataset["prompt"]))[: script_args.sample_grid_prompts]
    seeds = range(script_args.sample_grid_seeds)
    before = None
    if grid_prompts and trainer.is_world_process_zero():
        import torch

        before = torch.cat([trainer.generate(grid_prompts, seed=s, use_lora=False) for s in seeds])
    result = trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
    trainer.save_model(str(out))
    summary = {"global_step": result.global_step, "train_loss": result.training_loss}
    if trainer.is_world_process_zero():
        with open(out / "metrics.jsonl", "w") as f:
            for entry in trainer.state.log_history:
                f.write(json.dumps(entry) + "\n")
        if before is not None:
            import torch

            after = torch.cat([trainer.generate(grid_prompts, seed=s, use_lora=True) for s in seeds])
            scale = max(1, 128 // training_args.resolution)
            save_before_after(before, after, len(grid_prompts), out / "samples_before_after.png", scale=scale)
        summary["wall_time_s"] = round(time.perf_counter() - start, 1)
        (out / "run_summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        print(f"[marble-trl] done: {summary} -> {out}")
    return summary


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    top = argparse.ArgumentParser(prog="marble-trl", description="Multi-reward RL for text-to-image diffusion.")
    top.add_argument("command", choices=["train"], help="train: run DiffusionNFT / MARBLE training from a recipe.")
    if not argv or argv[0] in ("-h", "--help"):
        top.print_help()
        return 0
    ns, rest = top.parse_known_args(argv[:1])
    if ns.command == "train":
        from trl import TrlParser

        parser = TrlParser((MarbleScriptArguments, MarbleDiffusionNFTConfig), prog="marble-trl train")
        script_args, training_args = parser.parse_args_and_config(args=argv[1:])
        train(script_args, training_args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
