"""The checks of :class:`~marble_trl.nft_config.MarbleDiffusionNFTConfig`, run by its ``__post_init__``: each error
names the field, the value and the fix. (The config module holds the fields, which are public API; this one holds the
rules between them.)"""

from __future__ import annotations

import logging
import math
import os

from .balance.advantages import SCALE_REWARDS
from .balance.engines import ENGINE_NAMES
from .balance.marble import AMORTISED_MODES, SILENT_MODES
from .balance.registry import ADVANTAGE_AGGREGATIONS
from .balance.registry import AGGREGATIONS as _ENTRIES
from .data.sources import normalise_ratios
from .persistence.resume import APPLIED_FIELDS, EXACT_FIELDS
from .policy.nft import DECAY_TYPES
from .rewards.video import check_frames
from .rollout.solvers import check_solver_name

logger = logging.getLogger("marble_trl.nft_config")  # the config's warnings, under the config's logger name

# The accepted values (balance/registry.py holds the entries): 'auto' resolves to one of them.
AGGREGATIONS = ("auto", *_ENTRIES)
WEIGHTED_SUM_AGGREGATIONS = ADVANTAGE_AGGREGATIONS  # reward_weights enter the advantages
MARBLE_PROCEDURES = ("paper", "released")


def check_fields(self) -> None:
    """The per-field and cross-field checks of :class:`MarbleDiffusionNFTConfig` (before transformers' own)."""

    def need(cond: bool, message: str) -> None:
        if not cond:
            raise ValueError(message)

    need(
        self.num_generations >= 2,
        f"num_generations must be >= 2 (a group needs a baseline), got {self.num_generations}.",
    )
    need(
        self.use_peft or self.full_finetune_modules is None or len(self.full_finetune_modules) > 0,
        "full_finetune_modules is empty: name at least one module to train, or leave it unset to train every weight.",
    )
    need(
        not self.use_peft or self.full_finetune_modules is None,
        f"full_finetune_modules={self.full_finetune_modules} is for full fine-tuning: set use_peft false "
        "(--use_peft false), or name the LoRA's modules with lora_target_modules.",
    )
    need(self.lora_r >= 1, f"lora_r must be >= 1, got {self.lora_r}.")
    need(
        self.lora_alpha != 0,
        "lora_alpha must not be 0: peft scales the adapter's output by lora_alpha / lora_r, so an adapter scaled "
        "by 0 never changes the model (every gradient is 0, grad_norm 0.0, nothing trains). The reference uses "
        "lora_alpha = 2 * lora_r (64 for lora_r 32).",
    )
    need(
        self.max_steps != 0,
        "max_steps must not be 0: transformers would still train one optimizer step (it checks the limit only "
        "after a step). Set max_steps >= 1, or -1 (the default) to train num_train_epochs epochs.",
    )
    need(self.num_frames is None or self.num_frames >= 1, f"num_frames={self.num_frames}: use at least 1 frame.")
    try:
        check_frames(self.video_reward_frames)
    except ValueError as err:
        need(False, str(err))
    need(
        self.lora_target_modules is None or len(self.lora_target_modules) > 0,
        "lora_target_modules is empty: name at least one module to adapt, or leave it unset for the family's default.",
    )
    need(
        not (self.output_dir and os.path.exists(self.output_dir) and not os.path.isdir(self.output_dir)),
        f"output_dir {self.output_dir!r} is a file, not a folder: give a folder path (created if missing).",
    )
    need(self.num_sample_steps >= 1, f"num_sample_steps must be >= 1, got {self.num_sample_steps}.")
    check_solver_name(self.sample_scheduler, "sample_scheduler")  # every family runs every accepted solver
    check_solver_name(self.eval_sample_scheduler, "eval_sample_scheduler")
    need(self.guidance_scale >= 1.0, f"guidance_scale must be >= 1.0 (1.0 = CFG-free), got {self.guidance_scale}.")
    need(self.resolution >= 8, f"resolution must be a positive number of pixels >= 8, got {self.resolution}.")
    need(self.nft_beta > 0, f"nft_beta must be > 0 (the reference uses 1.0, or 0.1 for OCR), got {self.nft_beta}.")
    need(self.beta >= 0, f"beta (KL weight) must be >= 0, got {self.beta}.")
    need(self.adv_clip_max > 0, f"adv_clip_max must be > 0 (reference 5), got {self.adv_clip_max}.")
    need(
        0 < self.timestep_fraction <= 1,
        f"timestep_fraction must be in (0, 1] (reference 0.99), got {self.timestep_fraction}.",
    )
    need(
        self.old_policy_decay in DECAY_TYPES,
        f"old_policy_decay must be one of {DECAY_TYPES}, got {self.old_policy_decay!r}.",
    )
    resumable = {*EXACT_FIELDS, *APPLIED_FIELDS, "train_dataset"}
    unknown = sorted(set(self.resume_allow_changes or []) - resumable)
    need(
        not unknown,
        f"resume_allow_changes names {unknown}, which resume does not check (they may change freely) or which "
        f"cannot change; the fields it checks: {sorted(resumable)}.",
    )
    need(self.hacking_patience >= 0, f"hacking_patience must be >= 0 (0: only log), got {self.hacking_patience}.")
    need(
        self.torch_num_threads is None or self.torch_num_threads >= 1,
        f"torch_num_threads must be >= 1 or unset (torch's default), got {self.torch_num_threads}.",
    )
    need(
        self.console_format in ("compact", "full"),
        f"console_format must be 'compact' or 'full', got {self.console_format!r}.",
    )
    need(self.max_nonfinite_skips >= 0, f"max_nonfinite_skips must be >= 0, got {self.max_nonfinite_skips}.")
    need(
        self.old_policy_update_interval >= 1,
        f"old_policy_update_interval must be >= 1 (1 = after every optimizer step), got "
        f"{self.old_policy_update_interval}.",
    )
    need(
        self.scale_rewards in SCALE_REWARDS,
        f"scale_rewards must be one of {SCALE_REWARDS} (or True = 'group', False = 'none'), got "
        f"{self.scale_rewards!r}.",
    )
    need(
        self.multi_objective_aggregation in AGGREGATIONS,
        f"multi_objective_aggregation must be one of {AGGREGATIONS}, got {self.multi_objective_aggregation!r}.",
    )
    if self.reward_weights is not None:
        need(
            all(math.isfinite(w) for w in self.reward_weights),
            f"reward_weights must be finite numbers, got {self.reward_weights}.",
        )
        check_zero_weights(self)
    need(
        self.reward_kwargs is None or isinstance(self.reward_kwargs, dict),
        "reward_kwargs must map reward names to option dicts.",
    )
    need(0 <= self.marble_rho < 1, f"marble_rho must be in [0, 1) (MARBLE: 0.7), got {self.marble_rho}.")
    need(
        self.marble_refresh_interval >= 1,
        f"marble_refresh_interval must be >= 1, got {self.marble_refresh_interval}.",
    )
    need(
        self.log_update_cosines_interval >= 1,
        f"log_update_cosines_interval must be >= 1 (1 = every step), got {self.log_update_cosines_interval}.",
    )
    need(
        self.marble_gradient_engine in ENGINE_NAMES,
        f"marble_gradient_engine must be one of {ENGINE_NAMES}, got {self.marble_gradient_engine!r}.",
    )
    need(
        self.marble_gradient_engine != "layer_gram" or self.marble_procedure == "released",
        "marble_gradient_engine='layer_gram' forms the Gram of one solved pair and never the per-reward gradients, "
        "which the paper's procedure needs (its refresh sums them over the step): set marble_procedure='released', "
        "or choose 'auto'.",
    )
    need(
        self.marble_refresh_update in ("gradient", "advantage"),
        f"marble_refresh_update must be 'gradient' or 'advantage', got {self.marble_refresh_update!r}.",
    )
    need(
        self.marble_refresh_subset >= 0,
        f"marble_refresh_subset must be >= 0 (0 = exact refreshes on every pair), got {self.marble_refresh_subset}.",
    )
    need(
        self.marble_refresh_subset == 0 or self.marble_refresh_update == "gradient",
        "marble_refresh_subset > 0 forms the refresh's Eq. 7 update from the solved coefficients: it needs "
        f"marble_refresh_update='gradient', got {self.marble_refresh_update!r}.",
    )
    need(
        self.marble_amortised_update in AMORTISED_MODES,
        f"marble_amortised_update must be 'alpha_bar' or 'norm_aware', got {self.marble_amortised_update!r}.",
    )
    need(
        self.marble_silent_rewards in SILENT_MODES,
        f"marble_silent_rewards must be 'decay' or 'hold', got {self.marble_silent_rewards!r}.",
    )
    need(self.marble_uniform_final_steps >= 0, "marble_uniform_final_steps must be >= 0.")
    check_marble_procedure(self, need)
    need(
        0 <= self.param_ema_max_decay < 1,
        f"param_ema_max_decay must be in [0, 1), got {self.param_ema_max_decay}.",
    )
    if self.source_ratios is not None:
        need(isinstance(self.source_ratios, dict), "source_ratios must map source names to ratios.")
        self.source_ratios = normalise_ratios(self.source_ratios, "source_ratios")
    need(
        self.eval_num_sample_steps >= 1,
        f"eval_num_sample_steps must be >= 1 (reference: 40), got {self.eval_num_sample_steps}.",
    )
    need(
        self.eval_guidance_scale >= 1.0,
        f"eval_guidance_scale must be >= 1.0 (1.0 = CFG-free), got {self.eval_guidance_scale}.",
    )
    need(
        self.eval_num_images_per_prompt >= 1,
        f"eval_num_images_per_prompt must be >= 1, got {self.eval_num_images_per_prompt}.",
    )
    need(self.eval_grid_prompts >= 0, f"eval_grid_prompts must be >= 0 (0: no grid), got {self.eval_grid_prompts}.")
    need(self.log_samples >= 0, f"log_samples must be >= 0 (0: off), got {self.log_samples}.")
    if self.eval_reward_funcs is not None:
        need(
            len(self.eval_reward_funcs) > 0,
            "eval_reward_funcs is empty: name at least one reward, or leave it unset to use the training rewards.",
        )
    if self.prompts_per_step is not None:
        need(self.prompts_per_step >= 1, f"prompts_per_step must be >= 1, got {self.prompts_per_step}.")


# The paper procedure's knobs (non-default values), which mean nothing to the released one.
PAPER_ONLY = {
    "marble_refresh_update": "gradient",
    "marble_refresh_subset": 0,
    "marble_amortised_update": "alpha_bar",
    "marble_silent_rewards": "decay",
    "marble_uniform_final_steps": 0,
    "log_update_cosines": False,
}
RELEASED_ONLY = {
    "marble_warmup_steps": 1,
    "marble_alpha_floor": 0.0,
    "marble_reward_groups": None,
    "marble_mgda_weights": None,
    "marble_normalize_gradients": True,
    "marble_reward_dropout_targets": None,
    "marble_reward_dropout_prob": 0.0,
    "marble_reward_dropout_warmup_steps": 0,
}


def check_marble_procedure(self, need) -> None:
    """``marble_procedure`` and the knobs that belong to one procedure only."""
    need(
        self.marble_procedure in MARBLE_PROCEDURES,
        f"marble_procedure must be one of {MARBLE_PROCEDURES}, got {self.marble_procedure!r}.",
    )
    released = self.marble_procedure == "released"
    other = PAPER_ONLY if released else RELEASED_ONLY
    stray = [name for name, default in other.items() if getattr(self, name) not in (default, [], {})]
    need(
        not stray,
        f"{stray} belong to marble_procedure={'paper' if released else 'released'!r}, not to "
        f"{self.marble_procedure!r}: drop them, or set marble_procedure (docs/marble.md).",
    )
    need(
        not released
        or self.multi_objective_aggregation == "auto"
        or "released" in _ENTRIES[self.multi_objective_aggregation].procedures,
        "marble_procedure='released' is MARBLE's own procedure: it needs multi_objective_aggregation 'marble' (or "
        f"'auto'), got {self.multi_objective_aggregation!r}.",
    )
    need(self.marble_warmup_steps >= 0, f"marble_warmup_steps must be >= 0, got {self.marble_warmup_steps}.")
    need(self.marble_alpha_floor >= 0, f"marble_alpha_floor must be >= 0, got {self.marble_alpha_floor}.")
    need(
        0 <= self.marble_reward_dropout_prob <= 1,
        f"marble_reward_dropout_prob must be in [0, 1], got {self.marble_reward_dropout_prob}.",
    )
    need(
        self.marble_reward_dropout_warmup_steps >= 0,
        f"marble_reward_dropout_warmup_steps must be >= 0, got {self.marble_reward_dropout_warmup_steps}.",
    )
    need(self.param_ema_first_step in (0, 1), f"param_ema_first_step must be 0 or 1, got {self.param_ema_first_step}.")


def check_zero_weights(self) -> None:
    """All-zero ``reward_weights``: an error where they weight the advantages, a warning where they only weight
    the logged ``reward`` (MARBLE)."""
    weights = self.reward_weights
    if not weights or any(w != 0 for w in weights):
        return
    aggregation = self.multi_objective_aggregation
    # One reward is always plain DiffusionNFT (sum_then_normalize), whatever the aggregation says.
    if aggregation in WEIGHTED_SUM_AGGREGATIONS or len(weights) == 1:
        used = aggregation if len(weights) > 1 else "sum_then_normalize (any aggregation, with one reward)"
        raise ValueError(
            f"reward_weights are all 0 ({weights}): with {used} the advantage is a weighted sum of the rewards, "
            "so every advantage would be 0 and nothing would train (grad_norm 0.0). reward_weights enter the "
            f"advantages only for {' and '.join(WEIGHTED_SUM_AGGREGATIONS)} (and any single-reward run); with "
            "'marble' they only weight the logged reward. Give at least one reward a non-zero weight, or leave "
            "reward_weights unset (all 1)."
        )
    logger.warning(
        "reward_weights are all 0 (%s): with multi_objective_aggregation=%r (MARBLE with several rewards) the "
        "balancer sets the advantage weights, so training is unaffected, but the logged reward, reward_std and "
        "frac_reward_zero_std are 0. reward_weights enter the advantages only for %s.",
        weights,
        aggregation,
        " and ".join(WEIGHTED_SUM_AGGREGATIONS),
    )


def check_batching(self) -> None:
    """The groups fit the micro-batches; sets ``gradient_accumulation_steps`` from ``prompts_per_step``."""
    world = self.world_size
    per_device = self.per_device_train_batch_size
    if self.prompts_per_step is not None:
        images = self.prompts_per_step * self.num_generations
        if images % (per_device * world):
            raise ValueError(
                f"prompts_per_step * num_generations = {images} images per step cannot be split into micro-batches "
                f"of per_device_train_batch_size={per_device} on {world} process(es); choose values where "
                f"{per_device} * {world} divides {images}."
            )
        self.gradient_accumulation_steps = images // (per_device * world)
    images = per_device * self.gradient_accumulation_steps * world
    if images % self.num_generations:
        raise ValueError(
            f"One optimizer step holds per_device_train_batch_size * gradient_accumulation_steps * num_processes "
            f"= {per_device} * {self.gradient_accumulation_steps} * {world} = {images} images, which is not a "
            f"multiple of num_generations={self.num_generations}: groups would be cut. Adjust the batch size, "
            f"gradient_accumulation_steps, or set prompts_per_step."
        )
