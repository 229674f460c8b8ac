"""The ``marble-trl`` command.

- ``marble-trl train --config recipes/tiny-cpu.yaml [--field value ...]``: YAML plus command-line overrides, parsed by
  TRL's ``TrlParser`` (so an ``env:`` block in the YAML sets environment variables, as with ``trl``);
- ``marble-trl export --checkpoint DIR --output DIR [--ema] [--format diffusers|peft]``: a run folder (a checkpoint or
  the final ``output_dir``) as a publishable LoRA folder with a model card (:mod:`marble_trl.export`), optionally
  pushed to the Hub;
- ``marble-trl generate --model tiny|PATH --lora DIR --prompts ... --output DIR``: images from a base model plus a
  LoRA, loaded with diffusers' ``load_lora_weights``;
- ``marble-trl evaluate --model tiny|PATH [--lora DIR ...] --prompts SOURCE --reward_funcs ... --output DIR``: scores
  the base model and each LoRA / checkpoint on a prompt set (:mod:`marble_trl.evaluation`).
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
        metadata={
            "help": "A local diffusers SD3/SD3.5 folder, a Hub id, 'tiny' (offline random tiny model) or 'shapes' (the "
            "ShapesBench base model shipped in the package)."
        },
    )
    torch_dtype: str = field(
        default="auto",
        metadata={"help": "dtype of the frozen pipeline weights: 'auto' (bf16 when training in bf16), 'float32', ..."},
    )
    tiny_seed: int = field(default=0, metadata={"help": "Seed of the tiny model's random weights (model 'tiny')."})
    dataset_name: str = field(
        default="bundled",
        metadata={
            "help": "Prompts: 'bundled' (the packaged prompt file), 'shapes' / 'shapes_eval' / 'shapes_<family>' (the "
            "ShapesBench world, with its metadata columns), a .txt file (one prompt per line), a "
            ".json/.jsonl/.csv/.parquet file or a Hub dataset id with a 'prompt' column."
        },
    )
    dataset_train_split: str = field(default="train", metadata={"help": "Split to train on (Hub dataset ids)."})
    dataset_prompt_column: str = field(
        default="prompt", metadata={"help": "Column of dataset_name / eval_dataset_name holding the prompts."}
    )
    dataset_mixture: list[str] = field(
        default_factory=list,
        metadata={
            "help": "Several prompt sources instead of dataset_name: 'PATH' or 'PATH=RATIO' strings, or (YAML) dicts "
            "with keys path, ratio, name, split, subset, prompt_column, columns, max_prompts (docs/data.md). Adds a "
            "'source' column; ratios set source_ratios."
        },
    )
    eval_dataset_name: str | None = field(
        default=None,
        metadata={
            "help": "Prompts for evaluation during training (eval_strategy / eval_steps): 'bundled', a file or a Hub "
            "dataset id, like dataset_name."
        },
    )
    dataset_test_split: str = field(default="test", metadata={"help": "Split of eval_dataset_name (Hub dataset ids)."})
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
    eval_before_after: bool = field(
        default=False,
        metadata={
            "help": "Evaluate the base model before training and the trained model after it on eval_dataset_name "
            "(the trainer's evaluation: fixed seeds, eval_reward_funcs, eval_num_images_per_prompt); writes "
            "eval_before / eval_after ({reward: mean}) into run_summary.json and prints them as a table. Needs "
            "eval_dataset_name."
        },
    )

    def __post_init__(self) -> None:
        from .sources import as_sources, mixture_ratios

        if isinstance(self.dataset_mixture, (str, dict)):
            self.dataset_mixture = [self.dataset_mixture]
        if self.dataset_mixture:
            if self.dataset_name != "bundled":
                raise ValueError(
                    f"Both dataset_name ({self.dataset_name!r}) and dataset_mixture are set: put every source in "
                    "dataset_mixture and drop dataset_name."
                )
            self.dataset_mixture = as_sources(self.dataset_mixture)
            mixture_ratios(self.dataset_mixture)  # all ratios or none, a positive sum: fail before loading the model
        if self.eval_before_after and self.eval_dataset_name is None:
            raise ValueError(
                "eval_before_after needs held-out prompts: set eval_dataset_name (e.g. 'shapes_eval' or a file)."
            )


def load_train_dataset(name: str, split: str = "train", prompt_column: str = "prompt"):
    """Load the prompt dataset named by ``dataset_name`` (see :func:`marble_trl.sources.load_source`)."""
    from .sources import PromptSource, load_source

    return load_source(PromptSource(path=name, split=split, prompt_column=prompt_column))


def load_script_datasets(script_args: MarbleScriptArguments, training_args: MarbleDiffusionNFTConfig):
    """The train dataset (``dataset_name`` or ``dataset_mixture``, whose ratios become ``source_ratios``) and the
    eval dataset (``eval_dataset_name``, or ``None``)."""
    from .sources import load_prompt_sources, mixture_ratios

    if script_args.dataset_mixture:
        dataset = load_prompt_sources(script_args.dataset_mixture, add_source_column=True)
        ratios = mixture_ratios(script_args.dataset_mixture)
        if ratios is not None:
            if training_args.source_ratios is not None and training_args.source_ratios != ratios:
                raise ValueError(
                    f"source_ratios ({training_args.source_ratios}) disagrees with the ratios of dataset_mixture "
                    f"({ratios}); set the ratios in one place."
                )
            training_args.source_ratios = ratios
    else:
        dataset = load_train_dataset(
            script_args.dataset_name, script_args.dataset_train_split, script_args.dataset_prompt_column
        )
    eval_dataset = None
    if script_args.eval_dataset_name is not None:
        eval_dataset = load_train_dataset(
            script_args.eval_dataset_name, script_args.dataset_test_split, script_args.dataset_prompt_column
        )
    return dataset, eval_dataset


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
    from .samples import save_before_after, score_images
    from .trainer import MarbleDiffusionNFTTrainer

    if not script_args.reward_funcs:
        raise ValueError("reward_funcs is empty: name at least one reward (e.g. --reward_funcs brightness).")
    start = time.perf_counter()
    dataset, eval_dataset = load_script_datasets(script_args, training_args)
    dtype = _resolve_dtype(script_args.torch_dtype, training_args)
    pipeline = load_sd3_pipeline(script_args.model_name_or_path, torch_dtype=dtype, tiny_seed=script_args.tiny_seed)
    trainer = MarbleDiffusionNFTTrainer(
        pipeline, script_args.reward_funcs, args=training_args, train_dataset=dataset, eval_dataset=eval_dataset
    )
    out = Path(training_args.output_dir)
    grid_prompts = list(dict.fromkeys(dataset["prompt"]))[: script_args.sample_grid_prompts]
    seeds = range(script_args.sample_grid_seeds)
    before = None
    if grid_prompts and trainer.is_world_process_zero():
        import torch

        before = torch.cat([trainer.generate(grid_prompts, seed=s, use_lora=False) for s in seeds])
    eval_before = _final_eval(trainer, "eval_before") if script_args.eval_before_after else None
    try:
        result = trainer.train(resume_from_checkpoint=_resume_arg(training_args.resume_from_checkpoint))
    except Exception as error:
        _save_after_failure(trainer, out, error, start)
        raise
    trainer.save_model(str(out), _internal_call=True)  # the push (if any) is the one below
    summary = {"global_step": result.global_step, "train_loss": result.training_loss}
    if eval_before is not None and not trainer.stopped_by_signal:
        summary["eval_before"] = eval_before
        summary["eval_after"] = _final_eval(trainer, "eval_after")
    if trainer.stopped_by_signal:
        summary["stopped_by"] = trainer.stopped_by_signal
        before = None  # no "after" grid: exit quickly (a scheduler's grace period is short)
    if trainer.is_world_process_zero():
        _write_metrics(trainer, out)
        if before is not None:
            import torch

            after = torch.cat([trainer.generate(grid_prompts, seed=s, use_lora=True) for s in seeds])
            scale = max(1, 128 // training_args.resolution)
            first = {}  # the dataset row of each grid prompt: its columns reach the rewards, as in training
            for k, prompt in enumerate(dataset["prompt"]):
                first.setdefault(prompt, k)
            extra = [c for c in dataset.column_names if c != "prompt"]
            columns = {c: [dataset[first[p]][c] for p in grid_prompts] * len(seeds) for c in extra}
            prompts = grid_prompts * len(seeds)
            funcs, names = trainer.reward_funcs, trainer.reward_names
            save_before_after(
                before, after, len(grid_prompts), out / "samples_before_after.png", scale=scale, prompts=grid_prompts,
                before_scores=score_images(funcs, names, prompts, before, columns),
                after_scores=score_images(funcs, names, prompts, after, columns),
            )  # fmt: skip
        summary["wall_time_s"] = round(time.perf_counter() - start, 1)
        (out / "run_summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        if trainer.stopped_by_signal:
            print(
                f"[marble-trl] stopped by {trainer.stopped_by_signal} at step {result.global_step}; checkpoint "
                f"{out / f'checkpoint-{result.global_step}'}; resume with --resume_from_checkpoint true"
            )
        from .console import reward_summary_lines

        for line in reward_summary_lines(trainer.state.log_history):  # first vs last logged mean of each reward
            print(line)
        if "eval_after" in summary:
            for line in eval_table_lines(summary["eval_before"], summary["eval_after"], trainer.reward_names):
                print(line)
        print(f"[marble-trl] done: {summary} -> {out}")
    if training_args.push_to_hub and not trainer.stopped_by_signal:
        mixture = script_args.dataset_mixture
        trainer.push_to_hub(dataset_name=", ".join(s.path for s in mixture) if mixture else script_args.dataset_name)
    return summary


def _final_eval(trainer, prefix: str) -> dict[str, float]:
    """``{reward: mean}`` of the trainer's evaluation on its eval dataset (before training the zero-initialised
    LoRA is the base model)."""
    metrics = trainer.evaluate(metric_key_prefix=prefix)
    return {n: round(metrics[f"{prefix}_rewards/{n}/mean"], 6) for n in trainer.eval_reward_names}


def eval_table_lines(before: dict[str, float], after: dict[str, float], trained: list[str]) -> list[str]:
    """The before/after table of the held-out evaluation printed at the end of a run; rewards not in ``trained``
    are marked ``(held out)``."""
    width = max(len(n) for n in before) + 2
    lines = [f"[marble-trl] held-out eval {'reward':<{width}} {'before':>8} {'after':>8} {'change':>8}"]
    for name, b in before.items():
        a = after[name]
        mark = "" if name in trained else " (held out)"
        lines.append(f"[marble-trl] held-out eval {name:<{width}} {b:>8.4f} {a:>8.4f} {a - b:>+8.4f}{mark}")
    return lines


def _write_metrics(trainer, out: Path) -> None:
    with open(out / "metrics.jsonl", "w") as f:
        for entry in trainer.state.log_history:
            f.write(json.dumps(entry) + "\n")


def _save_after_failure(trainer, out: Path, error: BaseException, start: float) -> None:
    """Training raised: keep what it made (the LoRA when finite, metrics.jsonl, a run_summary.json naming the
    error and the emergency checkpoint) before the error propagates (non-zero exit)."""
    if not trainer.is_world_process_zero() or trainer.state.global_step == 0:
        return  # before the first step (a refused resume, a busy or occupied output_dir): the folder is not ours
    from .guards import non_finite_tensors

    out.mkdir(parents=True, exist_ok=True)
    lora_finite = not non_finite_tensors({n: p.detach() for n, p in trainer.trainable_parameters().items()})
    if lora_finite and trainer.accelerator.num_processes == 1:
        trainer.save_model(str(out), _internal_call=True)  # not a "Model save" push of a failed run
    _write_metrics(trainer, out)
    summary = {
        "global_step": trainer.state.global_step,
        "error": f"{type(error).__name__}: {error}",
        "emergency_checkpoint": trainer.emergency_checkpoint,
        "wall_time_s": round(time.perf_counter() - start, 1),
    }
    (out / "run_summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(f"[marble-trl] failed at step {trainer.state.global_step}: {summary['error']} (kept in {out})")


def _resume_arg(value: str | None) -> str | bool | None:
    """``--resume_from_checkpoint true`` means the last checkpoint of ``output_dir`` (Trainer's ``True``)."""
    if value is not None and str(value).lower() in ("true", "last"):
        return True
    return value


def train_parser():
    """``marble-trl train``'s parser: TRL's ``TrlParser`` over the script and training arguments, with the wrapper's
    own flags in its help (``--config`` is read by ``TrlParser``, the launcher flags by :mod:`marble_trl.launch`;
    ``argparse.SUPPRESS`` keeps them out of the parsed dataclasses)."""
    from trl import TrlParser

    parser = TrlParser(
        (MarbleScriptArguments, MarbleDiffusionNFTConfig),
        prog="marble-trl train",
        description="DiffusionNFT / MARBLE training: a YAML recipe (--config) with command-line overrides (any field "
        "below, e.g. --max_steps 10).",
    )
    group = parser.add_argument_group("marble-trl train (the command's own flags)")
    group.add_argument(
        "--config",
        metavar="YAML",
        default=argparse.SUPPRESS,
        help="A recipe (e.g. recipes/tiny-cpu.yaml): its keys are the fields below; command-line flags override it; an "
        "env: block sets environment variables.",
    )
    group.add_argument(
        "--accelerate_config",
        metavar="FILE",
        default=argparse.SUPPRESS,
        help="Re-run this command under `accelerate launch --config_file FILE` (configs in recipes/accelerate/; see "
        "docs/distributed.md).",
    )
    group.add_argument(
        "--num_processes",
        metavar="N",
        type=int,
        default=argparse.SUPPRESS,
        help="Processes for `accelerate launch` (overrides the config's num_processes; one per GPU). On CPU: "
        "ACCELERATE_USE_CPU=true with --accelerate_config recipes/accelerate/multi_gpu.yaml (gloo).",
    )
    parser._action_groups.remove(group)  # listed first, above the ~200 fields of the dataclasses
    parser._action_groups.insert(1, group)
    return parser


def _export_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="marble-trl export",
        description="A run folder (checkpoint-N or the final output_dir) -> a publishable LoRA folder, written "
        "atomically (nothing is left at --output when a step fails).",
    )
    p.add_argument(
        "--checkpoint",
        required=True,
        help="A run folder: a checkpoint-N folder, or the final output_dir of a run (its LoRA and marble_trl.json).",
    )
    p.add_argument("--output", required=True, help="Folder to write (LoRA, README.md model card, marble_trl.json).")
    p.add_argument(
        "--ema",
        action="store_true",
        help="Export the parameter EMA instead of the trained weights (needs a checkpoint-N folder of a run with "
        "param_ema=True: the final output_dir holds only the trained LoRA).",
    )
    p.add_argument("--format", choices=["diffusers", "peft"], default="diffusers", help="LoRA file format.")
    p.add_argument("--base_model", help="Base model id for the card (default: the run's model_name_or_path).")
    p.add_argument("--sample_prompts", nargs="*", default=[], help="Render these prompts into samples/ for the card.")
    p.add_argument("--model", help="Base model to render samples with (default: --base_model / the run's model).")
    p.add_argument(
        "--tiny_seed", type=int, help="Seed of the tiny model (base model tiny; default: the seed the run records)."
    )
    p.add_argument("--license", help="License for the card's metadata.")
    p.add_argument("--push_to_hub", metavar="REPO_ID", help="Upload the folder to this Hub repo (created if needed).")
    p.add_argument("--private", action="store_true", help="Create the Hub repo private.")
    p.add_argument("--token", help="Hub token (default: HF_TOKEN / the saved login).")
    p.add_argument("--overwrite", action="store_true", help="Replace a non-empty --output (a previous export).")
    return p


def _generate_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="marble-trl generate", description="Images from a base model plus a LoRA.")
    p.add_argument("--model", default="tiny", help="'tiny', a local diffusers SD3/SD3.5 folder or a Hub id.")
    p.add_argument("--lora", help="A diffusers-format LoRA folder (export output, output_dir, checkpoint-N).")
    p.add_argument("--prompts", nargs="+", required=True, help="One image per prompt.")
    p.add_argument("--output", required=True, help="Folder for 000-<prompt>.png ... and prompts.json.")
    p.add_argument("--seed", type=int, default=0, help="Seed of the one generator used for the whole batch.")
    p.add_argument("--steps", type=int, help="Sampler steps (default: the LoRA's marble_trl.json, else 28).")
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


def _evaluate_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="marble-trl evaluate",
        description="Score a base model and LoRAs / checkpoints on a prompt set: results.md, results.csv, per-model "
        "scores.jsonl (resumable), captioned image grids, comparison.png (models side by side) and rewards.png.",
    )
    p.add_argument("--model", default="tiny", help="'tiny', a local diffusers SD3/SD3.5 folder or a Hub id.")
    p.add_argument(
        "--lora",
        nargs="*",
        default=[],
        help="LoRA folders to compare (output_dir, checkpoint-N, export folders); each is one model, named by folder.",
    )
    p.add_argument("--no_base", action="store_true", help="Do not evaluate the base model alone.")
    p.add_argument(
        "--weight_name", help="LoRA file inside each --lora folder (e.g. param_ema.safetensors in a checkpoint)."
    )
    p.add_argument(
        "--prompts",
        nargs="+",
        default=["bundled"],
        help="Prompt source(s): 'bundled', a .txt/.json/.jsonl/.csv/.parquet file or a Hub dataset id (several: "
        "concatenated, with a 'source' column).",
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

    from .evaluation import EvalSettings, evaluate_models, model_specs
    from .scores import markdown_table
    from .sources import PromptSource, load_prompt_sources

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
    sources = [
        PromptSource(path=path, split=a.split, prompt_column=a.prompt_column, max_prompts=a.max_prompts)
        for path in a.prompts
    ]
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


def export_command(argv: list[str]) -> dict:
    from .export import export_checkpoint

    a = _export_parser().parse_args(argv)
    out = export_checkpoint(
        a.checkpoint, a.output, ema=a.ema, fmt=a.format, base_model=a.base_model, sample_prompts=a.sample_prompts,
        model=a.model, tiny_seed=a.tiny_seed, repo_id=a.push_to_hub, license=a.license, overwrite=a.overwrite,
    )  # fmt: skip
    result = {"output": str(out)}
    print(f"[marble-trl] exported {a.checkpoint} ({'EMA' if a.ema else 'raw'} weights, {a.format}) -> {out}")
    if a.push_to_hub:
        from .hub import push_folder

        commit = push_folder(out, a.push_to_hub, token=a.token, private=a.private or None)
        result["commit_url"] = commit.commit_url
        print(f"[marble-trl] pushed to {a.push_to_hub}: {commit.commit_url}")
    return result


def generate_command(argv: list[str]) -> list[Path]:
    import torch

    from .export import generate_to_folder

    a = _generate_parser().parse_args(argv)
    dtype = None if a.torch_dtype == "auto" else getattr(torch, a.torch_dtype)
    paths = generate_to_folder(
        a.model, a.prompts, a.output, lora=a.lora, seed=a.seed, num_inference_steps=a.steps,
        guidance_scale=a.guidance_scale, resolution=a.resolution, scheduler=a.scheduler,
        max_sequence_length=a.max_sequence_length, weight_name=a.weight_name, tiny_seed=a.tiny_seed,
        torch_dtype=dtype, device=a.device,
    )  # fmt: skip
    print(f"[marble-trl] wrote {len(paths)} images to {a.output}")
    return paths


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    top = argparse.ArgumentParser(prog="marble-trl", description="Multi-reward RL for text-to-image diffusion.")
    top.add_argument(
        "command",
        choices=["train", "export", "generate", "evaluate"],
        help="train: DiffusionNFT / MARBLE training from a recipe; export: a checkpoint -> a publishable LoRA folder "
        "(model card, optional Hub push); generate: images from a base model plus a LoRA; evaluate: score models on "
        "a prompt set.",
    )
    if not argv or argv[0] in ("-h", "--help"):
        top.print_help()
        return 0
    ns, rest = top.parse_known_args(argv[:1])
    if ns.command == "train":
        from .launch import launch_train, split_launch_args

        launch, train_argv = split_launch_args(argv[1:])
        if launch:  # --accelerate_config / --num_processes: re-run under `accelerate launch`
            return launch_train(launch, train_argv)
        script_args, training_args = train_parser().parse_args_and_config(args=train_argv)
        train(script_args, training_args)
    elif ns.command == "export":
        export_command(argv[1:])
    elif ns.command == "evaluate":
        evaluate_command(argv[1:])
    else:
        generate_command(argv[1:])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
