"""Worker for the multi-process tests: trains the tiny model and dumps this rank's LoRA and MARBLE state.

Run under `torchrun` / `accelerate launch`: python tiny_run.py OUT_DIR PER_DEVICE GRAD_ACCUM MAX_STEPS AGGREGATION
[POLICY] (or call :func:`run` in the test process for the one-process reference). POLICY: lora (default) or full
(use_peft=False, every weight of the transformer).
"""

import sys

import torch

from marble_trl import MarbleDiffusionNFTConfig, MarbleDiffusionNFTTrainer
from marble_trl.data.prompts import load_prompt_dataset


def brightness(prompts, images, **_):
    return images.float().mean(dim=(1, 2, 3)).tolist()


def contrast(prompts, images, **_):
    return images.float().mean(dim=1).flatten(1).std(dim=1).tolist()


def run(out: str, per_device: int, grad_accum: int, max_steps: int, aggregation: str, policy: str = "lora") -> dict:
    """Train and return this rank's state (also saved as ``OUT_DIR/rank<i>.pt``)."""
    args = MarbleDiffusionNFTConfig(
        output_dir=out,
        report_to="none",
        save_strategy="no",
        disable_tqdm=True,
        logging_steps=1,
        max_steps=int(max_steps),
        learning_rate=0.1,
        optim="sgd",  # plain SGD: the invariance is about gradients; Adam would amplify float noise on tiny grads
        per_device_train_batch_size=int(per_device),
        gradient_accumulation_steps=int(grad_accum),
        num_generations=4,
        resolution=32,
        num_sample_steps=3,
        sample_scheduler="euler",
        max_sequence_length=8,
        lora_r=4,
        lora_alpha=8,
        use_cpu=True,
        seed=0,
        multi_objective_aggregation=aggregation,
        marble_refresh_interval=2,
        marble_gradient_engine="auto",
        use_peft=policy == "lora",
    )
    trainer = MarbleDiffusionNFTTrainer("tiny", [brightness, contrast], args=args, train_dataset=load_prompt_dataset())
    init = {n: p.detach().cpu().clone() for n, p in trainer.trainable_parameters().items()}
    trainer.train()
    state = {
        "init": init,
        "lora": {n: p.detach().cpu().clone() for n, p in trainer.trainable_parameters().items()},
        "balancer": trainer.balancer.state_dict() if trainer.balancer is not None else None,
        "rewards": [h.get("rewards/brightness/mean") for h in trainer.state.log_history if "loss" in h],
        "world": trainer.accelerator.num_processes,
    }
    torch.save(state, f"{out}/rank{trainer.accelerator.process_index}.pt")
    return state


if __name__ == "__main__":
    run(*sys.argv[1:7])
