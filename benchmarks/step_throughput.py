"""Whole-step throughput and peak memory of MARBLE against the weighted-sum baseline (MARBLE paper, Table 2).

Each configuration trains the same model on the same prompts with K rewards in its own subprocess (so peak memory is
per configuration); configurations run interleaved round-robin, and each ratio is the median over rounds of
(baseline step time / configuration step time) within that round, so a busy machine slows a whole round alike.
Step time = wall time between consecutive optimizer-step ends (rollouts, rewards, NFT loss, balancer, update),
measured after ``--warmup`` steps over a window that is a multiple of 10 steps (so N=10 sees its share of refreshes).

    python benchmarks/step_throughput.py                        # tiny SD3.5 on CPU, K=5, 3 rounds
    python benchmarks/step_throughput.py --model /path/to/sd3.5-medium --bf16 --resolution 512 --batch 8 \
        --num-generations 24 --prompts-per-step 4 --sample-steps 10 --lora-r 32     # on a GPU

Peak memory: ``torch.cuda.max_memory_allocated`` on CUDA, else the process's peak RSS (``ru_maxrss``), which on CPU
includes the Python interpreter and libraries (a ratio close to 1 then understates a real difference).

Besides the ratios it prints, per configuration, the spread of the per-round ratios (min-max), the transformer calls
of the timed window (with and without gradients: rollouts, old-policy and reference forwards are gradient-free) and
the whole run's wall time; it warns when the rounds disagree by more than ``--spread-warning`` (a busy machine: the
ratio then says little) or when two configurations that should cost alike differ in calls.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time

from transformers import TrainerCallback

CONFIGS = {
    "weighted_sum": {"multi_objective_aggregation": "sum_then_normalize"},
    "marble_n10": {"multi_objective_aggregation": "marble", "marble_refresh_interval": 10},
    "marble_n1": {"multi_objective_aggregation": "marble", "marble_refresh_interval": 1},
    # beyond the paper: norm-aware amortised steps; refreshes estimated from --subset pairs (docs/marble.md)
    "marble_n10_norm_aware": {
        "multi_objective_aggregation": "marble",
        "marble_refresh_interval": 10,
        "marble_amortised_update": "norm_aware",
    },
    "marble_n10_estimated": {"multi_objective_aggregation": "marble", "marble_refresh_interval": 10, "subset": True},
    "marble_n1_estimated": {"multi_objective_aggregation": "marble", "marble_refresh_interval": 1, "subset": True},
    # full fine-tuning (use_peft=False, every weight of the transformer) against the LoRA rows (docs/models.md)
    "weighted_sum_full": {"multi_objective_aggregation": "sum_then_normalize", "use_peft": False},
    "marble_n10_full": {"multi_objective_aggregation": "marble", "marble_refresh_interval": 10, "use_peft": False},
    # the authors' released procedure: a refresh is one (micro-batch, timestep) pair (docs/marble.md)
    "marble_released": {
        "multi_objective_aggregation": "marble",
        "marble_refresh_interval": 10,
        "marble_procedure": "released",
    },
    # ... on every weight, its solved pairs' Gram by layer_gram (docs/models.md, "Full fine-tuning")
    "marble_released_full": {
        "multi_objective_aggregation": "marble",
        "marble_refresh_interval": 10,
        "marble_procedure": "released",
        "marble_gradient_engine": "layer_gram",
        "use_peft": False,
    },
}
REWARDS = ["brightness", "contrast", "saturation", "jpeg_compressibility", "darkness"]


def worker(args: argparse.Namespace) -> None:
    import torch

    from marble_trl import MarbleDiffusionNFTConfig, MarbleDiffusionNFTTrainer
    from marble_trl.data.prompts import load_prompt_dataset
    from marble_trl.models import build_tiny_sd3_pipeline
    from marble_trl.shapesbench.methods import StepTimer

    torch.set_num_threads(args.threads)
    timer = StepTimer()

    model = (
        build_tiny_sd3_pipeline(seed=0, num_layers=args.layers, latent_size=args.latent_size)
        if args.model == "tiny"
        else args.model
    )
    config = MarbleDiffusionNFTConfig(
        output_dir=f"/tmp/marble-bench-{args.worker}",
        report_to="none",
        save_strategy="no",
        disable_tqdm=True,
        logging_steps=10,
        max_steps=args.warmup + args.steps,
        per_device_train_batch_size=args.batch,
        num_generations=args.num_generations,
        prompts_per_step=args.prompts_per_step,
        resolution=args.resolution or 2 * args.latent_size,
        num_sample_steps=args.sample_steps,
        sample_scheduler="euler",
        max_sequence_length=8 if args.model == "tiny" else 256,
        lora_r=args.lora_r,
        lora_alpha=2 * args.lora_r,
        use_cpu=args.model == "tiny" and not torch.cuda.is_available(),
        seed=0,
        bf16=args.bf16,
        beta=args.beta,
        **{k: v for k, v in CONFIGS[args.worker].items() if k != "subset"},
        **({"marble_refresh_subset": args.subset} if CONFIGS[args.worker].get("subset") else {}),
    )
    trainer = MarbleDiffusionNFTTrainer(
        model, REWARDS[: args.num_rewards], args=config, train_dataset=load_prompt_dataset(), callbacks=[timer]
    )
    calls = CallCounter(trainer, args.warmup)
    trainer.add_callback(calls)
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    trainer.train()
    run_time = time.perf_counter() - start
    step_time = statistics.fmean(timer.step_times()[args.warmup :])
    if torch.cuda.is_available():
        peak = torch.cuda.max_memory_allocated() / 2**30
        unit = "GiB (CUDA allocated)"
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
        unit = "GiB (peak RSS)"
    balancer = trainer.balancer
    refreshes = getattr(balancer, "num_refreshes", getattr(balancer, "num_solves", 0)) if balancer is not None else 0
    record = {"config": args.worker, "step_time": step_time, "peak": peak, "unit": unit, "refreshes": refreshes}
    record |= {"grad_calls": calls.counts[True], "no_grad_calls": calls.counts[False], "run_time": run_time}
    print(json.dumps(record))


class CallCounter(TrainerCallback):
    """Counts the transformer's forward calls after ``warmup`` optimizer steps, with and without gradients (the hook
    is installed once training begins, on the unwrapped transformer)."""

    def __init__(self, trainer, warmup: int) -> None:
        self.trainer, self.warmup, self.counts = trainer, warmup, {True: 0, False: 0}
        self.active = warmup == 0

    def on_train_begin(self, *args, **kwargs):
        import torch

        def hook(module, inputs):
            if self.active:
                self.counts[torch.is_grad_enabled()] += 1

        self.trainer.transformer.register_forward_pre_hook(hook)

    def on_step_end(self, args, state, control, **kwargs):
        self.active = state.global_step >= self.warmup


def summarise(results: dict[str, list[dict]], spread_warning: float) -> tuple[list[dict], list[str]]:
    """Per configuration: the median ratios against ``weighted_sum`` over rounds (each within its round), their
    spread, the call counts; and the warnings (rounds that disagree, equal-call configurations timed apart)."""
    base = results["weighted_sum"]
    rows, warnings = [], []
    for name, runs in results.items():
        ratios = [b["step_time"] / x["step_time"] for b, x in zip(base, runs)]
        row = {
            "config": name,
            "step_time": statistics.median(x["step_time"] for x in runs),
            "speed": statistics.median(ratios),
            "speed_min": min(ratios),
            "speed_max": max(ratios),
            "memory": statistics.median(x["peak"] / b["peak"] for b, x in zip(base, runs)),
            "peak": runs[0]["peak"],
            "unit": runs[0]["unit"],
            "grad_calls": runs[0].get("grad_calls"),
            "no_grad_calls": runs[0].get("no_grad_calls"),
            "run_time": statistics.median(x.get("run_time", float("nan")) for x in runs),
        }
        rows.append(row)
        if len(ratios) > 1 and (row["speed_max"] - row["speed_min"]) > spread_warning * row["speed"]:
            warnings.append(
                f"{name}: the rounds disagree (throughput ratio {row['speed_min']:.3f}-{row['speed_max']:.3f}x): the "
                "machine was busy or noisy; rerun on an idle machine before quoting the ratio."
            )
    # equal calls cost alike only for the same trained weights: a full fine-tune's calls have no LoRA matmuls
    same = [
        r for r in rows if (r["grad_calls"], r["no_grad_calls"]) == (rows[0]["grad_calls"], rows[0]["no_grad_calls"])
        and CONFIGS.get(r["config"], {}).get("use_peft", True)
    ]  # fmt: skip
    for r in same[1:]:
        if abs(r["speed"] - 1.0) > spread_warning:
            warnings.append(
                f"{r['config']}: the same transformer calls as weighted_sum ({r['grad_calls']} + {r['no_grad_calls']}) "
                f"but timed at {r['speed']:.3f}x: the difference is the machine's, not the method's."
            )
    return rows, warnings


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker", choices=list(CONFIGS), help=argparse.SUPPRESS)
    parser.add_argument("--model", default="tiny", help="'tiny' or a diffusers SD3 folder / Hub id")
    parser.add_argument("--layers", type=int, default=4, help="tiny model: transformer layers")
    parser.add_argument("--latent-size", type=int, default=16, help="tiny model: latent side (image = 2x)")
    parser.add_argument("--resolution", type=int, default=0, help="image side (0: 2 x latent-size for tiny)")
    parser.add_argument("--num-rewards", type=int, default=5, choices=range(2, len(REWARDS) + 1))
    parser.add_argument("--batch", type=int, default=8, help="per_device_train_batch_size")
    parser.add_argument("--num-generations", type=int, default=8)
    parser.add_argument("--prompts-per-step", type=int, default=2)
    parser.add_argument("--sample-steps", type=int, default=4)
    parser.add_argument("--lora-r", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=10, help="optimizer steps before the timed window")
    parser.add_argument("--steps", type=int, default=20, help="timed optimizer steps (a multiple of 10)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--bf16", action="store_true", help="bf16 mixed precision (GPU)")
    parser.add_argument("--beta", type=float, default=1e-4, help="KL weight (0 drops the KL stream of refreshes)")
    parser.add_argument("--subset", type=int, default=1, help="marble_refresh_subset of the *_estimated configs")
    parser.add_argument(
        "--spread-warning", type=float, default=0.05, help="warn when a ratio's rounds spread more than this fraction"
    )
    parser.add_argument(
        "--configs", nargs="+", choices=list(CONFIGS), default=list(CONFIGS), help="weighted_sum is always run"
    )
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    if args.steps % 10:
        parser.error("--steps must be a multiple of 10 so that N=10 sees its share of refreshes")

    names = ["weighted_sum", *(c for c in args.configs if c != "weighted_sum")]
    results: dict[str, list[dict]] = {name: [] for name in names}
    for r in range(args.rounds):
        for name in names:
            cmd = [sys.executable, __file__, "--worker", name, *sys.argv[1:]]
            out = subprocess.run(cmd, capture_output=True, text=True, check=False)
            if out.returncode:
                sys.exit(f"{name} failed:\n{out.stderr[-3000:]}")
            line = next(ln for ln in out.stdout.splitlines()[::-1] if ln.startswith("{"))
            results[name].append(json.loads(line))
            print(f"round {r + 1}/{args.rounds} {name}: {results[name][-1]}", flush=True)

    rows, warnings = summarise(results, args.spread_warning)
    print(
        f"\nK={args.num_rewards} rewards, {args.rounds} rounds, timed steps {args.steps} after {args.warmup} warm-up"
    )
    print(
        f"{'config':>22} | step time (median) | throughput vs weighted sum (min-max over rounds) | peak memory vs "
        "weighted sum | transformer calls (grad + no grad) | whole run"
    )
    print("-" * 150)
    for r in rows:
        print(
            f"{r['config']:>22} | {r['step_time'] * 1000:14.1f} ms | {r['speed']:.3f}x ({r['speed_min']:.3f}-"
            f"{r['speed_max']:.3f}) | {r['memory']:.3f}x ({r['peak']:.2f} {r['unit']}) | {r['grad_calls']} + "
            f"{r['no_grad_calls']} | {r['run_time']:.1f} s"
        )
    for warning in warnings:
        print(f"WARNING: {warning}")


if __name__ == "__main__":
    main()
