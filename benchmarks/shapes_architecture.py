"""What a ShapesBench step costs with each base-model architecture, side by side.

The shipped `shapes` model (v2.1) has 16 image tokens (patch 4 on the 16 x 16 latent) and a 32-token CLIP context;
v2.0's had SD3's patch 2 (64 image tokens) and CLIP's 77 tokens. The transformer's compute depends on the
architecture, not on the weights (the rewards' cost varies a little with the images), so each variant is built
untrained from its `PretrainConfig` (`pretrain.untrained_pipeline`, no pretraining) and saved to a temporary folder. Each round runs every (method, variant) in its own subprocess, one
after another (nothing else should run: the machine's 2 cores are shared), and each ratio is the median over rounds
of (the first variant's step time / this variant's) within the round: the speed-up over the first variant.

    python benchmarks/shapes_architecture.py                               # v2.0 vs v2.1: only_count, weighted_sum, marble
    python benchmarks/shapes_architecture.py --variants v2.0 v2.0-clip32 v2.1 --methods only_count --rounds 2
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

# PretrainConfig fields of each variant (everything else is the shipped model's).
VARIANTS: dict[str, dict] = {
    "v2.0": {"patch_size": 2, "clip_max_length": 77},
    "v2.0-clip32": {"patch_size": 2, "clip_max_length": 32},  # v2.0 with the short context only
    "v2.1": {},  # the shipped model: patch 4, 32 tokens
}


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
        args=_config(method, 0, budget, tempfile.mkdtemp(prefix="shapes-architecture-")),
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


def build(variant: str, into: Path) -> Path:
    """The untrained pipeline of ``variant`` saved to ``into``."""
    from marble_trl.shapesbench.pretrain import PretrainConfig, untrained_pipeline

    untrained_pipeline(PretrainConfig(**VARIANTS[variant])).save_pretrained(into)
    return into


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--worker-model", help=argparse.SUPPRESS)
    parser.add_argument("--variants", nargs="+", default=["v2.0", "v2.1"], choices=list(VARIANTS))
    parser.add_argument("--methods", nargs="+", default=["only_count", "weighted_sum", "marble"])
    parser.add_argument("--warmup", type=int, default=2, help="optimizer steps before the timed window")
    parser.add_argument("--steps", type=int, default=10, help="timed optimizer steps (10: one MARBLE refresh)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return

    tmp = Path(tempfile.mkdtemp(prefix="shapes-architecture-models-"))
    models = {v: build(v, tmp / v) for v in args.variants}
    results: dict[tuple[str, str], list[dict]] = {(m, v): [] for m in args.methods for v in args.variants}
    for r in range(args.rounds):
        for (method, variant), runs in results.items():
            flags = ["--steps", str(args.steps), "--warmup", str(args.warmup), "--threads", str(args.threads)]
            cmd = [sys.executable, __file__, "--worker", method, "--worker-model", str(models[variant]), *flags]
            out = subprocess.run(cmd, capture_output=True, text=True, check=False)
            if out.returncode:
                sys.exit(f"{method} on {variant} failed:\n{out.stderr[-3000:]}")
            runs.append(json.loads(next(ln for ln in out.stdout.splitlines()[::-1] if ln.startswith("{"))))
            print(f"round {r + 1}/{args.rounds} {method} on {variant}: {runs[-1]}", flush=True)
    shutil.rmtree(tmp, ignore_errors=True)

    ref = args.variants[0]
    print(f"\n{args.rounds} rounds, {args.steps} timed steps after {args.warmup}, {args.threads} thread(s)")
    print(f"| method | variant | step (median) | rollout | train | speed-up over {ref} |")
    print("|---|---|---|---|---|---|")
    for (method, variant), runs in results.items():
        base = results[(method, ref)]
        ratio = statistics.median(b["step_time"] / x["step_time"] for b, x in zip(base, runs))
        med = {k: statistics.median(x[k] for x in runs) for k in ("step_time", "rollout", "train")}
        print(
            f"| {method} | {variant} | {med['step_time']:.2f} s | {med['rollout']:.2f} s | {med['train']:.2f} s | "
            f"{ratio:.2f}x |"
        )


if __name__ == "__main__":
    main()
