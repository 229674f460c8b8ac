"""``marble-trl train --config recipes/tiny-cpu.yaml [--field value ...]``: YAML plus command-line overrides, parsed by
TRL's ``TrlParser`` (so an ``env:`` block in the YAML sets environment variables, as with ``trl``); one training job
that writes the LoRA, ``metrics.jsonl``, ``samples_before_after.png`` and ``run_summary.json`` to ``output_dir``."""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass, field
from pathlib import Path

from ..nft_config import MarbleDiffusionNFTConfig

DTYPES = ("auto", "float32", "bfloat16", "float16")


@dataclass
class MarbleScriptArguments:
    """What to train on: the model, the prompts, the rewards."""

    model_name_or_path: str = field(
        default="tiny",
        metadata={
            "help": "A local diffusers folder or a Hub id of a supported family (SD3/3.5, FLUX.1, Wan, Qwen-Image, "
            "Z-Image: picked from model_index.json), an offline random tiny model ('tiny', 'tiny-flux', 'tiny-wan', "
            "'tiny-qwen-image', 'tiny-z-image') or 'shapes' (the ShapesBench base model shipped in the package)."
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
            "ShapesBench world, with its metadata columns), a paper's prompt set ('pickscore', 'ocr', 'geneval', their "
            "'_test' splits, 'drawbench': shipped or downloaded once, verified and cached; `marble-trl datasets list`), the named "
            "mixture 'marble_5rewards' (pickscore, ocr and geneval in equal shares per step), a .txt file (one prompt "
            "per line), a .json/.jsonl/.csv/.parquet file or a Hub dataset id with a 'prompt' column."
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
            "help": "Prompts for evaluation during training (eval_strategy / eval_steps), like dataset_name: 'bundled', "
            "a prompt set (e.g. 'drawbench', 'geneval_test'), the mixture 'marble_5rewards_test' (the three test "
            "splits, with a 'source' column), a file or a Hub dataset id."
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
        default=4,
        metadata={
            "help": "Prompts in the before/after sample grid (0 disables the grid): the dataset's first distinct "
            "prompts, taken from each prompt source in turn when the dataset is a mixture."
        },
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
        from ..data.sources import as_sources, mixture_ratios

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
    """Load the prompt dataset named by ``dataset_name`` (see :func:`marble_trl.data.sources.load_source`); a named mixture
    (``marble_5rewards_test``) is its sources concatenated with a ``source`` column."""
    from ..data.sources import PromptSource, load_prompt_sources, load_source, named_mixture

    mixture = named_mixture(name)
    if mixture is not None:
        return load_prompt_sources(mixture, add_source_column=True)
    return load_source(PromptSource(path=name, split=split, prompt_column=prompt_column))


def load_script_datasets(script_args: MarbleScriptArguments, training_args: MarbleDiffusionNFTConfig):
    """The train dataset (``dataset_name`` or ``dataset_mixture``, whose ratios become ``source_ratios``; a named
    mixture in ``dataset_name`` counts as a ``dataset_mixture``) and the eval dataset (``eval_dataset_name``, or
    ``None``)."""
    from ..data.sources import load_prompt_sources, mixture_ratios, named_mixture

    mixture = script_args.dataset_mixture or named_mixture(script_args.dataset_name)
    if mixture:
        dataset = load_prompt_sources(mixture, add_source_column=True)
        ratios = mixture_ratios(mixture)
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
    from ..data.source_images import SOURCE_IMAGES_COLUMN
    from ..evaluation.samples import save_before_after, score_images
    from ..models import load_model
    from ..models.editing import beside
    from ..trainer import MarbleDiffusionNFTTrainer

    if not script_args.reward_funcs:
        raise ValueError("reward_funcs is empty: name at least one reward (e.g. --reward_funcs brightness).")
    start = time.perf_counter()
    dataset, eval_dataset = load_script_datasets(script_args, training_args)
    dtype = _resolve_dtype(script_args.torch_dtype, training_args)
    pipeline = load_model(script_args.model_name_or_path, torch_dtype=dtype, tiny_seed=script_args.tiny_seed).pipeline
    trainer = MarbleDiffusionNFTTrainer(
        pipeline, script_args.reward_funcs, args=training_args, train_dataset=dataset, eval_dataset=eval_dataset
    )
    out = Path(training_args.output_dir)
    grid_rows = grid_row_indices(dataset, script_args.sample_grid_prompts)
    grid_prompts = [dataset[k]["prompt"] for k in grid_rows]
    grid_sources = None  # an editing model edits each grid row's own source image
    if trainer.source_images is not None and grid_rows:
        grid_sources = trainer.source_images([dataset[k][SOURCE_IMAGES_COLUMN] for k in grid_rows])
    seeds = range(script_args.sample_grid_seeds)
    before = None
    # FSDP2 / ZeRO-3: every process draws (a forward needs every process's shards); the main one saves.
    if grid_prompts and (trainer.is_world_process_zero() or trainer.shards_transformer):
        import torch

        before = torch.cat(
            [trainer.generate(grid_prompts, seed=s, use_lora=False, source_images=grid_sources) for s in seeds]
        )
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
    after = None
    if before is not None:
        import torch

        after = torch.cat(
            [trainer.generate(grid_prompts, seed=s, use_lora=True, source_images=grid_sources) for s in seeds]
        )
    if trainer.is_world_process_zero():
        _write_metrics(trainer, out)
        if after is not None:
            scale = max(1, 128 // training_args.resolution)
            # the dataset row of each grid prompt: its columns reach the rewards, as in training
            extra = [c for c in dataset.column_names if c != "prompt"]
            columns = {c: [dataset[k][c] for k in grid_rows] * len(seeds) for c in extra}
            if grid_sources is not None:
                columns[SOURCE_IMAGES_COLUMN] = beside(grid_sources, before).repeat(len(seeds), 1, 1, 1)
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
        from ..trainer.console import reward_summary_lines

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
    from ..distributed import non_finite_tensors

    out.mkdir(parents=True, exist_ok=True)
    one_process = trainer.accelerator.num_processes == 1  # else the other processes may be stuck: no save
    params = trainer.trainable_parameters() if one_process else {}
    lora_kept = None
    if one_process and not non_finite_tensors({n: p.detach() for n, p in params.items()}):
        try:
            trainer.save_model(str(out), _internal_call=True)  # not a "Model save" push of a failed run
            lora_kept = True
        except Exception as save_error:  # a full disk fails this too: say so, keep the original error
            lora_kept = f"{type(save_error).__name__}: {save_error}"
    try:
        _write_metrics(trainer, out)
    except OSError:
        pass
    summary = {
        "global_step": trainer.state.global_step,
        "error": f"{type(error).__name__}: {error}",
        "emergency_checkpoint": trainer.emergency_checkpoint,
        "wall_time_s": round(time.perf_counter() - start, 1),
    }
    if isinstance(lora_kept, str):
        summary["lora_not_saved"] = lora_kept
    try:
        (out / "run_summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    except OSError:
        pass
    kept = "; the final LoRA could not be saved either" if isinstance(lora_kept, str) else ""
    print(f"[marble-trl] failed at step {trainer.state.global_step}: {summary['error']} (kept in {out}{kept})")


def grid_row_indices(dataset, n: int) -> list[int]:
    """The before/after grid's rows: the first row of each of :func:`grid_prompt_list`'s prompts, or, for an editing
    dataset (a ``source_images`` column: one instruction may edit several images), its first ``n`` rows."""
    from ..data.source_images import SOURCE_IMAGES_COLUMN

    if SOURCE_IMAGES_COLUMN in dataset.column_names:
        return list(range(min(n, len(dataset))))
    first: dict[str, int] = {}
    for k, prompt in enumerate(dataset["prompt"]):
        first.setdefault(prompt, k)
    return [first[p] for p in grid_prompt_list(dataset, n)]


def grid_prompt_list(dataset, n: int) -> list[str]:
    """The before/after grid's ``n`` prompts: the dataset's distinct prompts in order, taken from each prompt source
    in turn when it has a ``source`` column (a mixture's rows come source by source, so its first rows would all be
    one source's)."""
    from ..data.sources import SOURCE_COLUMN

    prompts = list(dict.fromkeys(dataset["prompt"]))
    if SOURCE_COLUMN not in dataset.column_names:
        return prompts[:n]
    by_source: dict[str, list[str]] = {}
    for prompt, source in zip(dataset["prompt"], dataset[SOURCE_COLUMN]):
        queue = by_source.setdefault(source, [])
        if prompt not in queue:
            queue.append(prompt)
    chosen: list[str] = []
    while len(chosen) < min(n, len(prompts)):
        for queue in by_source.values():
            while queue and queue[0] in chosen:  # a prompt two sources share comes once
                queue.pop(0)
            if queue and len(chosen) < n:
                chosen.append(queue.pop(0))
    return chosen


def _resume_arg(value: str | None) -> str | bool | None:
    """``--resume_from_checkpoint true`` means the last checkpoint of ``output_dir`` (Trainer's ``True``)."""
    if value is not None and str(value).lower() in ("true", "last"):
        return True
    return value


def train_parser():
    """``marble-trl train``'s parser: TRL's ``TrlParser`` over the script and training arguments, with the wrapper's
    own flags in its help (``--config`` is read by ``TrlParser``, the launcher flags by :mod:`marble_trl.commands.launch`;
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
