"""The ``marble-trl`` command.

- ``marble-trl train --config recipes/tiny-cpu.yaml [--field value ...]``: YAML plus command-line overrides, parsed by
  TRL's ``TrlParser`` (so an ``env:`` block in the YAML sets environment variables, as with ``trl``);
- ``marble-trl export --checkpoint DIR --output DIR [--ema] [--format diffusers|peft]``: a run folder (a checkpoint or
  the final ``output_dir``) as a publishable LoRA folder with a model card (:mod:`marble_trl.publish.export`), optionally
  pushed to the Hub;
- ``marble-trl generate --model tiny|PATH --lora DIR --prompts ... --output DIR``: images from a base model plus a
  LoRA, loaded with diffusers' ``load_lora_weights``;
- ``marble-trl evaluate --model tiny|PATH [--lora DIR ...] --prompts SOURCE --reward_funcs ... --output DIR``: scores
  the base model and each LoRA / checkpoint on a prompt set (:mod:`marble_trl.evaluation.run`);
- ``marble-trl check --config RECIPE [--num_processes N] [--gpu_memory 80GB]``: the preflight (docs/check.md);
- ``marble-trl serve-reward --reward NAME [--reward_kwargs JSON] [--port 18085]``: one reward served over HTTP for
  ``http_reward`` clients (:mod:`marble_trl.rewards.serve`);
- ``marble-trl datasets list`` / ``marble-trl datasets download [NAME ...] [--from FILE]``: the papers' named prompt
  sets (:mod:`marble_trl.data.prompt_sets`): provenance, licence, digests, cache status; fetching them ahead of a run.

Each command lives in :mod:`marble_trl.commands` and is imported only when run (``marble-trl --help`` loads no model
code); ``MarbleScriptArguments`` and ``train`` are re-exported here for scripts.
"""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .commands.train import MarbleScriptArguments, train

__all__ = ["MarbleScriptArguments", "main", "train"]


def __getattr__(name: str) -> Any:  # the re-exports load on first use: the launcher wrapper imports no model code
    if name in ("MarbleScriptArguments", "train"):
        from .commands import train as module

        return getattr(module, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["check"]:  # the preflight (docs/check.md): marble-trl check --config RECIPE [train's arguments]
        from .commands.check import check_command

        return check_command(argv[1:])
    top = argparse.ArgumentParser(prog="marble-trl", description="Multi-reward RL for text-to-image diffusion.")
    top.add_argument(
        "command",
        choices=["train", "check", "export", "generate", "evaluate", "serve-reward", "datasets"],
        help="train: DiffusionNFT / MARBLE training from a recipe; check: a preflight of a recipe (config, rewards, "
        "batching, memory per GPU) before GPU hours are spent; export: a checkpoint -> a publishable LoRA folder "
        "(model card, optional Hub push); generate: images from a base model plus a LoRA; evaluate: score models on "
        "a prompt set; serve-reward: serve one reward over HTTP for http_reward clients; datasets: list / download the "
        "papers' named prompt sets.",
    )
    if not argv or argv[0] in ("-h", "--help"):
        top.print_help()
        return 0
    ns, rest = top.parse_known_args(argv[:1])
    if ns.command == "train":
        from .commands.launch import launch_train, split_launch_args

        launch, train_argv = split_launch_args(argv[1:])
        if launch:  # --accelerate_config / --num_processes: re-run under `accelerate launch`
            return launch_train(launch, train_argv)
        from .commands.train import train, train_parser

        script_args, training_args = train_parser().parse_args_and_config(args=train_argv)
        train(script_args, training_args)
    elif ns.command == "export":
        from .commands.export import export_command

        export_command(argv[1:])
    elif ns.command == "evaluate":
        from .commands.evaluate import evaluate_command

        evaluate_command(argv[1:])
    elif ns.command == "datasets":
        from .commands.datasets import datasets_command

        return datasets_command(argv[1:])
    elif ns.command == "serve-reward":
        from .commands.serve_reward import serve_reward_command

        return serve_reward_command(argv[1:])
    else:
        from .commands.generate import generate_command

        generate_command(argv[1:])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
