"""Worker for the released-MARBLE exactness test: trains the tiny model with ``marble_procedure="released"`` and, at
every optimizer step, compares the trainer's parameter update with :class:`released_reference.ReleasedReference`'s.

Run under ``torchrun`` (python released_run.py OUT_DIR PER_DEVICE STEPS [ENGINE [POLICY]]) or call :func:`run` in
the test process (one process). ENGINE: ``marble_gradient_engine`` (auto); POLICY: ``lora`` or ``full`` (every weight
of the transformer, ``use_peft=False``). Writes ``OUT_DIR/rank<i>.pt``: per step the largest difference of the updates relative to the
reference update's largest entry, the reference's solved steps and fallbacks, and both coefficient states.
"""

import sys
from pathlib import Path

import torch
from transformers import TrainerCallback

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: released_reference
from released_reference import ReleasedReference  # noqa: E402

from marble_trl import MarbleDiffusionNFTConfig, MarbleDiffusionNFTTrainer  # noqa: E402
from marble_trl.data.prompts import load_prompt_dataset  # noqa: E402

LR = 0.05
REFRESH, WARMUP, RHO = 4, 1, 0.7


def brightness(prompts, images, **_):
    return images.float().mean(dim=(1, 2, 3)).tolist()


def contrast(prompts, images, **_):
    return images.float().mean(dim=1).flatten(1).std(dim=1).tolist()


def half(prompts, images, **_):
    """Redness on prompts of even length (7 of the 16 bundled prompts), None on the others."""
    red = (images[:, 0] - images[:, 1:].mean(dim=1)).mean(dim=(1, 2)).tolist()
    return [r if len(p) % 2 == 0 else None for p, r in zip(prompts, red)]


class Checked(MarbleDiffusionNFTTrainer):
    """The trainer, plus the reference's expected update at each step's first micro-batch (before any backward)."""

    def training_step(self, model, inputs, num_items_in_batch=None):
        if inputs.index == 0:
            self.step_start = {n: p.detach().clone() for n, p in self.trainable_parameters().items()}
            grads = self.reference.step_gradient(self, self.session.batches, self.state.global_step)
            self.expected = {n: -LR * g.float() for n, g in zip(self.step_start, grads)}
        return super().training_step(model, inputs, num_items_in_batch)


class Compare(TrainerCallback):
    def __init__(self, trainer: Checked) -> None:
        self.trainer, self.errors = trainer, []

    def on_step_end(self, args, state, control, **kwargs):
        t = self.trainer
        worst, scale = 0.0, max(e.abs().max().item() for e in t.expected.values())
        for n, p in t.trainable_parameters().items():
            p, start = p.detach(), t.step_start[n]
            # float32 parameters hold p - lr g to one rounding of |p|: that much of each difference is representation
            rounding = torch.finfo(torch.float32).eps * torch.maximum(p.abs(), start.abs())
            worst = max(worst, ((p - start - t.expected[n]).abs() - rounding).max().item())
        self.errors.append((max(worst, 0.0) / scale, scale))


def run(out: str, per_device: int, steps: int, engine: str = "auto", policy: str = "lora") -> dict:
    args = MarbleDiffusionNFTConfig(
        output_dir=out,
        report_to="none",
        save_strategy="no",
        disable_tqdm=True,
        logging_steps=1,
        max_steps=int(steps),
        learning_rate=LR,
        optim="sgd",
        max_grad_norm=0.0,  # no clipping and no weight decay: the update is -lr * grad
        weight_decay=0.0,
        per_device_train_batch_size=int(per_device),
        num_generations=4,
        prompts_per_step=4,  # micro-batches of 8 hold 2 groups: a reward applies to part of a micro-batch
        resolution=16,
        num_sample_steps=3,  # 2 training timesteps: 2 pairs per micro-batch
        sample_scheduler="euler",
        max_sequence_length=8,
        lora_r=4,
        lora_alpha=8,
        use_cpu=True,
        seed=0,
        beta=1e-2,
        scale_rewards="batch",
        old_policy_decay="marble",  # the release's: v_old != v_theta, so a masked sample's pull toward it matters
        multi_objective_aggregation="marble",
        marble_procedure="released",
        marble_refresh_interval=REFRESH,
        marble_warmup_steps=WARMUP,
        marble_rho=RHO,
        marble_gradient_engine=engine,
        use_peft=policy == "lora",
    )
    trainer = Checked("tiny", [brightness, contrast, half], args=args, train_dataset=load_prompt_dataset())
    trainer.reference = ReleasedReference(3, REFRESH, WARMUP, RHO)
    compare = Compare(trainer)
    trainer.add_callback(compare)
    trainer.train()
    state = {
        "errors": compare.errors,
        "solves": trainer.reference.solves,
        "fallbacks": trainer.reference.fallbacks,
        "alpha_bar": trainer.balancer.alpha_bar.tolist(),
        "reference_alpha_bar": trainer.reference.alpha_bar.tolist(),
        "state": trainer.balancer.state_dict(),
        "history": trainer.state.log_history,
        "lora": {n: p.detach().cpu().clone() for n, p in trainer.trainable_parameters().items()},
        "world": trainer.accelerator.num_processes,
    }
    torch.save(state, f"{out}/rank{trainer.accelerator.process_index}.pt")
    return state


if __name__ == "__main__":
    run(sys.argv[1], *map(int, sys.argv[2:4]), *sys.argv[4:6])
