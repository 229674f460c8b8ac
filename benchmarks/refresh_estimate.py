"""How well a subset of a step's (micro-batch, timestep) pairs estimates MARBLE's refresh (``marble_refresh_subset``).

For each of ``--steps`` optimizer steps of a real run (the trainer's own rollouts, rewards, advantages and training
timesteps), the K per-reward gradients of every pair (the exact refresh) and of the first S pairs (the estimate, as
the trainer picks them) are computed on the same batch and noise. Reported per subset size S, as the median and the
worst over steps:

- ``cos_err``: the largest error of the estimated normalised Gram (cosines between rewards);
- ``alpha_l1``: ``||alpha*_S - alpha*||_1`` of the min-norm QP on the estimate vs the exact Gram;
- ``update_cos``: cos(estimated Eq. 7 update, exact Eq. 7 update), the estimated coefficients applied to the whole
  step's gradients as the trainer does (Prop. 1);
- ``worst_cos``: ``min_k cos(estimated update, g_k)`` on the whole step's gradients (< 0: the estimate conflicts
  with a reward; the exact refresh's own worst cosine is in the S = all row).

    python benchmarks/refresh_estimate.py                         # the tiny SD3.5 (random), K = 4 pixel rewards
    python benchmarks/refresh_estimate.py --world shapesbench     # ShapesBench v2's base model and rewards
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics

import numpy as np
import torch

# No opposing pair (brightness and darkness would make every exact refresh Pareto-stationary: a zero update).
REWARDS = ["brightness", "contrast", "saturation", "jpeg_compressibility"]


def build(args: argparse.Namespace):
    from marble_trl import MarbleDiffusionNFTConfig, MarbleDiffusionNFTTrainer
    from marble_trl.data.prompts import load_prompt_dataset

    if args.world == "shapesbench":
        from marble_trl.shapesbench.bench import Budget, _config
        from marble_trl.shapesbench.methods import all_methods
        from marble_trl.shapesbench.pretrain import pretrain
        from marble_trl.shapesbench.scorers import REWARDS as SHAPES_REWARDS
        from marble_trl.shapesbench.world import train_dataset

        method = all_methods()["marble"]
        config = _config(method, 0, Budget(), "/tmp/marble-refresh-estimate")
        model = args.model or str(pretrain(quiet=True))  # cached after the first build
        rewards = [SHAPES_REWARDS[r] for r in method.rewards]
        return MarbleDiffusionNFTTrainer(model, rewards, args=config, train_dataset=train_dataset())
    config = MarbleDiffusionNFTConfig(
        output_dir="/tmp/marble-refresh-estimate", report_to="none", save_strategy="no", disable_tqdm=True,
        per_device_train_batch_size=8, num_generations=8, prompts_per_step=2, resolution=32, num_sample_steps=4,
        sample_scheduler="euler", max_sequence_length=8, lora_r=8, lora_alpha=16, use_cpu=True, seed=0,
        timestep_fraction=0.99,
    )  # fmt: skip
    return MarbleDiffusionNFTTrainer(args.model or "tiny", REWARDS, args=config, train_dataset=load_prompt_dataset())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world", choices=["tiny", "shapesbench"], default="tiny")
    parser.add_argument("--model", default=None, help="a model path (default: the world's own)")
    parser.add_argument("--steps", type=int, default=8, help="optimizer steps to measure (each a fresh batch)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", default=None, help="also write the results here")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    from marble_trl.balance import MarbleBalancer, update_cosines
    from marble_trl.trainer.backward import per_reward_engine
    from marble_trl.trainer.solve_first import subset_gradients

    trainer = build(args)
    trainer.create_optimizer_and_scheduler(num_training_steps=args.steps)
    it = iter(trainer.get_train_dataloader())
    results: dict[int, list[dict]] = {}
    for step in range(args.steps):
        trainer.state.global_step = step
        batches = trainer.get_batch_samples(it, trainer.args.gradient_accumulation_steps, trainer.args.device)[0]
        batches = [dataclasses.replace(b, plan=dataclasses.replace(b.plan, mode="solve_first")) for b in batches]
        engine = per_reward_engine(
            trainer._gradient_engine, batches[0], "auto", trainer.trainable_parameters, len(trainer.reward_funcs),
            trainer.backend, trainer.transformer,
        )  # fmt: skip
        trainer._gradient_engine = engine
        num_train = batches[0].timestep_index.shape[1]
        kwargs = dict(
            transformer=trainer.transformer, predict=trainer.model_adapter.predict, sigmas=trainer.train_sigmas,
            settings=trainer._loss_settings, engine=engine,
            noise_generator=lambda m: trainer._generator(2, trainer._global_batch_index(m)), autocast=trainer._autocast,
            scale=1.0 / (num_train * len(batches)), device=trainer.accelerator.device, backend=trainer.backend,
        )  # fmt: skip
        total = len(batches) * num_train
        signal = batches[0].plan.has_signal
        subset_gradients(batches, subset=0, **kwargs)
        full = engine.buffers.clone().double()
        full[~signal] = 0
        exact_c, exact = MarbleBalancer(full.shape[0], rho=0).solve(full)
        exact_update = torch.as_tensor(exact_c) @ full
        for size in sorted({1, 2, 3, 4, total // 2, total} - {0}):
            if size > total:
                continue
            subset_gradients(batches, subset=size, **kwargs)
            est = engine.buffers.clone().double()
            est[~signal] = 0
            c, info = MarbleBalancer(full.shape[0], rho=0).solve(est)
            update = torch.as_tensor(c) @ full
            g_hat = lambda g: (g @ g.T) / torch.outer(g.norm(dim=1), g.norm(dim=1)).clamp_min(1e-300)  # noqa: E731
            cos_err = (g_hat(est) - g_hat(full))[signal][:, signal].abs().max().item()
            cos_k = update_cosines(update, full)[signal]
            results.setdefault(size, []).append(
                {
                    "cos_err": cos_err,
                    "alpha_l1": float(np.abs(np.array(info.alpha_used) - np.array(exact.alpha_used)).sum()),
                    "update_cos": float(
                        update @ exact_update / (update.norm() * exact_update.norm()).clamp_min(1e-300)
                    ),
                    "worst_cos": float(cos_k.min()),
                }
            )
        print(f"step {step}: {total} pairs; exact worst cos {update_cosines(exact_update, full)[signal].min():+.3f}")

    keys = ["cos_err", "alpha_l1", "update_cos", "worst_cos"]
    print(
        f"\n{args.world}: {args.steps} steps, K = {full.shape[0]}, pairs per step = {total} (median / worst over steps)"
    )
    print("| subset S | " + " | ".join(keys) + " | conflicts |")
    print("|---|" + "---|" * (len(keys) + 1))
    table = {}
    for size, rows in sorted(results.items()):
        cells = []
        for k in keys:
            values = [r[k] for r in rows]
            worst = min(values) if k in ("update_cos", "worst_cos") else max(values)
            cells.append(f"{statistics.median(values):.3f} / {worst:.3f}")
        conflicts = sum(r["worst_cos"] < 0 for r in rows)
        print(f"| {size}{' (all)' if size == total else ''} | " + " | ".join(cells) + f" | {conflicts}/{len(rows)} |")
        table[size] = rows
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"world": args.world, "pairs": total, "results": table}, f, indent=1)


if __name__ == "__main__":
    main()
