"""``MarbleDiffusionNFTTrainer``: DiffusionNFT online RL for flow-matching models (SD3 / SD3.5, FLUX.1, Wan, ...) with
LoRA, on TRL's trainer base.

DiffusionNFT: "Online Diffusion Reinforcement with Forward Process", Zheng et al., arXiv 2509.16117 (ICLR 2026).
MARBLE: "Multi-Aspect Reward Balance for Diffusion RL", arXiv 2605.06507 (2026).

It is a :class:`transformers.Trainer` (through TRL's base), so logging, ``report_to``, callbacks, progress bars and
``save_steps`` behave as usual. One optimizer step is:

1. rollouts of ``G`` images (videos) per prompt with the old-policy adapter (CFG-free by default);
2. rewards, gathered over processes, and group advantages (:mod:`marble_trl.balance.advantages`);
3. the NFT loss on the forward process for every (micro-batch, training timestep), accumulated into one step
   (:mod:`.step` plans the step, :mod:`.backward` runs it; the model is reached only through its family adapter,
   :mod:`marble_trl.models`);
4. the optimizer step, then the old-policy soft update.

The ``transformers.Trainer`` hooks overridden, and why:

- ``get_batch_samples``: it receives the micro-batches of one optimizer step at once; the rollouts and rewards of the
  whole step run there (step 1-2), and it returns the micro-batches of rollout data (:class:`~.rollouts.RolloutHooks`);
- ``training_step``: the NFT loss over the sampler's timesteps (step 3);
- ``_get_train_sampler``: whole groups, whole steps (:class:`~marble_trl.data.prompts.GroupSampler`);
- ``log``: adds the averaged rollout/reward/NFT metrics;
- ``_send_telemetry``: TRL's reads ``model.config.model_type``, which diffusers models lack;
- saving, checkpoints, resume, the best model and the Hub: :class:`~.persistence.PersistenceHooks`;
  ``evaluate`` and ``generate``: :class:`~.evaluate.EvaluationHooks`; the per-reward gradients and MARBLE's
  refreshes around ``training_step``: :class:`~.balancing.BalancingHooks` (all mixed in).

Rollouts and training share the reference's grid: the training timesteps are the Euler sigma grid of the pipeline's
shift with ``num_sample_steps`` points, and the default ``dpm2`` rollout solver is the reference's 2nd-order DPM-Solver
evaluated at exactly those sigmas (:mod:`marble_trl.rollout.dpm_solver`). Deviations from the reference code
(``docs/nft-loss.md`` lists them all): rollout timesteps are not rounded to integers; the old-policy and EMA decays
use the 0-based index of the step just taken; the LoRA is float32 and the base model may be bf16 (the reference
keeps the whole transformer in float32 under autocast); advantages use population stds as the reference does (TRL's
GRPO uses unbiased ones).
"""

from __future__ import annotations

import contextlib
import math
import time
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

import torch
from transformers import TrainerCallback, set_seed

from .._trl import BaseTrainer
from ..data.prompts import GroupSampler
from ..distributed import (
    check_frozen_models_not_partitioned,
    disable_zero3_init,
)
from ..models import adapter_for, load_model
from ..models.prompt_cache import build_prompt_cache, dataset_prompts, offload_text_encoders
from ..nft_config import MarbleDiffusionNFTConfig
from ..persistence.best import RewardHackingCallback
from ..persistence.checkpoint import SamplerEpochCallback
from ..policy.full import FullEMA, FullPolicy
from ..policy.lora import TRAIN_ADAPTER, LoraEMA, OldPolicy, add_policy_adapters, lora_parameters
from ..policy.nft import advantage_to_r, old_policy_decay, param_ema_decay
from ..rewards import RewardFunc, check_reward_funcs
from ..rollout.solvers import make_scheduler
from ..seeding import keyed_generator
from .backends import LossSettings, make_backend
from .backward import micro_batch_loss
from .balancing import BalancingHooks
from .console import order_logs, use_compact_console
from .evaluate import EvaluationHooks
from .guards import NonFiniteGuard
from .interruptions import SaveOnSignalCallback
from .persistence import PersistenceHooks
from .rollouts import RolloutHooks
from .session import StepHooks, StepSession
from .setup import (
    check_full_finetuning_backend,
    check_inputs,
    check_resolution,
    check_unreached_parameters,
    eval_datasets,
    eval_rewards,
    family_rewards,
    frozen_components,
    full_policy,
    group_sampler,
    lora_config,
    make_balancer,
    resolve_aggregation,
    source_image_loader,
    training_rewards,
)
from .step import (
    MicroBatch,
    global_batch_index,
)
from .trackers import adapt_model_config


def _identity_collator(features: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return features


class MarbleDiffusionNFTTrainer(RolloutHooks, PersistenceHooks, EvaluationHooks, BalancingHooks, BaseTrainer):
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
        check_inputs(train_dataset, eval_dataset, reward_funcs, args)  # before the model loads
        train_columns = getattr(train_dataset, "column_names", None)
        # Seed before the LoRA is initialised (transformers.Trainer seeds only in its own __init__, after that).
        set_seed(args.seed)
        disable_zero3_init()  # ZeRO-3: no frozen model (reward models load lazily) may be built partitioned

        # The model family's adapter (marble_trl.models): the trainer talks to the model only through it.
        self.model_adapter = adapter_for(model) if hasattr(model, "transformer") else load_model(model)
        self.pipeline = self.model_adapter.pipeline
        check_frozen_models_not_partitioned(self.pipeline)
        self.model_name_or_path = None if hasattr(model, "transformer") else str(model)  # the card's base model
        self.pipeline.set_progress_bar_config(disable=True)
        for component in frozen_components(self.pipeline):
            component.requires_grad_(False).eval()
        check_resolution(args.resolution, self.model_adapter.latent_factor)
        # an editing model's source images: every row's checked now (marble_trl.data.source_images)
        self.source_images = source_image_loader(self.model_adapter, args, train_dataset, eval_dataset)
        transformer = self.model_adapter.transformer

        self.full_policy: FullPolicy | None = None  # use_peft=False: the trained weights' old policy and reference
        if args.use_peft:
            self.peft_config = peft_config = lora_config(args, peft_config, self.model_adapter.default_lora_targets)
            add_policy_adapters(transformer, peft_config)
        else:
            self.peft_config, self.full_policy = None, full_policy(args, peft_config, transformer)
        check_unreached_parameters(args, self.model_adapter, transformer, self._trainable(transformer))
        # diffusers models have `enable_gradient_checkpointing`; Trainer calls `activation_checkpointing_enable`.
        transformer.activation_checkpointing_enable = lambda **_: transformer.enable_gradient_checkpointing()
        adapt_model_config(transformer)  # report_to callbacks read model.config as a transformers config

        self.reward_funcs, self.reward_names, self.reward_weights = training_rewards(reward_funcs, args, train_columns)
        self.aggregation = resolve_aggregation(args.multi_objective_aggregation, len(self.reward_funcs))
        self.eval_reward_funcs, self.eval_reward_names = eval_rewards(
            eval_reward_funcs, args, self.reward_funcs, self.reward_names
        )
        for columns in [getattr(d, "column_names", None) for _, d in eval_datasets(eval_dataset)] or [None]:
            check_reward_funcs(self.eval_reward_funcs, self.eval_reward_names, columns)
        funcs = family_rewards(self.model_adapter, args, self.reward_funcs, self.eval_reward_funcs)  # video: lifted
        self.reward_funcs, self.eval_reward_funcs = funcs
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
        for component in frozen_components(self.pipeline):
            component.to(self.accelerator.device)
        if args.cache_prompt_embeddings:  # every prompt encoded now; the text encoders leave the accelerator
            prompts = dataset_prompts(train_dataset, eval_dataset)
            build_prompt_cache(self.model_adapter, prompts, args, self.accelerator.device)
        elif args.offload_text_encoders:
            # They visit the accelerator for each encoding (marble_trl.models.prompt_cache).
            offload_text_encoders(self.pipeline, "cpu")
            self.model_adapter.text_encoders_offloaded = True
        self.rollout_scheduler = make_scheduler(args.sample_scheduler, self.pipeline.scheduler)
        self.train_sigmas = self.model_adapter.training_grid(args.num_sample_steps, args.resolution)
        self.eval_scheduler = make_scheduler(args.eval_sample_scheduler, self.pipeline.scheduler)
        # plain / DDP, DeepSpeed or FSDP2: the trainer asks its back-end's capabilities, never the launcher
        self.backend = make_backend(self.accelerator)
        self.backend.configure(args, len(self.train_sigmas))
        self._loss_settings = LossSettings(
            args.nft_beta, args.beta, args.adv_clip_max, args.marble_refresh_update, args.marble_masked_solve
        )
        check_full_finetuning_backend(args, self.backend, self.aggregation)
        if self.full_policy is not None:
            self.full_policy.release = self.backend.release_gathered  # ZeRO-3: before swapping partitions
        self.param_ema = (LoraEMA if args.use_peft else FullEMA)(transformer) if args.param_ema else None
        self.old_policy = OldPolicy() if self.full_policy is None else self.full_policy
        self.balancer = make_balancer(self.aggregation, args, self.reward_names)  # MARBLE's, or another weighting
        self._gradient_engine = None
        self.nonfinite_guard = NonFiniteGuard(self, args.max_nonfinite_skips)
        self.add_callback(self.nonfinite_guard)
        self.add_callback(StepHooks(self))
        self.session: StepSession | None = None  # the optimizer step in progress (start_step)
        self._checkpoint_staging_root: str | None = None
        self.emergency_checkpoint: str | None = None  # set when train() raised and a checkpoint was written
        self.add_callback(SaveOnSignalCallback(self))
        self.add_callback(SamplerEpochCallback())
        if args.hacking_patience:
            self.add_callback(RewardHackingCallback(args.hacking_patience))
        if args.console_format == "compact":
            use_compact_console(self)

    # ------------------------------------------------------------------ setup helpers
    def _send_telemetry(self) -> None:
        # TRL's telemetry reads `model.config.model_type`, which diffusers models do not have (it would crash every
        # run outside CI). This trainer is not one of TRL's, so it sends nothing.
        return

    def _get_train_sampler(self, train_dataset=None) -> GroupSampler:
        return group_sampler(train_dataset if train_dataset is not None else self.train_dataset, self.args)

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

    # ------------------------------------------------------------------ autocast
    def _autocast(self):
        return self.accelerator.autocast() if self.args.bf16 or self.args.fp16 else contextlib.nullcontext()

    # ------------------------------------------------------------------ the NFT loss
    def _prepare_for_training(self, *args, **kwargs):
        self.backend.before_prepare(self.transformer)  # FSDP2: the LoRA layers outside the blocks become units
        return super()._prepare_for_training(*args, **kwargs)

    def training_step(self, model, inputs: MicroBatch, num_items_in_batch=None) -> torch.Tensor:
        """The NFT loss of one micro-batch, summed over its training timesteps (each a forward/backward:
        :func:`~marble_trl.trainer.backward.micro_batch_loss`); after the step's last micro-batch, MARBLE's refresh or
        the cosine diagnostic."""
        start = time.perf_counter()
        model.train()
        if self.session is None:
            raise RuntimeError("training_step needs the step's session: get_batch_samples (or start_step) opens it.")
        batch = self.session.batch_for(inputs)
        if batch.plan.mode == "pairwise":
            return self._pairwise_step(model, batch, start)
        if batch.plan.mode == "solve_first":
            self._solve_first(batch)  # re-plans the step's micro-batches (the session swaps them in)
            batch = self.session.batch(batch.index)
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
            backend=self.backend,
            engine=engine,
            noise_generator=self._generator(2, self._global_batch_index(batch.index)),
            autocast=self._autocast,
            scale=scale,
            device=self.accelerator.device,
        )
        self._observe(result, batch, num_train)
        r = advantage_to_r(batch.advantages, self.args.adv_clip_max)
        self._metrics["nft/r_mean"].append(r.mean().item())
        self._metrics["nft/r_clamped_frac"].append(((r <= 0) | (r >= 1)).float().mean().item())
        if engine is not None and batch.last:
            self._finish_engine_step(engine, batch.plan)
        self._step_timer["train"] += time.perf_counter() - start
        return result.total * scale

    def _observe(self, result, batch: MicroBatch, num_train: int) -> None:
        """The micro-batch's loss to the non-finite guard, its per-timestep sums to the metrics."""
        total = result.total
        if not torch.isfinite(total).item():
            self.nonfinite_guard.flag(f"the NFT loss of micro-batch {batch.index} is {total.item()}")
        else:
            self.nonfinite_guard.observe_loss(total.item() / num_train)
        for key, value in result.sums.items():
            self._metrics[key].append(value.item() / num_train)

    def _after_optimizer_step(self) -> None:
        step = self.state.global_step  # optimizer steps completed before this one
        self._metrics["nonfinite/skipped_steps"].append(float(self.nonfinite_guard.skipped))
        if self.session is not None:
            self.session.end(self.nonfinite_guard.skipped)  # a skipped step takes back its refresh
            self.session = None  # the step's rollouts and conditioning: not kept into the next step's rollouts
        if self.nonfinite_guard.skipped:  # nothing moved: neither may the old policy nor the EMA
            self._metrics["time/train"].append(self._step_timer.pop("train", 0.0))
            return
        if (step + 1) % self.args.old_policy_update_interval == 0:
            eta = old_policy_decay(step, self.args.old_policy_decay)
            self.old_policy.update(self.transformer, eta)
            self._metrics["old_policy/decay"].append(eta)
        if self.param_ema is not None:
            s = step + self.args.param_ema_first_step
            self.param_ema.update(self.transformer, param_ema_decay(s, self.args.param_ema_max_decay))
        self._metrics["time/train"].append(self._step_timer.pop("train", 0.0))

    # ------------------------------------------------------------------ logging and saving
    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        """transformers' ``log``, with the step's collected metrics (means since the last log) added to a training
        log."""
        self._log(logs, start_time, with_training_metrics=self.model.training or "loss" in logs)

    def log_metrics_only(self, logs: dict[str, float]) -> None:
        """Log ``logs`` (evaluation metrics) without the step's training metrics, which wait for the training log."""
        self._log(logs, None, with_training_metrics=False)

    def _log(self, logs: dict[str, float], start_time: float | None, *, with_training_metrics: bool) -> None:
        if with_training_metrics:
            for key, values in self._metrics.items():
                finite = [v for v in values if not math.isnan(v)]
                logs[key] = sum(finite) / len(finite) if finite else float("nan")
            self._metrics.clear()
        order_logs(logs)  # console: loss, reward, rewards/*/mean first (marble_trl.trainer.console)
        super().log(logs, start_time)

    @property
    def shards_transformer(self) -> bool:
        """FSDP2 or DeepSpeed ZeRO-3: each forward of the transformer gathers its weights from every process, so every
        process must run it (the CLI's sample grids and the Hub samples are drawn everywhere, saved by the main one)."""
        return self.backend.shards_transformer

    def trainable_parameters(self) -> dict[str, torch.nn.Parameter]:
        """The trained parameters by name: the LoRA adapter's, or the transformer's own under full fine-tuning."""
        return self._trainable(self.transformer)

    def _trainable(self, transformer: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
        if self.full_policy is not None:
            return self.full_policy.trainable(transformer)
        return lora_parameters(transformer, TRAIN_ADAPTER)
