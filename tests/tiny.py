"""The tests' shared tiny configs and test rewards: one home, so a test says only what it changes.

- :func:`tiny_args`: the fastest useful run (16 px, 2 sampler steps, groups of 2, LoRA r 2, KL off);
- :func:`trainer_args`: the trainer tests' config (32 px, 4 Euler steps, groups of 8, LoRA r 4), where the tiny model
  must visibly learn (brightness rises);
- :func:`small_args`: the checkpoint / export / Hub tests' MARBLE config (16 px, groups of 4, 2 micro-batches per
  step, refresh interval 2, the parameter EMA).

Each takes ``output_dir`` and keyword overrides of any :class:`MarbleDiffusionNFTConfig` field.
"""

from __future__ import annotations

import torch

from marble_trl import MarbleDiffusionNFTConfig
from marble_trl.models import DEFAULT_LORA_TARGETS

TINY_TARGETS = [*DEFAULT_LORA_TARGETS, "proj_out"]  # proj_out lets the tiny model move colours quickly

_COMMON = dict(
    report_to="none",
    save_strategy="no",
    disable_tqdm=True,
    logging_steps=1,
    sample_scheduler="euler",
    max_sequence_length=8,
    use_cpu=True,
    seed=0,
)
TINY = dict(
    _COMMON, max_steps=1, learning_rate=1e-2, per_device_train_batch_size=4, num_generations=2, prompts_per_step=2,
    resolution=16, num_sample_steps=2, lora_r=2, lora_alpha=4, lora_target_modules=TINY_TARGETS, beta=0.0,
)  # fmt: skip
TRAINER = dict(
    _COMMON, max_steps=2, learning_rate=1e-2, per_device_train_batch_size=8, num_generations=8, prompts_per_step=2,
    resolution=32, num_sample_steps=4, lora_r=4, lora_alpha=8, lora_target_modules=TINY_TARGETS,
)  # fmt: skip
SMALL = dict(
    _COMMON, max_steps=6, learning_rate=2e-2, per_device_train_batch_size=4, num_generations=4, prompts_per_step=2,
    resolution=16, num_sample_steps=2, lora_r=4, lora_alpha=8, lora_target_modules=TINY_TARGETS,
    marble_refresh_interval=2, param_ema=True,
)  # fmt: skip


def _args(preset: dict, output_dir, overrides: dict) -> MarbleDiffusionNFTConfig:
    return MarbleDiffusionNFTConfig(**{**preset, "output_dir": str(output_dir), **overrides})


def tiny_args(output_dir, **overrides) -> MarbleDiffusionNFTConfig:
    return _args(TINY, output_dir, overrides)


def trainer_args(output_dir, **overrides) -> MarbleDiffusionNFTConfig:
    return _args(TRAINER, output_dir, overrides)


def small_args(output_dir, **overrides) -> MarbleDiffusionNFTConfig:
    return _args(SMALL, output_dir, overrides)


# ---------------------------------------------------------------------------------------------- test rewards
def brightness(prompts, images, **_):
    return images.float().mean(dim=(1, 2, 3)).tolist()


def contrast(prompts, images, **_):
    return images.float().mean(dim=1).flatten(1).std(dim=1).tolist()


def redness(prompts, images, **_):
    images = images.float()
    return (images[:, 0] - images[:, 1:].mean(dim=1)).mean(dim=(1, 2)).tolist()


def explicit_per_reward_gradients(terms, r: torch.Tensor, params, allow_unused: bool = False) -> torch.Tensor:
    """``[K, P]``: reward k's gradient of ``sum_i r_ki L_pos_i + (1 - r_ki) L_neg_i`` over ``params`` (flat, in
    order) by one ``torch.autograd.grad`` on a fresh forward ``terms()`` each; ``allow_unused``: zeros for a
    parameter the loss does not reach (else that is an error)."""
    rows = []
    for k in range(r.shape[0]):
        lt = terms()
        loss = (r[k] * lt.loss_pos + (1 - r[k]) * lt.loss_neg).sum()
        grads = torch.autograd.grad(loss, params, allow_unused=allow_unused)
        rows.append(torch.cat([(torch.zeros_like(p) if g is None else g).reshape(-1) for g, p in zip(grads, params)]))
    return torch.stack(rows)
