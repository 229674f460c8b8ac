"""Configuration of :class:`~marble_trl.MarbleDiffusionNFTTrainer`."""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass, field

import torch

from ._trl import BaseConfig
from .advantages import SCALE_REWARDS
from .models.sd3 import DEFAULT_LORA_TARGETS
from .nft import DECAY_TYPES

AGGREGATIONS = ("auto", "marble", "sum_then_normalize", "normalize_then_sum")
WEIGHTED_SUM_AGGREGATIONS = ("sum_then_normalize", "normalize_then_sum")  # reward_weights enter the advantages
logger = logging.getLogger(__name__)


@dataclass
class MarbleDiffusionNFTConfig(BaseConfig):
    r"""Configuration for DiffusionNFT / MARBLE training of text-to-image flow models.

    Subclasses TRL's trainer config (hence [`~transformers.TrainingArguments`]): every ``TrainingArguments`` field
    (``output_dir``, ``learning_rate``, ``max_steps``, ``logging_steps``, ``save_steps``, ``report_to``, ``seed``, ...)
    works as usual. Defaults follow the DiffusionNFT reference for SD3.5 Medium (arXiv 2509.16117) and MARBLE
    (arXiv 2605.06507); see ``docs/config.md`` for the full reference.

    Batching (as TRL's GRPO): ``per_device_train_batch_size`` counts *images* per micro-batch and process; one
    optimizer step uses ``per_device_train_batch_size * gradient_accumulation_steps * num_processes`` images, i.e.
    that many divided by ``num_generations`` prompts. Setting ``prompts_per_step`` derives
    ``gradient_accumulation_steps`` from it.
    """

    # --- TrainingArguments defaults changed for this trainer ---
    learning_rate: float = field(default=3e-4, metadata={"help": "AdamW learning rate (DiffusionNFT: 3e-4)."})
    weight_decay: float = field(default=1e-4, metadata={"help": "AdamW weight decay (DiffusionNFT: 1e-4)."})
    max_grad_norm: float = field(default=1.0, metadata={"help": "Gradient clipping norm (DiffusionNFT: 1.0)."})
    lr_scheduler_type: str = field(default="constant", metadata={"help": "LR schedule (DiffusionNFT: constant)."})
    logging_steps: float = field(
        default=10,
        metadata={"help": "Log every this many optimizer steps (TRL GRPO: 10); metrics are averaged over them."},
    )
    per_device_train_batch_size: int = field(
        default=8,
        metadata={
            "help": "Images (not prompts) per micro-batch on each process; one optimizer step uses "
            "per_device_train_batch_size * gradient_accumulation_steps * num_processes images."
        },
    )
    activation_checkpointing: bool | None = field(
        default=None,
        metadata={
            "help": "Enable gradient checkpointing on the diffusers transformer (saves activation memory, costs "
            "about one more forward). Applied with `transformer.enable_gradient_checkpointing()`. Unset: off, or "
            "the value of the deprecated alias `gradient_checkpointing`."
        },
    )
    gradient_checkpointing: bool | None = field(
        default=None,
        metadata={
            "help": "Deprecated alias of activation_checkpointing (transformers 5). Unset here: TRL's base sets it to "
            "True, which made transformers warn on every config and turned checkpointing on."
        },
    )
    ddp_find_unused_parameters: bool | None = field(
        default=False,
        metadata={
            "help": "DDP's find_unused_parameters. Every trainable LoRA parameter gets a gradient each backward, so "
            "the default is False (the same losses, no per-rank warning, no extra graph traversal)."
        },
    )
    bf16: bool | None = field(
        default=None,
        metadata={
            "help": "bf16 mixed precision. Unset: on when a CUDA device with bf16 support is present, off on CPU "
            "(DiffusionNFT trains SD3.5 in bf16)."
        },
    )
    remove_unused_columns: bool = field(
        default=False,
        metadata={"help": "Keep every dataset column: extra columns are passed to the reward functions."},
    )

    # --- LoRA ---
    lora_r: int = field(default=32, metadata={"help": "LoRA rank (DiffusionNFT SD3.5: 32)."})
    lora_alpha: int = field(default=64, metadata={"help": "LoRA alpha (DiffusionNFT SD3.5: 64)."})
    lora_dropout: float = field(default=0.0, metadata={"help": "LoRA dropout (reference: 0)."})
    lora_init: str = field(
        default="gaussian",
        metadata={"help": "peft `init_lora_weights`: 'gaussian' (reference), 'true' (Kaiming A, zero B), ..."},
    )
    lora_target_modules: list[str] = field(
        default_factory=lambda: list(DEFAULT_LORA_TARGETS),
        metadata={"help": "Transformer modules that get LoRA (reference: the joint-attention projections)."},
    )

    # --- groups and batching ---
    num_generations: int = field(
        default=24, metadata={"help": "Group size G: images per prompt per step (DiffusionNFT/MARBLE: 24)."}
    )
    prompts_per_step: int | None = field(
        default=None,
        metadata={
            "help": "Prompts (groups) per optimizer step (reference: 48). If set, gradient_accumulation_steps is "
            "derived: prompts_per_step * num_generations / (per_device_train_batch_size * num_processes)."
        },
    )

    # --- rollouts ---
    sample_scheduler: str = field(
        default="dpm2",
        metadata={
            "help": "Rollout ODE solver: 'euler' (FlowMatchEulerDiscreteScheduler), 'heun' (FlowMatchHeunDiscrete"
            "Scheduler), 'dpm2' (the reference's 2nd-order multistep DPM-Solver on the pipeline's Euler sigma grid, "
            "the training grid), 'dpm2_diffusers' (diffusers' DPMSolverMultistepScheduler with flow sigmas, its own "
            "grid), 'pipeline' (the pipeline's own scheduler), or any diffusers scheduler class name."
        },
    )
    num_sample_steps: int = field(
        default=10, metadata={"help": "Rollout solver steps (reference: 10; 25 for multi-reward)."}
    )
    guidance_scale: float = field(
        default=1.0, metadata={"help": "Classifier-free guidance during rollouts (DiffusionNFT is CFG-free: 1.0)."}
    )
    resolution: int = field(default=512, metadata={"help": "Image height and width in pixels (reference: 512)."})
    max_sequence_length: int = field(
        default=256, metadata={"help": "T5 prompt tokens (SD3 default 256; zero-padded when the pipeline has no T5)."}
    )
    negative_prompt: str = field(default="", metadata={"help": "Negative prompt, used only when guidance_scale > 1."})

    # --- the NFT objective ---
    nft_beta: float = field(
        default=1.0,
        metadata={
            "help": "NFT guidance strength beta of the implicit policies (reference 1.0; 0.1 for OCR/multi-reward)."
        },
    )
    beta: float = field(
        default=1e-4, metadata={"help": "KL weight to the reference (LoRA-disabled) model (reference: 1e-4)."}
    )
    adv_clip_max: float = field(default=5.0, metadata={"help": "Advantage clip A_max in r = 0.5 + A / (2 A_max)."})
    timestep_fraction: float = field(
        default=0.99,
        metadata={
            "help": "Fraction of the sampler's sigma grid trained per sample (each sample draws its own random "
            "permutation; reference 0.99 = all but one of 10 steps). At least one timestep is always used."
        },
    )
    old_policy_decay: str = field(
        default="linear",
        metadata={
            "help": "Old-policy EMA schedule: 'linear' (eta=min(0.001 i, 0.5), reference default), 'on_policy' "
            "(eta=0), 'delayed' (0 for 75 steps then 0.0075/step up to 0.999, the reference's OCR schedule)."
        },
    )
    old_policy_update_interval: int = field(
        default=1,
        metadata={
            "help": "Optimizer steps per old-policy soft update: the update (with the decay of the step just taken) "
            "runs after every N-th optimizer step, so N steps roll out with the same old policy. The reference "
            "updates once per epoch of sampling: 1 step per epoch by default, 2 in its OCR setting."
        },
    )

    # --- faults and resume ---
    max_nonfinite_skips: int = field(
        default=3,
        metadata={
            "help": "Non-finite guard: a step whose loss, gradients or update is NaN/inf is skipped (parameters, "
            "optimizer state, old policy and EMA unchanged; counted in nonfinite/skipped_steps); this many "
            "consecutive skips stop the run with an error. 0: stop at the first. Keeping the last finite state "
            "costs one copy of the LoRA and its optimizer state per step."
        },
    )
    overwrite_output_dir: bool = field(
        default=False,
        metadata={
            "help": "Start a fresh run in an output_dir that holds checkpoints of an earlier run (they are then "
            "overwritten as the new run saves). Without it such a run is refused unless it resumes."
        },
    )
    resume_allow_changes: list[str] = field(
        default_factory=list,
        metadata={
            "help": "Fields allowed to differ from the checkpoint's configuration on resume (e.g. learning_rate, "
            "seed, train_dataset); any other change to what the resumed steps compute is refused. learning_rate and "
            "weight_decay are applied to the restored optimizer. See docs/checkpoints.md."
        },
    )

    # --- rewards ---
    reward_weights: list[float] | None = field(
        default=None, metadata={"help": "Weights of the rewards for the weighted-sum baselines (default: all 1)."}
    )
    reward_kwargs: dict | str | None = field(
        default=None,
        metadata={
            "help": "Per-reward options keyed by reward name (model path, device, dtype, batch size), as a dict."
        },
    )
    scale_rewards: str = field(
        default="group",
        metadata={
            "help": "Advantage normalisation: 'group' (per-prompt std, MARBLE Eq. 3), 'batch' (global std, the "
            "DiffusionNFT code), 'none'. As in GRPOConfig, True means 'group' and False 'none' (also 'true' / "
            "'false' on the command line)."
        },
    )
    multi_objective_aggregation: str = field(
        default="auto",
        metadata={
            "help": "How several rewards combine: 'marble' (per-reward gradients + min-norm QP), "
            "'sum_then_normalize' (DiffusionNFT's weighted sum), 'normalize_then_sum' (GDPO), 'auto' (marble "
            "with several rewards). With one reward every choice is plain DiffusionNFT."
        },
    )

    # --- MARBLE balancer ---
    marble_rho: float = field(default=0.7, metadata={"help": "EMA factor rho of the coefficients (MARBLE: 0.7)."})
    marble_refresh_interval: int = field(
        default=10, metadata={"help": "Refresh the coefficients every N optimizer steps (MARBLE: 10; 1 = every step)."}
    )
    marble_gradient_engine: str = field(
        default="auto",
        metadata={
            "help": "Per-reward gradients: 'two_stream' (cost independent of K), 'reference' (K backwards), 'auto'."
        },
    )
    marble_refresh_update: str = field(
        default="gradient",
        metadata={
            "help": "Update at refresh steps: 'gradient' (Eq. 7 with alpha*, the paper) or 'advantage' (one backward "
            "with A_bar from the smoothed coefficients; for back-ends that cannot take a hand-written gradient)."
        },
    )
    marble_uniform_final_steps: int = field(
        default=0, metadata={"help": "Train the last this many steps with uniform coefficients (0 = off)."}
    )
    log_update_cosines: bool = field(
        default=False,
        metadata={
            "help": "Also log cos(update, g_k) for the weighted-sum baselines and on MARBLE's amortised steps (costs a "
            "per-reward gradient pass per step)."
        },
    )

    # --- parameter EMA ---
    param_ema: bool = field(
        default=False,
        metadata={
            "help": "Keep an EMA of the LoRA weights (off by default); `trainer.param_ema.swapped_in(transformer)` "
            "loads it for evaluation or export. Not used by the loss."
        },
    )
    param_ema_max_decay: float = field(
        default=0.9, metadata={"help": "Cap of the parameter-EMA decay min((1+s)/(10+s), cap) (reference: 0.9)."}
    )

    # --- prompt sources ---
    source_ratios: dict | str | None = field(
        default=None,
        metadata={
            "help": "Sampling share of each prompt source, keyed by the train dataset's 'source' column, as a dict or "
            'JSON string (normalised; e.g. {"ocr": 0.5, "geneval": 0.5}). Each step draws its prompts per source '
            "by ratio. Unset: rows drawn uniformly. `marble-trl train` sets it from dataset_mixture."
        },
    )

    # --- evaluation (eval_strategy / eval_steps and eval_dataset trigger it) ---
    eval_reward_funcs: list[str] | None = field(
        default=None,
        metadata={
            "help": "Rewards scored at evaluation (names or dotted paths; may differ from the training rewards, e.g. "
            "held-out metrics). Unset: the training rewards."
        },
    )
    eval_sample_scheduler: str = field(
        default="euler",
        metadata={"help": "Evaluation ODE solver (same choices as sample_scheduler; reference: Euler)."},
    )
    eval_num_sample_steps: int = field(
        default=40, metadata={"help": "Evaluation solver steps (DiffusionNFT reference evaluation: 40)."}
    )
    eval_guidance_scale: float = field(
        default=1.0, metadata={"help": "CFG scale at evaluation (reference: 1.0, CFG-free)."}
    )
    eval_num_images_per_prompt: int = field(
        default=1, metadata={"help": "Images per evaluation prompt, each from its own fixed seed."}
    )
    eval_seed: int = field(
        default=0,
        metadata={
            "help": "Seed of the evaluation noise: image i of prompt p uses a generator seeded from (eval_seed, p, i), "
            "so evaluations are identical whatever the step, batch size or number of processes."
        },
    )
    eval_use_param_ema: bool = field(
        default=True, metadata={"help": "Evaluate the parameter-EMA weights when param_ema is on."}
    )
    eval_grid_prompts: int = field(
        default=8,
        metadata={
            "help": "Prompts of the eval dataset (the first ones) in the image grid saved at each evaluation under "
            "output_dir/eval/ (0: no grid)."
        },
    )

    # --- best checkpoint, reward-hacking guard, CPU threads (docs/evaluation.md, docs/getting-started.md) ---
    hacking_patience: int = field(
        default=0,
        metadata={
            "help": "Stop training after this many consecutive evaluations flag reward hacking (eval_hacking = 1: a "
            "training reward rose since the previous evaluation while its held-out score fell). 0: only log it."
        },
    )
    torch_num_threads: int | None = field(
        default=None,
        metadata={
            "help": "CPU threads of torch (torch.set_num_threads) while train() runs. Unset: torch's default (one per core). "
            "Small models on a few shared cores run faster with 1 (the tiny-cpu recipe sets it)."
        },
    )

    # --- rollout samples to the trackers of report_to ---
    log_samples: int = field(
        default=0,
        metadata={
            "help": "Every this many optimizer steps, a captioned grid of the step's rollouts (prompt, per-image "
            "rewards) to the TensorBoard / wandb / Trackio runs of report_to (`train/samples`) and to "
            "output_dir/rollouts/step-{N}.png (0: off; TRL GRPO's log_completions)."
        },
    )

    def __post_init__(self):
        if self.bf16 is None:
            self.bf16 = bool(torch.cuda.is_available() and torch.cuda.is_bf16_supported()) and not self.fp16
        if isinstance(self.reward_kwargs, str):
            try:
                self.reward_kwargs = json.loads(self.reward_kwargs)
            except json.JSONDecodeError as err:
                raise ValueError(f"reward_kwargs must be a dict or a JSON object string: {err}.") from err
        if isinstance(self.source_ratios, str):
            try:
                self.source_ratios = json.loads(self.source_ratios)
            except json.JSONDecodeError as err:
                raise ValueError(
                    f'source_ratios must be a dict or a JSON object string like \'{{"a": 0.7, "b": 0.3}}\': {err}.'
                ) from err
        if isinstance(self.eval_reward_funcs, str):
            self.eval_reward_funcs = [self.eval_reward_funcs]
        # GRPOConfig maps True -> "group" and False -> "none"; YAML gives a bool, the command line "true" / "false".
        if isinstance(self.scale_rewards, bool) or str(self.scale_rewards).lower() in ("true", "false"):
            self.scale_rewards = "group" if str(self.scale_rewards).lower() == "true" else "none"
        best = self.load_best_model_at_end or getattr(self.save_strategy, "value", self.save_strategy) == "best"
        if best and self.metric_for_best_model is None:
            self.metric_for_best_model = "eval_composite"  # transformers' "loss": this trainer has no eval loss
        self._check_fields()
        super().__post_init__()
        self._check_batching()

    def _check_fields(self) -> None:
        def need(cond: bool, message: str) -> None:
            if not cond:
                raise ValueError(message)

        need(
            self.num_generations >= 2,
            f"num_generations must be >= 2 (a group needs a baseline), got {self.num_generations}.",
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
        need(len(self.lora_target_modules) > 0, "lora_target_modules is empty: name at least one module to adapt.")
        need(self.num_sample_steps >= 1, f"num_sample_steps must be >= 1, got {self.num_sample_steps}.")
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
        from .resume import APPLIED_FIELDS, EXACT_FIELDS

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
            self._check_zero_weights()
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
            self.marble_gradient_engine in ("auto", "two_stream", "reference"),
            f"marble_gradient_engine must be 'auto', 'two_stream' or 'reference', got {self.marble_gradient_engine!r}.",
        )
        need(
            self.marble_refresh_update in ("gradient", "advantage"),
            f"marble_refresh_update must be 'gradient' or 'advantage', got {self.marble_refresh_update!r}.",
        )
        need(self.marble_uniform_final_steps >= 0, "marble_uniform_final_steps must be >= 0.")
        need(
            0 <= self.param_ema_max_decay < 1,
            f"param_ema_max_decay must be in [0, 1), got {self.param_ema_max_decay}.",
        )
        if self.source_ratios is not None:
            from .sources import normalise_ratios

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
        need(
            self.eval_grid_prompts >= 0, f"eval_grid_prompts must be >= 0 (0: no grid), got {self.eval_grid_prompts}."
        )
        need(self.log_samples >= 0, f"log_samples must be >= 0 (0: off), got {self.log_samples}.")
        if self.eval_reward_funcs is not None:
            need(
                len(self.eval_reward_funcs) > 0,
                "eval_reward_funcs is empty: name at least one reward, or leave it unset to use the training rewards.",
            )
        if self.prompts_per_step is not None:
            need(self.prompts_per_step >= 1, f"prompts_per_step must be >= 1, got {self.prompts_per_step}.")

    def _check_zero_weights(self) -> None:
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

    def _check_batching(self) -> None:
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

    @property
    def images_per_step(self) -> int:
        """Images generated per optimizer step over all processes."""
        return self.per_device_train_batch_size * self.gradient_accumulation_steps * self.world_size

    @property
    def prompts_per_optimizer_step(self) -> int:
        """Prompts (groups) per optimizer step over all processes."""
        return self.images_per_step // self.num_generations
