"""``marble-trl export``."""

from __future__ import annotations

import argparse


def _export_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="marble-trl export",
        description="A run folder (checkpoint-N or the final output_dir) -> a publishable LoRA folder (a full "
        "fine-tune's: its transformer/ folder), written atomically (nothing is left at --output when a step fails).",
    )
    p.add_argument(
        "--checkpoint",
        required=True,
        help="A run folder: a checkpoint-N folder, or the final output_dir of a run (its LoRA or, with use_peft false, "
        "its transformer/, and marble_trl.json).",
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
        "--source_images",
        nargs="+",
        help="An editing model's images to edit for the samples: one for every sample prompt, or one per prompt.",
    )
    p.add_argument(
        "--tiny_seed", type=int, help="Seed of the tiny model (base model tiny; default: the seed the run records)."
    )
    p.add_argument("--license", help="License for the card's metadata.")
    p.add_argument("--push_to_hub", metavar="REPO_ID", help="Upload the folder to this Hub repo (created if needed).")
    p.add_argument("--private", action="store_true", help="Create the Hub repo private.")
    p.add_argument("--token", help="Hub token (default: HF_TOKEN / the saved login).")
    p.add_argument("--overwrite", action="store_true", help="Replace a non-empty --output (a previous export).")
    return p


def export_command(argv: list[str]) -> dict:
    from ..publish.export import export_checkpoint

    a = _export_parser().parse_args(argv)
    out = export_checkpoint(
        a.checkpoint, a.output, ema=a.ema, fmt=a.format, base_model=a.base_model, sample_prompts=a.sample_prompts,
        model=a.model, tiny_seed=a.tiny_seed, repo_id=a.push_to_hub, license=a.license, overwrite=a.overwrite,
        source_images=a.source_images,
    )  # fmt: skip
    result = {"output": str(out)}
    print(f"[marble-trl] exported {a.checkpoint} ({'EMA' if a.ema else 'raw'} weights, {a.format}) -> {out}")
    if a.push_to_hub:
        from ..publish.hub import push_folder

        commit = push_folder(out, a.push_to_hub, token=a.token, private=a.private or None)
        result["commit_url"] = commit.commit_url
        print(f"[marble-trl] pushed to {a.push_to_hub}: {commit.commit_url}")
    return result
