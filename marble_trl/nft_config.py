"""Configuration of :class:`~marble_trl.MarbleDiffusionNFTTrainer`."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import torch

from ._trl import BaseConfig
from .config_checks import check_batching, check_fields
from .distributed import deepspeed_without_accelerator


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
            "help": "DDP's find_unused_parameters. Every trainable LoRA parameter normally gets a gradient each "
            "backward, so the default is False (the same losses, no per-rank warning, no extra graph traversal). A "
            "multi-process DDP run first probes which LoRA tensors reach the output and turns it on, with a warning, "
            "when some cannot (e.g. a LoRA on Qwen-Image's last block's text-stream output, which it discards)."
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

    # --- LoRA or full fine-tuning ---
    use_peft: bool = field(
        default=True,
        metadata={
            "help": "Train a LoRA (true, the papers' setting) or the transformer's own weights (false: full "
            "fine-tuning, TRL's `--use_peft false`; one process, DDP, DeepSpeed ZeRO-2 / ZeRO-3 or FSDP2, "
            "docs/models.md). The lora_* fields apply only to a LoRA."
        },
    )
    full_finetune_modules: list[str] | None = field(
        default=None,
        metadata={
            "help": "With use_peft false: the transformer modules whose weights train, named as lora_target_modules "
            "(module names or their last components, e.g. to_q to_k to_v to_out.0 for the attention only). Default: "
            "every weight of the transformer."
        },
    )
    lora_r: int = field(default=32, metadata={"help": "LoRA rank (DiffusionNFT SD3.5: 32)."})
    lora_alpha: int = field(default=64, metadata={"help": "LoRA alpha (DiffusionNFT SD3.5: 64)."})
    lora_dropout: float = field(default=0.0, metadata={"help": "LoRA dropout (reference: 0)."})
    lora_init: str = field(
        default="gaussian",
        metadata={"help": "peft `init_lora_weights`: 'gaussian' (reference), 'true' (Kaiming A, zero B), ..."},
    )
    lora_target_modules: list[str] | None = field(
        default=None,
        metadata={
            "help": "Transformer modules that get LoRA (module-name suffixes). Default: the model family's "
            "(SD3: the joint-attention projections, the reference's; FLUX, Wan, Qwen-Image, SANA: those of their "
            "diffusers LoRA scripts, docs/models.md)."
        },
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
            "help": "Rollout ODE solver, run on the family's training grid (the Euler grid with the family's shift) "
            "for every family: 'dpm2' (the reference's 2nd-order multistep DPM-Solver), 'euler', 'heun' "
            "(FlowMatchHeunDiscreteScheduler), 'dpm2_diffusers' (diffusers' DPMSolverMultistepScheduler, DPM-Solver++ "
            "2M), 'pipeline' (the pipeline's own scheduler class), or one of the diffusers flow solvers "
            "FlowMatchEulerDiscreteScheduler, FlowMatchHeunDiscreteScheduler, DPMSolverMultistepScheduler, "
            "UniPCMultistepScheduler (others are refused: docs/config.md)."
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
    cache_prompt_embeddings: bool = field(
        default=False,
        metadata={
            "help": "Encode every prompt of the train and eval datasets (and the negative prompt) once before "
            "training, keep the embeddings in CPU memory and move the text encoders to the CPU: SD3.5's CLIP-L, "
            "CLIP-G and T5-XXL free 10.4 GiB of accelerator memory (bf16). Costs CPU RAM (SD3.5 at "
            "max_sequence_length 256: 2.6 MiB per prompt in bf16). A prompt the datasets do not list is encoded by "
            "the text encoders visiting the device, with a warning."
        },
    )
    offload_text_encoders: bool = field(
        default=False,
        metadata={
            "help": "Keep the text encoders in CPU memory and move them to the accelerator only to encode each "
            "step's prompts: the same 10.4 GiB freed during rollouts and training as cache_prompt_embeddings, "
            "without its RAM cost, for two host-device copies of the encoders per step (large prompt sets)."
        },
    )
    num_frames: int | None = field(
        default=None,
        metadata={"help": "Frames per video (video families: Wan; Wan needs 4k + 1). Default: the model's (Wan: 81)."},
    )
    video_reward_frames: str = field(
        default="mean",
        metadata={
            "help": "How an image reward scores a video: 'mean' (every frame, the mean of their scores), 'first', "
            "'middle', 'last' or a frame index. Rewards that take `videos` get the whole video (docs/rewards.md)."
        },
    )

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
            "(eta=0), 'delayed' (0 for 75 steps then 0.0075/step up to 0.999, the reference's OCR schedule), "
            "'marble' (MARBLE's release: eta=min(0.001 (i + 1), 0.95))."
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

    console_format: str = field(
        default="compact",
        metadata={
            "help": "What the console prints per log: 'compact' (one line: step, loss, each reward's mean, MARBLE's "
            "alpha_bar, time per step, ETA; under the progress bar) or 'full' (transformers' whole dict). Trackers "
            "and metrics.jsonl always get every metric."
        },
    )

    # --- faults and resume ---
    take_over_lock: bool = field(
        default=False,
        metadata={
            "help": "Take over output_dir's lock whoever holds it. A lock is taken over anyway when its owner's pid "
            "is gone on this host, when it belongs to this scheduler job (a requeued Slurm / PBS / LSF / SGE job), or "
            "when its heartbeat is older than its 10-minute lease (docs/checkpoints.md)."
        },
    )
    max_nonfinite_skips: int = field(
        default=3,
        metadata={
            "help": "Non-finite guard: a step whose loss, gradients or update is NaN/inf is skipped (parameters, "
            "optimizer state, old policy and EMA unchanged; counted in nonfinite/skipped_steps); this many "
            "consecutive skips stop the run with an error. 0: stop at the first. Keeping the last finite state "
            "costs one copy of the trained weights and their optimizer state per step (on the accelerator for a LoRA, "
            "in host memory under full fine-tuning)."
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
            "with several rewards), or another Gram weighting on MARBLE's per-reward gradients, with its EMA and "
            "refresh schedule: 'mgda' (MARBLE's QP without EMA), 'upgrad', 'dualproj', 'pcgrad', 'imtl_g', "
            "'aligned_mtl', 'cagrad', 'nash_mtl' (docs/marble.md). With one reward every choice is plain DiffusionNFT."
        },
    )

    # --- MARBLE balancer ---
    marble_procedure: str = field(
        default="paper",
        metadata={
            "help": "Which MARBLE: 'paper' (the paper's text: every marble_refresh_interval steps the full procedure "
            "on the whole step's per-reward gradients, alpha_bar starting uniform) or 'released' (the authors' code, "
            "aim-uofa/MARBLE: each (micro-batch, timestep) pair is solved or amortised on its own; every pair of the "
            "first marble_warmup_steps steps is solved, then the first pair of every marble_refresh_interval-th step; "
            "alpha_bar starts at the first alpha*; non-applicable samples are masked out of a solve). docs/marble.md "
            "compares them line by line."
        },
    )
    marble_rho: float = field(default=0.7, metadata={"help": "EMA factor rho of the coefficients (MARBLE: 0.7)."})
    marble_refresh_interval: int = field(
        default=10, metadata={"help": "Refresh the coefficients every N optimizer steps (MARBLE: 10; 1 = every step)."}
    )
    marble_gradient_engine: str = field(
        default="auto",
        metadata={
            "help": "Per-reward gradients: 'two_stream' (cost independent of K), 'reference' (K backwards), 'auto' "
            "(two_stream where it can), or 'layer_gram' (marble_procedure='released' only: each solved pair's Gram "
            "slice by slice, without the K gradient buffers; memory independent of K, for full fine-tuning; "
            "docs/marble.md)."
        },
    )
    marble_refresh_update: str = field(
        default="gradient",
        metadata={
            "help": "Update at refresh steps: 'gradient' (Eq. 7 with alpha*, the paper) or 'advantage' (one backward "
            "with A_bar from the smoothed coefficients; for back-ends that cannot take a hand-written gradient)."
        },
    )
    marble_refresh_subset: int = field(
        default=0,
        metadata={
            "help": "Estimate a refresh's Gram from this many (micro-batch, timestep) pairs per process, solve it "
            "before the step's backward passes and form Eq. 7 by Prop. 1 (one ordinary backward): a refresh then "
            "costs the per-reward pass on the subset only. 0 = the exact refresh on every pair (under DeepSpeed also "
            "solved first, on every pair). Needs marble_refresh_update='gradient' (docs/marble.md)."
        },
    )
    marble_amortised_update: str = field(
        default="alpha_bar",
        metadata={
            "help": "Coefficients of the steps between refreshes: 'alpha_bar' (the paper: A_bar = sum_k alpha_bar_k "
            "A_k on un-normalised gradients) or 'norm_aware' (Eq. 7's c_k = alpha_bar_k mean||g|| / ||g_k|| with the "
            "last refresh's norms, by Prop. 1; beyond the paper)."
        },
    )
    marble_silent_rewards: str = field(
        default="decay",
        metadata={
            "help": "A reward without signal at a refresh (no prompt of its family, or every group tied): 'decay' "
            "(its alpha* is 0 in the EMA, so its alpha_bar shrinks by rho) or 'hold' (its alpha_bar and last gradient "
            "norm are kept, the EMA updates the other rewards' share; beyond the paper, whose batches give every "
            "reward signal at every refresh)."
        },
    )
    marble_uniform_final_steps: int = field(
        default=0, metadata={"help": "Train the last this many steps with uniform coefficients (0 = off)."}
    )
    marble_masked_solve: bool | None = field(
        default=None,
        metadata={
            "help": "Mask samples a reward does not apply to (None) out of that reward's gradient: each reward's loss "
            "in a (micro-batch, timestep) pair is its mean over the micro-batch's applicable samples, as the release "
            "does. Off: they count with A_k = 0 (r = 0.5), which adds 0.5 grad(L_pos + L_neg) (a pull toward the old "
            "policy) to a specialist's gradient and scales its norm by the applicable fraction. Default: on for "
            "marble_procedure='released', off for 'paper'."
        },
    )
    marble_warmup_steps: int = field(
        default=1,
        metadata={"help": "'released' only: the first this many steps solve every pair (the release: 1)."},
    )
    marble_alpha_floor: float = field(
        default=0.0,
        metadata={"help": "'released' only: lower bound of each alpha in the QP (capped at 1/K; the release: 0)."},
    )
    marble_reward_groups: dict | str | None = field(
        default=None,
        metadata={
            "help": "'released' only: {group: [reward, ...]} whose gradients are averaged before the QP (one alpha per "
            "group, split equally among its members in amortised pairs); a dict or JSON string (the release: none)."
        },
    )
    marble_mgda_weights: dict | str | None = field(
        default=None,
        metadata={
            "help": "'released' only: {reward or group: w} scaling its unit gradient in the QP and the update (not in "
            "amortised pairs); a dict or JSON string (the release: none, all 1)."
        },
    )
    marble_normalize_gradients: bool = field(
        default=True,
        metadata={
            "help": "'released' only: Eq. 5 and 7 (unit gradients, rescaled by their mean norm); the release: on."
        },
    )
    marble_reward_dropout_targets: list[str] | None = field(
        default=None,
        metadata={
            "help": "'released' only: rewards that may drop out of a pair (from the samples where another reward "
            "applies), each with probability marble_reward_dropout_prob (the release: none)."
        },
    )
    marble_reward_dropout_prob: float = field(
        default=0.0, metadata={"help": "'released' only: the reward-dropout probability (the release: 0)."}
    )
    marble_reward_dropout_warmup_steps: int = field(
        default=0,
        metadata={
            "help": "'released' only: the dropout probability ramps up linearly over this many steps (0: none)."
        },
    )
    log_update_cosines: bool = field(
        default=False,
        metadata={
            "help": "Also log cos(update, g_k) for the weighted-sum baselines and on MARBLE's amortised steps (costs a "
            "per-reward gradient pass per step)."
        },
    )
    log_update_cosines_interval: int = field(
        default=1,
        metadata={
            "help": "With log_update_cosines, compute the diagnostic only on steps whose global step is a multiple of "
            "this (1 = every step); training is unchanged and the diagnostic's cost falls by this factor."
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
    param_ema_first_step: int = field(
        default=0,
        metadata={
            "help": "The s of the parameter EMA's first update in min((1+s)/(10+s), cap): 0 (DiffusionNFT's code) or "
            "1 (MARBLE's release, which counts the step just taken)."
        },
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
        for name in ("marble_reward_groups", "marble_mgda_weights"):
            if isinstance(getattr(self, name), str):
                try:
                    setattr(self, name, json.loads(getattr(self, name)))
                except json.JSONDecodeError as err:
                    raise ValueError(f"{name} must be a dict or a JSON object string: {err}.") from err
        if self.marble_masked_solve is None:
            self.marble_masked_solve = self.marble_procedure == "released"
        if isinstance(self.eval_reward_funcs, str):
            self.eval_reward_funcs = [self.eval_reward_funcs]
        # GRPOConfig maps True -> "group" and False -> "none"; YAML gives a bool, the command line "true" / "false".
        if isinstance(self.scale_rewards, bool) or str(self.scale_rewards).lower() in ("true", "false"):
            self.scale_rewards = "group" if str(self.scale_rewards).lower() == "true" else "none"
        best = self.load_best_model_at_end or getattr(self.save_strategy, "value", self.save_strategy) == "best"
        if best and self.metric_for_best_model is None:
            self.metric_for_best_model = "eval_composite"  # transformers' "loss": this trainer has no eval loss
        check_fields(self)  # marble_trl.config_checks: each error names the field and the fix
        if self.ddp_backend is None and deepspeed_without_accelerator():
            # accelerate picks no backend for DeepSpeed on CPU and then counts 1 process: give it gloo.
            self.ddp_backend = "gloo"
        super().__post_init__()
        check_batching(self)

    @property
    def images_per_step(self) -> int:
        """Images generated per optimizer step over all processes."""
        return self.per_device_train_batch_size * self.gradient_accumulation_steps * self.world_size

    @property
    def prompts_per_optimizer_step(self) -> int:
        """Prompts (groups) per optimizer step over all processes."""
        return self.images_per_step // self.num_generations
