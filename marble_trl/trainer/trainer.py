"""``MarbleDiffusionNFTTrainer``: DiffusionNFT online RL for SD3 / SD3.5 with LoRA, on TRL's trainer base.

DiffusionNFT: "Online Diffusion Reinforcement with Forward Process", Zheng et al., arXiv 2509.16117 (ICLR 2026).
MARBLE: "Multi-Aspect Reward Balance for Diffusion RL", arXiv 2605.06507 (2026).

It is a :class:`transformers.Trainer` (through TRL's base), so logging, ``report_to``, callbacks, progress bars and
``save_steps`` behave as usual. One optimizer step is:

1. rollouts of ``G`` images per prompt with the old-policy adapter (CFG-free by default), prompt embeddings computed
   once per distinct prompt;
2. rewards, gathered over processes, and group advantages (:mod:`marble_trl.advantages`);
3. the NFT loss on the forward process for every (micro-batch, training timestep), accumulated into one step;
4. the optimizer step, then the old-policy soft update.

The ``transformers.Trainer`` hooks overridden, and why:

- ``get_batch_samples``: it receives the micro-batches of one optimizer step at once; the rollouts and rewards of the
  whole step run there (step 1-2), and it returns the micro-batches of rollout data;
- ``training_step``: the NFT loss over the sampler's timesteps (step 3);
- ``_get_train_sampler``: whole groups, whole steps (:class:`~marble_trl.data.GroupSampler`);
- ``log``: adds the averaged rollout/reward/NFT metrics;
- ``_save``: writes the LoRA in diffusers format instead of the whole transformer;
- ``_save_checkpoint`` / ``_load_from_checkpoint`` / ``train``: atomic checkpoints with the old-policy adapter, the
  parameter EMA and the MARBLE state, exact resume, a checkpoint on SIGTERM/SIGINT (:mod:`marble_trl.checkpoint`);
- ``_load_best_model``: ``load_best_model_at_end`` restores the best checkpoint's LoRA adapters (:mod:`marble_trl.best`);
- ``create_model_card`` / ``push_to_hub`` / ``init_hf_repo`` / ``_push_from_checkpoint``: a diffusers LoRA card and
  Hub uploads (:mod:`marble_trl.hub`);
- ``_send_telemetry``: TRL's reads ``model.config.model_type``, which diffusers models lack.

Rollouts and training share the reference's grid: the training timesteps are the Euler sigma grid of the pipeline's
shift with ``num_sample_steps`` points, and the default ``dpm2`` rollout solver is the reference's 2nd-order DPM-Solver
evaluated at exactly those sigmas (:mod:`marble_trl.dpm_solver`). Deviations from the reference code
(``docs/nft-loss.md`` lists them all): rollout timesteps are not rounded to integers; the old-policy and EMA decays
use the 0-based index of the step just taken; the LoRA is float32 and the base model may be bf16 (the reference
keeps the whole transformer in float32 under autocast); advantages use population stds as the reference does (TRL's
GRPO uses unbiased ones).
"""

from __future__ import annotations

import contextlib
import math
import os
import time
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

import torch
from accelerate.utils import gather_object
from transformers import TrainerCallback, set_seed

from .._trl import BaseTrainer
from ..advantages import collate_advantages, group_std, group_std_is_zero
from ..artifacts import TRAINING_ARGS_FILE
from ..balance import MarbleBalancer, RefreshInfo, make_gradient_engine
from ..best import RewardHackingCallback, load_best_checkpoint, record_best_checkpoint, selection_metrics
from ..checkpoint import (
    SamplerEpochCallback,
    SaveOnSignalCallback,
    load_training_state,
    save_checkpoint_atomically,
    training_session,
)
from ..console import order_logs, torch_threads
from ..data import GroupSampler, check_prompt_dataset
from ..distributed import (
    check_frozen_models_not_partitioned,
    configure_deepspeed,
    disable_zero3_init,
    gathered,
    num_train_timesteps,
)
from ..evaluation import generate_eval_images, grid_image, sample_seed, summarize_scores
from ..guards import NonFiniteGuard
from ..lora import (
    TRAIN_ADAPTER,
    LoraEMA,
    OldPolicy,
    add_policy_adapters,
    lora_parameters,
    master_weights,
    use_old_policy,
    use_reference,
)
from ..models import Conditioning, adapter_for, load_model
from ..nft import advantage_to_r, old_policy_decay, param_ema_decay
from ..nft_config import MarbleDiffusionNFTConfig
from ..resume import apply_changed_hyperparameters
from ..rewards import (
    RewardFunc,
    RewardLogs,
    check_reward_funcs,
    finite_numbers,
    resolve_reward_funcs,
    reward_name,
    score_rewards,
)
from ..rollout import make_scheduler, training_sigmas
from ..seeding import keyed_generator
from ..sources import SOURCE_COLUMN
from ..trackers import adapt_model_config, log_image, rollout_grid
from .backward import DeepSpeedBackward, LossSettings, PlainBackward, finish_engine_step, micro_batch_loss
from .step import MicroBatch, StepPlan, gather_rewards, global_batch_index, make_micro_batches, plan_step


def _eval_datasets(eval_dataset: Any) -> list[tuple[str, Any]]:
    """``(name, dataset)`` pairs of an ``eval_dataset`` (``None``, a dataset, or a dict of them)."""
    if eval_dataset is None:
        return []
    if isinstance(eval_dataset, dict):
        return [(f"eval_dataset[{key!r}]", ds) for key, ds in eval_dataset.items()]
    return [("eval_dataset", eval_dataset)]


def _identity_collator(features: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return features


class _AfterOptimizerStep(TrainerCallback):
    """Runs the old-policy soft update (and the parameter EMA) right after each optimizer step."""

    def __init__(self, trainer: MarbleDiffusionNFTTrainer) -> None:
        self.trainer = trainer

    def on_optimizer_step(self, args, state, control, **kwargs):
        self.trainer._after_optimizer_step()


class MarbleDiffusionNFTTrainer(BaseTrainer):
    """DiffusionNFT (and, with several rewards, MARBLE) for Stable Diffusion 3 / 3.5 pipelines with LoRA.

    Args:
        model: a ``StableDiffusion3Pipeline``, a local diffusers folder, a Hub id, or ``"tiny"`` (offline tiny model).
        reward_funcs: one reward or a list: callables ``(prompts, images, **columns) -> list[float | None]``,
            registered names, or dotted import paths (see ``docs/rewards.md``).
        args: a :class:`MarbleDiffusionNFTConfig`.
        train_dataset: a ``datasets.Dataset`` with a ``prompt`` column; other columns reach the reward functions.
        eval_dataset: prompts for :meth:`evaluate` (a ``datasets.Dataset`` with a ``prompt`` column, or a dict of
            them); evaluation runs at ``eval_strategy`` / ``eval_steps`` as in ``transformers.Trainer``.
        peft_config: a ``peft.LoraConfig``; by default one is built from the ``lora_*`` fields of ``args``.
        eval_reward_funcs: the rewards scored by :meth:`evaluate` (default: ``args.eval_reward_funcs``, else the
            training rewards); training rewards of the same name are reused, not built twice.
    """

    _tag_names = ["trl", "marble", "diffusion-nft", "diffusers", "lora", "text-to-image"]
    _name = "MARBLE DiffusionNFT"
    _paper = {
        "title": "Online Diffusion Reinforcement with Forward Process",
        "id": "2509.16117",
        "citation": (
            "@inproceedings{zheng2026diffusionnft,\n  title={{DiffusionNFT: Online Diffusion Reinforcement with "
            "Forward Process}},\n  author={Zheng, Kaiwen and others},\n  booktitle={ICLR},\n  year={2026}\n}"
        ),
    }

    def __init__(
        self,
        model: Any,
        reward_funcs: RewardFunc | str | Sequence[RewardFunc | str],
        args: MarbleDiffusionNFTConfig | None = None,
        train_dataset: Any = None,
        eval_dataset: Any = None,
        peft_config: Any = None,
        callbacks: list[TrainerCallback] | None = None,
        optimizers: tuple[Any, Any] = (None, None),
        eval_reward_funcs: RewardFunc | str | Sequence[RewardFunc | str] | None = None,
    ) -> None:
        if args is None:  # the reference setup: 48 prompts x 24 images per step
            args = MarbleDiffusionNFTConfig(output_dir="marble-diffusion-nft", prompts_per_step=48)
        if not isinstance(args, MarbleDiffusionNFTConfig):
            raise TypeError(f"args must be a MarbleDiffusionNFTConfig, got {type(args).__name__}.")
        check_prompt_dataset(train_dataset)
        # A callable reward with the wrong signature fails here, before the model loads (named ones once resolved).
        train_columns = getattr(train_dataset, "column_names", None)
        specs = [reward_funcs] if isinstance(reward_funcs, str) or callable(reward_funcs) else list(reward_funcs)
        check_reward_funcs([f for f in specs if callable(f)], columns=train_columns)
        self._source_indices(train_dataset, args.source_ratios)  # a mixture's ratios fail here, not at train()
        for name, dataset in _eval_datasets(eval_dataset):
            check_prompt_dataset(dataset, name=name)
        # Seed before the LoRA is initialised (transformers.Trainer seeds only in its own __init__, after that).
        set_seed(args.seed)
        disable_zero3_init()  # ZeRO-3: no frozen model (reward models load lazily) may be built partitioned

        # The model family's adapter (marble_trl.models): the trainer talks to the model only through it.
        self.model_adapter = adapter_for(model) if hasattr(model, "transformer") else load_model(model)
        self.pipeline = self.model_adapter.pipeline
        check_frozen_models_not_partitioned(self.pipeline)
        self.model_name_or_path = None if hasattr(model, "transformer") else str(model)  # the card's base model
        self.pipeline.set_progress_bar_config(disable=True)
        for name in ("vae", "text_encoder", "text_encoder_2", "text_encoder_3"):
            component = getattr(self.pipeline, name, None)
            if component is not None:
                component.requires_grad_(False).eval()
        self._check_resolution(args)
        transformer = self.pipeline.transformer

        if peft_config is None:
            from peft import LoraConfig

            init = {"true": True, "false": False}.get(str(args.lora_init).lower(), args.lora_init)
            peft_config = LoraConfig(
                r=args.lora_r,
                lora_alpha=args.lora_alpha,
                lora_dropout=args.lora_dropout,
                init_lora_weights=init,
                target_modules=list(args.lora_target_modules),
            )
        if getattr(peft_config, "lora_alpha", None) == 0:
            raise ValueError(
                "peft_config.lora_alpha is 0: the adapter's output is scaled by lora_alpha / r, so training would never "
                "change the model. Use a positive lora_alpha (e.g. 2 r)."
            )
        self.peft_config = peft_config
        add_policy_adapters(transformer, peft_config)
        # diffusers models have `enable_gradient_checkpointing`; Trainer calls `activation_checkpointing_enable`.
        transformer.activation_checkpointing_enable = lambda **_: transformer.enable_gradient_checkpointing()
        adapt_model_config(transformer)  # report_to callbacks read model.config as a transformers config

        self.reward_funcs = resolve_reward_funcs(reward_funcs, args.reward_kwargs)
        self.reward_names = [reward_name(f) for f in self.reward_funcs]
        check_reward_funcs(self.reward_funcs, self.reward_names, train_columns)  # (prompts, images, **columns)
        if len(set(self.reward_names)) != len(self.reward_names):
            raise ValueError(
                f"Reward names must be unique (they name the logged metrics), got {self.reward_names}; give each "
                "callable a distinct __name__."
            )
        if args.reward_weights is not None and len(args.reward_weights) != len(self.reward_funcs):
            raise ValueError(
                f"reward_weights has {len(args.reward_weights)} entries for {len(self.reward_funcs)} rewards "
                f"({self.reward_names})."
            )
        weights = args.reward_weights if args.reward_weights is not None else [1.0] * len(self.reward_funcs)
        self.reward_weights = torch.tensor(weights, dtype=torch.float32)
        self.aggregation = self._resolve_aggregation(args.multi_objective_aggregation, len(self.reward_funcs))
        self.eval_reward_funcs, self.eval_reward_names = self._resolve_eval_rewards(eval_reward_funcs, args)
        for columns in [getattr(d, "column_names", None) for _, d in _eval_datasets(eval_dataset)] or [None]:
            check_reward_funcs(self.eval_reward_funcs, self.eval_reward_names, columns)
        self.reward_extras: dict[str, list[Any]] = {}  # log_extra's columns of the last step (this process's samples)

        self._metrics: dict[str, list[float]] = defaultdict(list)
        self._step_timer: dict[str, float] = defaultdict(float)
        super().__init__(
            model=transformer,
            args=args,
            data_collator=_identity_collator,
            train_dataset=train_dataset,
            eval_dataset=eval_dataset,
            callbacks=callbacks,
            optimizers=optimizers,
        )
        device = self.accelerator.device
        for name in ("vae", "text_encoder", "text_encoder_2", "text_encoder_3"):
            component = getattr(self.pipeline, name, None)
            if component is not None:
                component.to(device)
        self.rollout_scheduler = make_scheduler(args.sample_scheduler, self.pipeline.scheduler)
        self.train_sigmas = training_sigmas(self.pipeline.scheduler, args.num_sample_steps)
        self.eval_scheduler = make_scheduler(args.eval_sample_scheduler, self.pipeline.scheduler)
        if self.is_deepspeed_enabled:
            configure_deepspeed(self)
        self._backward = (
            DeepSpeedBackward(self.accelerator) if self.is_deepspeed_enabled else PlainBackward(self.accelerator)
        )
        self._loss_settings = LossSettings(args.nft_beta, args.beta, args.adv_clip_max, args.marble_refresh_update)
        self.param_ema = LoraEMA(transformer) if args.param_ema else None
        self.old_policy = OldPolicy()
        self.balancer = None
        if self.aggregation == "marble":
            self.balancer = MarbleBalancer(
                reward_names=self.reward_names,
                rho=args.marble_rho,
                refresh_interval=args.marble_refresh_interval,
                uniform_final_steps=args.marble_uniform_final_steps,
            )
        self._gradient_engine = None
        self.nonfinite_guard = NonFiniteGuard(self, args.max_nonfinite_skips)
        self.add_callback(self.nonfinite_guard)  # before _AfterOptimizerStep, which reads its verdict
        self.add_callback(_AfterOptimizerStep(self))
        self._checkpoint_staging_root: str | None = None
        self.emergency_checkpoint: str | None = None  # set when train() raised and a checkpoint was written
        self.add_callback(SaveOnSignalCallback(self))
        self.add_callback(SamplerEpochCallback())
        if args.hacking_patience:
            self.add_callback(RewardHackingCallback(args.hacking_patience))

    # ------------------------------------------------------------------ setup helpers
    def _check_resolution(self, args: MarbleDiffusionNFTConfig) -> None:
        factor = self.model_adapter.latent_factor
        if args.resolution % factor:
            raise ValueError(
                f"resolution={args.resolution} must be a multiple of {factor} (VAE factor x patch size) for this "
                "pipeline."
            )

    @staticmethod
    def _resolve_aggregation(requested: str, num_rewards: int) -> str:
        """'auto' is MARBLE with several rewards; with one reward every aggregation is plain DiffusionNFT (the
        reward's weight, normalised away, does not scale the advantage)."""
        if num_rewards == 1:
            return "sum_then_normalize"
        return "marble" if requested == "auto" else requested

    def _send_telemetry(self) -> None:
        # TRL's telemetry reads `model.config.model_type`, which diffusers models do not have (it would crash every
        # run outside CI). This trainer is not one of TRL's, so it sends nothing.
        return

    def _resolve_eval_rewards(self, specs, args: MarbleDiffusionNFTConfig) -> tuple[list[RewardFunc], list[str]]:
        """The evaluation rewards: the training rewards unless given; a training reward's name reuses its instance."""
        specs = specs if specs is not None else args.eval_reward_funcs
        if specs is None:
            return list(self.reward_funcs), list(self.reward_names)
        specs = [specs] if isinstance(specs, str) or callable(specs) else list(specs)
        trained = dict(zip(self.reward_names, self.reward_funcs))
        kwargs = args.reward_kwargs or {}
        funcs = []
        for spec in specs:
            if isinstance(spec, str) and spec in trained:
                funcs.append(trained[spec])
            else:
                options = {spec: kwargs[spec]} if isinstance(spec, str) and spec in kwargs else None
                funcs.extend(resolve_reward_funcs([spec], options))
        names = [reward_name(f) for f in funcs]
        if len(set(names)) != len(names):
            raise ValueError(f"eval_reward_funcs names must be unique, got {names}.")
        return funcs, names

    def _get_train_sampler(self, train_dataset=None) -> GroupSampler:
        dataset = train_dataset if train_dataset is not None else self.train_dataset
        sources, ratios = self._source_indices(dataset, self.args.source_ratios)
        return GroupSampler(
            num_prompts=len(dataset),
            num_generations=self.args.num_generations,
            prompts_per_step=self.args.prompts_per_optimizer_step,
            seed=self.args.seed,
            sources=sources,
            ratios=ratios,
        )

    @staticmethod
    def _source_indices(dataset, ratios: dict[str, float] | None) -> tuple[list[int] | None, list[float] | None]:
        """Each row's source index and each source's ratio, from the ``source`` column and ``source_ratios``."""
        if ratios is None:
            return None, None
        if SOURCE_COLUMN not in dataset.column_names:
            raise ValueError(
                f"source_ratios is set ({ratios}) but the train dataset has no {SOURCE_COLUMN!r} column; build it with "
                "marble_trl.sources.load_prompt_sources (or add the column), or unset source_ratios."
            )
        names = list(ratios)
        index = {name: k for k, name in enumerate(names)}
        column = dataset[SOURCE_COLUMN]
        unknown = sorted({str(v) for v in column} - set(index))
        if unknown:
            raise ValueError(
                f"source_ratios gives no ratio for the source(s) {unknown} of the train dataset (ratios for: {names}); "
                "add them to source_ratios (0 to leave a source out)."
            )
        absent = sorted(n for n in names if ratios[n] > 0 and n not in set(column))
        if absent:
            raise ValueError(
                f"source_ratios names source(s) {absent} that have no row in the train dataset's {SOURCE_COLUMN!r} "
                "column; fix the names or remove them."
            )
        return [index[str(v)] for v in column], [ratios[n] for n in names]

    @property
    def transformer(self) -> torch.nn.Module:
        """The transformer with its adapters, unwrapped from DDP/DeepSpeed."""
        return self.accelerator.unwrap_model(self.model)

    def _generator(self, *keys: int) -> torch.Generator:
        """A CPU generator seeded from the run seed, the optimizer step and ``keys``.

        Callers key it by the *global* micro-batch index (not the process index), so a run's random draws depend only
        on which samples a micro-batch holds: 1 process with gradient accumulation and N processes with the same
        global batch draw the same noise, and a resumed run draws what the uninterrupted one did.
        """
        return keyed_generator(self.args.seed, self.state.global_step, *keys)

    def _global_batch_index(self, micro_batch: int) -> int:
        return global_batch_index(micro_batch, self.accelerator.num_processes, self.accelerator.process_index)

    # ------------------------------------------------------------------ rollouts and rewards
    def get_batch_samples(self, epoch_iterator, num_batches: int, device: torch.device):
        """Collect the step's micro-batches of prompts, then generate and score the whole step's rollouts."""
        batches = []
        for _ in range(num_batches):
            try:
                batches.append(next(epoch_iterator))
            except StopIteration:
                break
        if not batches:
            return batches, None
        return self._generate_and_score(batches), None

    def _autocast(self):
        return self.accelerator.autocast() if self.args.bf16 or self.args.fp16 else contextlib.nullcontext()

    def _flush_reward_logs(self, logs: RewardLogs, batch: int) -> None:
        """What the rewards logged (GRPO's flush): each ``log_metric`` name averaged over all processes' values into
        the logged metrics; for each ``log_extra`` column, the mean of its finite numbers (all processes) as
        ``extra/{column}``, and this process's values in ``self.reward_extras``. Names are gathered and sorted so that
        every process gathers the same metrics in the same order."""
        device = self.accelerator.device

        def mean_over_processes(values: list[float]) -> float | None:
            local = torch.tensor([sum(values), len(values)], dtype=torch.float64, device=device)
            total, count = self.accelerator.gather(local).view(-1, 2).sum(dim=0).tolist()
            return total / count if count else None

        for name in sorted(set(gather_object(list(logs.metrics)))):
            value = mean_over_processes(logs.metrics.get(name, []))
            if value is not None:
                self._metrics[name].append(value)
        self.reward_extras = {}
        for column in sorted(set(gather_object(list(logs.extras)))):
            values = logs.extras.get(column, [None] * batch)
            self.reward_extras[column] = values
            value = mean_over_processes(finite_numbers(values))
            if value is not None:
                key = f"extra/{column}"  # a user's column: documented as extra/{column} in docs/coming-from-grpo.md
                self._metrics[key].append(value)

    def _generate_and_score(self, batches: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
        args = self.args
        device = self.accelerator.device
        samples = [s for batch in batches for s in batch]
        prompts = [s["prompt"] for s in samples]
        columns = {key: [s.get(key) for s in samples] for key in samples[0] if key != "prompt"}
        micro = len(batches[0])

        start = time.perf_counter()
        embeds, negative = self._encode(prompts)
        latents, images = [], []
        with use_old_policy(self.transformer), self._autocast():
            for m in range(len(batches)):
                sl = slice(m * micro, (m + 1) * micro)
                x0 = self.model_adapter.sample(
                    self.rollout_scheduler,
                    embeds.index(sl),
                    args.num_sample_steps,
                    args.resolution,
                    self._generator(0, self._global_batch_index(m)),
                    args.guidance_scale,
                    negative.index(sl) if negative is not None else None,
                )
                latents.append(x0.float())
                images.append(self.model_adapter.decode(x0))
        x0_all = torch.cat(latents)
        images_all = torch.cat(images)
        rollout_time = time.perf_counter() - start
        if not torch.isfinite(x0_all).all():
            raise FloatingPointError(
                f"Step {self.state.global_step}: the rollouts' latents contain NaN/inf, so every image and reward would "
                "be NaN. The old-policy adapter or the base model has non-finite weights (a corrupt checkpoint or "
                "model file?), or the rollout overflowed in half precision; check the model and the last checkpoint."
            )

        start = time.perf_counter()
        timings: dict[str, float] = {}
        reward_logs = RewardLogs()  # GRPO's trainer_state / log_extra / log_metric kwargs
        rewards_local = score_rewards(
            self.reward_funcs,
            prompts,
            images_all,
            columns,
            self.reward_names,
            timings,
            trainer_state=self.state,
            logs=reward_logs,
        )
        reward_time = time.perf_counter() - start
        self._flush_reward_logs(reward_logs, len(prompts))
        for name, seconds in timings.items():
            self._metrics[f"rewards/{name}/time"].append(seconds)

        gathered_rewards = gather_rewards(
            self.accelerator, rewards_local, prompts, micro, args.num_generations, columns.get(SOURCE_COLUMN)
        )
        adv = collate_advantages(
            gathered_rewards.rewards, args.num_generations, args.scale_rewards, self.reward_weights, self.aggregation
        )
        self._log_rewards(gathered_rewards.rewards, gathered_rewards.sources)
        local_positions = gathered_rewards.local_positions
        self._log_rollout_samples(prompts, images_all, rewards_local, local_positions // args.num_generations)
        self._metrics["time/rollout"].append(rollout_time)
        self._metrics["time/reward"].append(reward_time)

        if self.balancer is not None and self.balancer.uniform_final_steps and self.balancer.max_steps is None:
            self.balancer.max_steps = self.state.max_steps
        plan = plan_step(
            adv.per_reward,
            adv.combined,
            self.balancer,
            self.state.global_step,
            log_update_cosines=args.log_update_cosines,
            adv_clip_max=args.adv_clip_max,
        )
        if self.balancer is not None:
            self._metrics["marble/clamp_violations"].append(float(self.balancer.num_clamp_violations))
        return make_micro_batches(
            x0_all,
            embeds,
            plan,
            adv.per_reward,
            local_positions,
            micro,
            len(batches),
            len(self.train_sigmas),
            num_train_timesteps(len(self.train_sigmas), args.timestep_fraction),
            lambda m: self._generator(1, self._global_batch_index(m)),
            device,
        )

    def _encode(self, prompts: list[str]) -> tuple[Conditioning, Conditioning | None]:
        """The prompts' conditioning, and the negative prompt's when CFG is on (guidance_scale > 1)."""
        args, device = self.args, self.accelerator.device
        embeds = self.model_adapter.encode(prompts, args.max_sequence_length, device)
        negative = None
        if args.guidance_scale > 1.0:
            negative = self.model_adapter.encode(
                [args.negative_prompt] * len(prompts), args.max_sequence_length, device
            )
        return embeds, negative

    def _log_rewards(self, rewards: torch.Tensor, sources: list[Any] | None = None) -> None:
        g = self.args.num_generations
        names = sorted({str(s) for s in sources if s is not None}) if sources is not None else []
        source_masks = {n: torch.tensor([str(s) == n for s in sources]) for n in names}
        for k, name in enumerate(self.reward_names):
            values = rewards[k]
            ok = ~torch.isnan(values)
            applicable = values[ok]
            if applicable.numel():
                self._metrics[f"rewards/{name}/mean"].append(applicable.mean().item())
                self._metrics[f"rewards/{name}/std"].append(applicable.std(unbiased=False).item())
            for source, in_source in source_masks.items():
                mask = ok & in_source
                if mask.any():  # a reward that informs no sample of this source logs nothing for it
                    self._metrics[f"rewards/{name}/{source}/mean"].append(values[mask].mean().item())
            self._metrics[f"rewards/{name}/frac_not_applicable"].append(1.0 - ok.float().mean().item())
            self._metrics[f"rewards/{name}/frac_zero_std"].append(group_std_is_zero(values, g).float().mean().item())
        weighted = (rewards * self.reward_weights[:, None]).nansum(dim=0)
        weighted[torch.isnan(rewards).all(dim=0)] = float("nan")
        self._metrics["reward"].append(torch.nanmean(weighted).item())
        self._metrics["reward_std"].append(group_std(weighted, g).mean().item())
        self._metrics["frac_reward_zero_std"].append(group_std_is_zero(weighted, g).float().mean().item())

    # ------------------------------------------------------------------ the NFT loss
    def training_step(self, model, inputs: MicroBatch, num_items_in_batch=None) -> torch.Tensor:
        """The NFT loss of one micro-batch, summed over its training timesteps (each a forward/backward:
        :func:`~marble_trl.trainer.backward.micro_batch_loss`); after the step's last micro-batch, MARBLE's refresh or
        the cosine diagnostic."""
        start = time.perf_counter()
        model.train()
        batch = inputs
        engine = self._engine_for(batch)
        num_train = batch.timestep_index.shape[1]
        scale = 1.0 / (num_train * self.current_gradient_accumulation_steps)
        result = micro_batch_loss(
            batch,
            model=model,
            transformer=self.transformer,
            predict=self.model_adapter.predict,
            sigmas=self.train_sigmas,
            settings=self._loss_settings,
            backend=self._backward,
            engine=engine,
            noise_generator=self._generator(2, self._global_batch_index(batch.index)),
            autocast=self._autocast,
            scale=scale,
            device=self.accelerator.device,
        )
        total = result.total
        if not torch.isfinite(total).item():
            self.nonfinite_guard.flag(f"the NFT loss of micro-batch {batch.index} is {total.item()}")
        else:
            self.nonfinite_guard.observe_loss(total.item() / num_train)
        for key, value in result.sums.items():
            self._metrics[key].append(value.item() / num_train)
        r = advantage_to_r(batch.advantages, self.args.adv_clip_max)
        self._metrics["nft/r_mean"].append(r.mean().item())
        self._metrics["nft/r_clamped_frac"].append(((r <= 0) | (r >= 1)).float().mean().item())
        if engine is not None and batch.last:
            self._finish_engine_step(engine, batch.plan)
        self._step_timer["train"] += time.perf_counter() - start
        return total * scale

    def _engine_for(self, batch: MicroBatch):
        """The per-reward gradient engine on refresh / cosine steps (built on first use), else ``None``."""
        if not batch.plan.needs_engine:
            return None
        if self._gradient_engine is None:
            params = list(self.trainable_parameters().values())
            # Under DeepSpeed the update's gradient is not in .grad: the cosine diagnostics get it as one more row.
            extra_row = int(self.is_deepspeed_enabled and batch.plan.mode == "cosines")
            with gathered(params):  # ZeRO-3: the engine sizes its buffers from the full (gathered) parameters
                self._gradient_engine = make_gradient_engine(
                    self.args.marble_gradient_engine, params, len(self.reward_funcs) + extra_row, self.transformer
                )
        if batch.index == 0:
            self._gradient_engine.reset()
        return self._gradient_engine

    def _finish_engine_step(self, engine, plan: StepPlan) -> None:
        """After the step's last micro-batch: MARBLE's QP and Eq. 7, or the baseline cosines; logs them."""
        start = time.perf_counter()
        result = finish_engine_step(
            engine,
            plan.mode,
            plan.has_signal,
            self._backward,
            self.balancer,
            self._loss_settings.refresh_update,
            bool(self.nonfinite_guard.reasons),
            self.reward_names,
        )
        if result.skipped is not None:
            if result.skipped:  # a reason this process's guard has not recorded yet
                self.nonfinite_guard.flag(result.skipped)
            return  # the step is skipped: no QP, no coefficient update
        if result.refresh is not None:
            self._log_marble(result.refresh)
        else:
            active = plan.has_signal.cpu().numpy()
            for name, c, on in zip(self.reward_names, result.cosines, active):
                self._metrics[f"update_cos/{name}"].append(c if on else math.nan)  # NaN: no signal, not averaged
            self._metrics["update_cos/worst"].append(float(result.cosine_stats["worst_cosine"]))
            self._metrics["update_cos/conflict"].append(float(result.cosine_stats["conflict"]))
        self._metrics["time/balancer"].append(time.perf_counter() - start)

    def _log_marble(self, info: RefreshInfo) -> None:
        for k, name in enumerate(self.reward_names):
            self._metrics[f"marble/alpha/{name}"].append(float(info.alpha_used[k]))
            self._metrics[f"marble/alpha_bar/{name}"].append(float(info.alpha_bar[k]))
            self._metrics[f"marble/grad_norm/{name}"].append(float(info.grad_norms[k]))
            self._metrics[f"marble/cos/{name}"].append(float(info.cosines[k]))
        self._metrics["marble/worst_cos"].append(float(info.worst_cosine))
        self._metrics["marble/mean_cos"].append(float(info.mean_cosine))
        self._metrics["marble/conflict"].append(float(info.conflict))
        self._metrics["marble/qp_time"].append(float(info.qp_time_s))
        self._metrics["marble/qp_fallback"].append(float(info.used_fallback))
        self._metrics["marble/refreshes"].append(float(self.balancer.num_refreshes))

    def _after_optimizer_step(self) -> None:
        step = self.state.global_step  # optimizer steps completed before this one
        self._metrics["nonfinite/skipped_steps"].append(float(self.nonfinite_guard.skipped))
        if self.nonfinite_guard.skipped:  # nothing moved: neither may the old policy nor the EMA
            self._metrics["time/train"].append(self._step_timer.pop("train", 0.0))
            return
        if (step + 1) % self.args.old_policy_update_interval == 0:
            eta = old_policy_decay(step, self.args.old_policy_decay)
            self.old_policy.update(self.transformer, eta)
            self._metrics["old_policy/decay"].append(eta)
        if self.param_ema is not None:
            self.param_ema.update(self.transformer, param_ema_decay(step, self.args.param_ema_max_decay))
        self._metrics["time/train"].append(self._step_timer.pop("train", 0.0))

    # ------------------------------------------------------------------ logging and saving
    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        # Evaluation metrics are logged on their own: the step's training metrics wait for the training log.
        if (self.model.training or "loss" in logs) and not getattr(self, "_logging_eval", False):
            for key, values in self._metrics.items():
                finite = [v for v in values if not math.isnan(v)]
                logs[key] = sum(finite) / len(finite) if finite else float("nan")
            self._metrics.clear()
        order_logs(logs)  # console: loss, reward, rewards/*/mean first (marble_trl.console)
        super().log(logs, start_time)

    def _save(self, output_dir: str | None = None, state_dict=None) -> None:
        """Save the trained LoRA in diffusers format (``pytorch_lora_weights.safetensors`` with adapter metadata),
        loadable with ``StableDiffusion3Pipeline.load_lora_weights``."""
        from peft.utils import get_peft_model_state_dict

        output_dir = output_dir if output_dir is not None else self.args.output_dir
        # ZeRO-3 may partition the LoRA: every process gathers it (DeepSpeed calls _save on all), the main one writes.
        params = self.trainable_parameters()
        with gathered(params.values()):
            layers = get_peft_model_state_dict(self.transformer, adapter_name=TRAIN_ADAPTER)
            layers = {name: tensor.detach().cpu().clone() for name, tensor in layers.items()}
            # DeepSpeed bf16 keeps the float32 weights in its optimizer: save those, not the rounded module copy.
            masters = {name.replace(f".{TRAIN_ADAPTER}.", "."): v for name, v in master_weights(params).items()}
            if set(masters) != set(layers):
                raise RuntimeError(
                    f"peft's LoRA keys {sorted(layers)[:2]} do not match the parameters {sorted(masters)[:2]}."
                )
            layers = {name: value.cpu().clone() for name, value in masters.items()}
        if not self.args.should_save:
            return
        os.makedirs(output_dir, exist_ok=True)
        self.model_adapter.save_lora(output_dir, layers, self.peft_config.to_dict())
        torch.save(self.args, os.path.join(output_dir, TRAINING_ARGS_FILE))
        from ..hub import card_info_from_trainer, write_export_config

        # marble_trl.json: base model and sampler settings, the defaults of `marble-trl generate --lora <folder>`.
        write_export_config(output_dir, card_info_from_trainer(self))

    def create_model_card(self, model_name=None, dataset_name=None, tags=None, **card_fields) -> None:
        """Write a diffusers LoRA model card (README.md) and ``marble_trl.json`` to ``output_dir`` (see
        :mod:`marble_trl.hub`); TRL's card is a language-model card."""
        from ..hub import write_trainer_card

        tags = [tags] if isinstance(tags, str) else tags
        write_trainer_card(self, model_name=model_name, dataset_name=dataset_name, tags=tags, **card_fields)

    # ------------------------------------------------------------------ checkpoints and the Hub
    def train(self, resume_from_checkpoint=None, *args, **kwargs):
        """``transformers.Trainer.train``; SIGTERM / SIGINT write a checkpoint at the next step end and stop. Runs with
        ``torch_num_threads`` CPU threads when set (torch's count is restored afterwards)."""
        with torch_threads(self.args.torch_num_threads), training_session(self, resume_from_checkpoint) as resume:
            return super().train(resume, *args, **kwargs)

    def _save_checkpoint(self, model, trial) -> None:
        base = super()

        def save(model, trial) -> None:
            base._save_checkpoint(model, trial)
            record_best_checkpoint(self, base._get_output_dir(trial))  # the real folder, not the staging one

        save_checkpoint_atomically(self, save, model, trial)

    def _load_best_model(self) -> None:
        # load_best_model_at_end: the Trainer's version looks for a full model file; restore the LoRA adapters.
        load_best_checkpoint(self)

    def _get_output_dir(self, trial) -> str:
        # While a checkpoint is being written, the Trainer writes under the staging folder (see _save_checkpoint).
        return getattr(self, "_checkpoint_staging_root", None) or super()._get_output_dir(trial)

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model=None) -> None:
        load_training_state(self, resume_from_checkpoint)

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        # The restored optimizer / scheduler states carry the old learning rate: apply an allowed new one.
        super()._load_optimizer_and_scheduler(checkpoint)
        if checkpoint is not None:
            apply_changed_hyperparameters(self, checkpoint)

    def init_hf_repo(self, token: str | None = None, private: bool | None = None) -> None:
        from ..hub import init_repo

        init_repo(self, token=token, private=private)

    def push_to_hub(
        self,
        commit_message: str | None = "End of training",
        blocking: bool = True,
        token: str | None = None,
        revision: str | None = None,
        private: bool | None = None,
        **kwargs,
    ):
        """Save the LoRA to ``output_dir`` (``ema=True``: the parameter EMA), render ``num_samples`` sample images
        (or ``sample_prompts``), write the model card and upload ``output_dir`` without checkpoints."""
        from ..hub import push_trainer

        return push_trainer(self, commit_message, blocking, token, revision, private, **kwargs)

    def _push_from_checkpoint(self, checkpoint_folder: str) -> None:
        if getattr(self, "_checkpoint_staging_root", None) is None:  # pushed once the checkpoint is renamed
            from ..hub import push_checkpoint

            push_checkpoint(self, checkpoint_folder)

    @torch.no_grad()
    def generate(
        self, prompts: list[str], seed: int = 0, use_lora: bool = True, num_steps: int | None = None
    ) -> torch.Tensor:
        """Images ``[N, 3, H, W]`` in ``[0, 1]`` for ``prompts`` with the trained LoRA (or the base model when
        ``use_lora=False``), with the rollout solver and a fixed seed (one generator per call, so the same seed gives
        the same noise with and without the LoRA)."""
        args = self.args
        transformer = self.transformer
        was_training = transformer.training
        transformer.eval()
        embeds, negative = self._encode(prompts)
        context = contextlib.nullcontext() if use_lora else use_reference(transformer)
        with context, self._autocast():
            latents = self.model_adapter.sample(
                self.rollout_scheduler,
                embeds,
                num_steps or args.num_sample_steps,
                args.resolution,
                torch.Generator().manual_seed(seed),
                args.guidance_scale,
                negative,
            )
            images = self.model_adapter.decode(latents)
        transformer.train(was_training)
        return images

    # ------------------------------------------------------------------ evaluation
    def evaluate(
        self,
        eval_dataset: Any = None,
        ignore_keys: list[str] | None = None,
        metric_key_prefix: str = "eval",
    ) -> dict[str, float]:
        """Generate ``eval_num_images_per_prompt`` images for every prompt of the eval dataset with the deterministic
        evaluation sampler (``eval_sample_scheduler``, ``eval_num_sample_steps``, ``eval_guidance_scale``; the noise of
        image ``i`` of prompt ``p`` is seeded from ``(eval_seed, p, i)``), with the parameter-EMA weights when
        ``param_ema`` and ``eval_use_param_ema`` are on, and score them with the evaluation rewards.

        Logs and returns ``{prefix}_rewards/{name}/mean`` (and ``std``, ``sem``, ``count``, and per source
        ``{prefix}_rewards/{name}/{source}/mean``), ``{prefix}_composite`` and, from the second evaluation on,
        ``{prefix}_hacking`` (:mod:`marble_trl.best`), ``{prefix}_runtime`` and ``{prefix}_samples``; saves an image grid
        of the first ``eval_grid_prompts`` prompts to ``output_dir/eval/step-{N}.png``. Prompts are sharded over the
        processes and the scores gathered. Training randomness is untouched: a run with evaluations trains exactly as
        one without. A dict of eval datasets is evaluated one by one, with the prefix ``eval_{key}``.
        """
        override = eval_dataset is not None
        dataset = eval_dataset if override else self.eval_dataset
        if isinstance(dataset, dict):
            metrics: dict[str, float] = {}
            for key, ds in dataset.items():
                metrics.update(self.evaluate(ds, ignore_keys, f"{metric_key_prefix}_{key}"))
            return metrics
        if isinstance(dataset, str):  # transformers passes the key of a dict eval_dataset
            dataset = self.eval_dataset[dataset]
        check_prompt_dataset(dataset, name="eval_dataset")
        start = time.time()
        metrics = self._evaluate_dataset(dataset, metric_key_prefix)
        metrics.update(selection_metrics(self, metrics, metric_key_prefix))  # composite, hacking (marble_trl.best)
        metrics[f"{metric_key_prefix}_runtime"] = round(time.time() - start, 4)
        self._logging_eval = True
        try:
            self.log(metrics)
        finally:
            self._logging_eval = False
        self.control = self.callback_handler.on_evaluate(self.args, self.state, self.control, metrics)
        return metrics

    def _evaluate_dataset(self, dataset, prefix: str) -> dict[str, float]:
        args = self.args
        accelerator = self.accelerator
        world, rank = accelerator.num_processes, accelerator.process_index
        n_img = args.eval_num_images_per_prompt
        items = [(p, i) for p in range(len(dataset)) for i in range(n_img)]
        per_process = math.ceil(len(items) / world)
        shard = items[rank::world]
        shard = shard + [shard[-1] if shard else items[0]] * (per_process - len(shard))  # equal work: no rank waits
        shard_real = len(items[rank::world])
        batch = max(1, args.per_device_eval_batch_size)
        grid_n = min(args.eval_grid_prompts, len(dataset))
        extra = [c for c in dataset.column_names if c != "prompt"]
        transformer = self.transformer
        was_training = transformer.training
        cpu_rng = torch.random.get_rng_state()
        cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
        use_ema = self.param_ema is not None and args.eval_use_param_ema
        rows: list[dict[str, Any]] = []
        transformer.eval()
        try:
            with torch.no_grad(), self.param_ema.swapped_in(transformer) if use_ema else contextlib.nullcontext():
                for b in range(0, len(shard), batch):
                    chunk = shard[b : b + batch]
                    records = [dataset[p] for p, _ in chunk]
                    prompts = [r["prompt"] for r in records]
                    with self._autocast():
                        images = generate_eval_images(
                            self.pipeline,
                            self.eval_scheduler,
                            prompts,
                            [sample_seed(args.eval_seed, p, i) for p, i in chunk],
                            num_steps=args.eval_num_sample_steps,
                            resolution=args.resolution,
                            guidance_scale=args.eval_guidance_scale,
                            negative_prompt=args.negative_prompt,
                            max_sequence_length=args.max_sequence_length,
                            device=accelerator.device,
                        )
                    columns = {c: [r.get(c) for r in records] for c in extra}
                    scores = score_rewards(self.eval_reward_funcs, prompts, images, columns, self.eval_reward_names)
                    for j, (p, i) in enumerate(chunk):
                        if b + j >= shard_real:
                            continue  # padding
                        rows.append(
                            {
                                "p": p,
                                "i": i,
                                "scores": scores[:, j].tolist(),
                                "source": columns.get(SOURCE_COLUMN, [None] * len(chunk))[j],
                                "image": images[j].float().cpu() if p < grid_n else None,
                            }
                        )
        finally:
            transformer.train(was_training)
            torch.random.set_rng_state(cpu_rng)
            if cuda_rng is not None:
                torch.cuda.set_rng_state_all(cuda_rng)
        if world > 1:
            rows = gather_object(rows)
        rows = sorted({(r["p"], r["i"]): r for r in rows}.values(), key=lambda r: (r["p"], r["i"]))
        score_rows = [
            {n: (None if math.isnan(v) else v) for n, v in zip(self.eval_reward_names, r["scores"])} for r in rows
        ]
        sources = [r["source"] for r in rows] if SOURCE_COLUMN in dataset.column_names else None
        summary = summarize_scores(self.eval_reward_names, score_rows, sources)
        metrics = {f"{prefix}_rewards/{key}": value for key, value in summary.items()}
        metrics[f"{prefix}_samples"] = float(len(rows))
        grid = [r["image"] for r in rows if r["image"] is not None]
        if grid and self.is_world_process_zero():
            folder = os.path.join(args.output_dir, "eval")
            os.makedirs(folder, exist_ok=True)
            tag = prefix[len("eval_") :] + "-" if prefix.startswith("eval_") else ""
            image = grid_image(
                torch.stack(grid), n_img if n_img > 1 else len(grid), args.resolution,
                prompts=[dataset[r["p"]]["prompt"] for r in rows if r["image"] is not None],
                scores=[score_rows[k] for k, r in enumerate(rows) if r["image"] is not None],
            )  # fmt: skip
            image.save(os.path.join(folder, f"{tag}step-{self.state.global_step}.png"))
            self._log_eval_grid(
                image, f"{prefix.replace('_', '/', 1) if prefix.startswith('eval_') else prefix}/images"
            )
        return metrics

    def _log_eval_grid(self, image, tag: str) -> None:
        """Send the evaluation grid to the TensorBoard / wandb / Trackio runs of ``report_to`` (the Trainer's
        callbacks of those types, subclasses included; see :mod:`marble_trl.trackers`)."""
        log_image(self.callback_handler.callbacks, tag, image, self.state.global_step)

    def _log_rollout_samples(
        self, prompts: list[str], images: torch.Tensor, rewards: torch.Tensor, groups: torch.Tensor
    ) -> None:
        """``log_samples``: every that many optimizer steps, a captioned grid of this process's rollouts of the step
        (prompts, per-image rewards) to ``output_dir/rollouts/step-{N}.png`` and to the trackers as ``train/samples``
        (main process only)."""
        every = self.args.log_samples
        step = self.state.global_step + 1  # the optimizer step these rollouts train
        if not every or step % every or not self.is_world_process_zero():
            return
        grid, caption = rollout_grid(
            images, prompts, rewards, self.reward_names, groups.tolist(), title=f"step {step}: rollouts"
        )
        folder = os.path.join(self.args.output_dir, "rollouts")
        os.makedirs(folder, exist_ok=True)
        grid.save(os.path.join(folder, f"step-{step}.png"))
        log_image(self.callback_handler.callbacks, "train/samples", grid, step, caption=caption)

    def trainable_parameters(self) -> dict[str, torch.nn.Parameter]:
        """The trainable LoRA parameters by name."""
        return lora_parameters(self.transformer, TRAIN_ADAPTER)
