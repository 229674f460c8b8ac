"""What ShapesBench's step costs at the shipped model's CLIP context (77 tokens) against a shorter one.

The shapes model's joint attention sees 64 image tokens and 85 text tokens (CLIP's 77, padded, plus T5's 8), so
the text stream is most of every forward. This script times a ShapesBench method's optimizer step on the shipped
`shapes` model as it is and with both CLIP tokenizers cut to ``--clip-tokens`` side by side (the tokenizer is
character-level: the world's longest caption is 28 tokens, so the default is 32 and a shorter context is refused):
each round runs every context in its own subprocess, and each ratio is the median over rounds of (77-token step time /
short step time) within the round. The short context changes the model's inputs (the transformer attends to the pad
tokens it was pretrained with), so it measures cost only: a world that used it would pretrain its base with it.

    python benchmarks/shapes_context.py                              # only_count and marble, 3 rounds, 32 tokens
    python benchmarks/shapes_context.py --methods weighted_sum --clip-tokens 40 --rounds 2
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
from dataclasses import replace
from pathlib import Path


def shortened(model: Path, tokens: int, into: Path) -> Path:
    """A copy of the pipeline folder ``model`` whose CLIP tokenizers pad to ``tokens`` instead of 77."""
    shutil.copytree(model, into)
    for name in ("tokenizer", "tokenizer_2"):
        path = into / name / "tokenizer_config.json"
        config = json.loads(path.read_text())
        config["model_max_length"] = tokens
        path.write_text(json.dumps(config))
    return into


def worker(args: argparse.Namespace) -> None:
    import torch

    from marble_trl.shapesbench.bench import Budget, _config
    from marble_trl.shapesbench.methods import StepTimer, all_methods
    from marble_trl.shapesbench.scorers import REWARDS
    from marble_trl.shapesbench.world import family_dataset, train_dataset
    from marble_trl.trainer import MarbleDiffusionNFTTrainer

    torch.set_num_threads(args.threads)
    timer = StepTimer()

    method = all_methods()[args.worker]
    budget = replace(Budget(), steps=args.warmup + args.steps)
    trainer = MarbleDiffusionNFTTrainer(
        args.worker_model,
        reward_funcs=[REWARDS[r] for r in method.rewards],
        args=_config(method, 0, budget, tempfile.mkdtemp(prefix="shapes-context-")),
        train_dataset=family_dataset(method.family) if method.family else train_dataset(),
        callbacks=[timer],
    )
    trainer.train()
    logs = [h for h in trainer.state.log_history[args.warmup :] if "time/train" in h]
    print(
        json.dumps(
            {
                "step_time": statistics.fmean(timer.step_times()[args.warmup :]),
                "rollout": statistics.mean(float(h["time/rollout"]) for h in logs),
                "train": statistics.mean(float(h["time/train"]) for h in logs),
            }
        )
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--worker-model", help=argparse.SUPPRESS)
    parser.add_argument("--methods", nargs="+", default=["only_count", "marble"], help="ShapesBench methods")
    parser.add_argument(
        "--clip-tokens", type=int, default=32, help="the short CLIP context (the shipped one: 77; >= 28)"
    )
    parser.add_argument("--warmup", type=int, default=2, help="optimizer steps before the timed window")
    parser.add_argument("--steps", type=int, default=10, help="timed optimizer steps (10: one MARBLE refresh)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return

    from marble_trl.shapesbench.pretrain import longest_caption_tokens
    from marble_trl.shapesbench.shipped import base_model

    longest = longest_caption_tokens()
    if args.clip_tokens < longest:
        sys.exit(f"--clip-tokens {args.clip_tokens} would truncate captions: the longest is {longest} tokens")

    tmp = Path(tempfile.mkdtemp(prefix="shapes-context-models-"))
    models = {77: base_model(), args.clip_tokens: shortened(base_model(), args.clip_tokens, tmp / "short")}
    results: dict[tuple[str, int], list[dict]] = {(m, t): [] for m in args.methods for t in models}
    for r in range(args.rounds):
        for (method, tokens), runs in results.items():
            flags = ["--steps", str(args.steps), "--warmup", str(args.warmup), "--threads", str(args.threads)]
            cmd = [sys.executable, __file__, "--worker", method, "--worker-model", str(models[tokens]), *flags]
            out = subprocess.run(cmd, capture_output=True, text=True, check=False)
            if out.returncode:
                sys.exit(f"{method} at {tokens} CLIP tokens failed:\n{out.stderr[-3000:]}")
            runs.append(json.loads(next(ln for ln in out.stdout.splitlines()[::-1] if ln.startswith("{"))))
            print(f"round {r + 1}/{args.rounds} {method} @ {tokens} tokens: {runs[-1]}", flush=True)
    shutil.rmtree(tmp, ignore_errors=True)

    print(f"\n{args.rounds} rounds, {args.steps} timed steps after {args.warmup}, {args.threads} thread(s)")
    print(f"{'method':>20} | CLIP | step (median) | rollout | train | step time vs 77 tokens")
    for (method, tokens), runs in results.items():
        ref = results[(method, 77)]
        ratio = statistics.median(x["step_time"] / b["step_time"] for b, x in zip(ref, runs))
        med = {k: statistics.median(x[k] for x in runs) for k in ("step_time", "rollout", "train")}
        print(
            f"{method:>20} | {tokens:4d} | {med['step_time']:11.2f} s | {med['rollout']:5.2f} s | "
            f"{med['train']:4.2f} s | {ratio:.3f}x"
        )


if __name__ == "__main__":
    main()
