"""The trainer's rollouts and rewards (a mixin of :class:`~marble_trl.trainer.MarbleDiffusionNFTTrainer`): the
``transformers.Trainer`` hook ``get_batch_samples`` receives one optimizer step's micro-batches of prompts at once, runs
the whole step's rollouts with the old policy, scores and gathers the rewards, plans the step (:mod:`.step`) and opens
its :class:`~.session.StepSession`."""

from __future__ import annotations

import time
from typing import Any

import torch

from ..balance import MarbleBalancer
from ..balance.advantages import collate_advantages
from ..data.source_images import SOURCE_IMAGES_COLUMN
from ..data.sources import SOURCE_COLUMN
from ..distributed import num_train_timesteps
from ..models import Conditioning
from ..models.editing import beside
from ..policy.switch import use_old_weights
from ..rewards import RewardLogs, score_rewards
from .metrics import flush_reward_logs, reward_metrics, save_rollout_grid
from .session import StepSession
from .step import (
    MicroBatch,
    encode_prompts_and_negative,
    gather_rewards,
    make_micro_batches,
    plan_step,
    rollouts,
    run_together,
)
from .trackers import log_image


class RolloutHooks:
    """``get_batch_samples`` and what it runs: rollouts, rewards, advantages, the step's plan and session."""

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

    def _generate_and_score(self, batches: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
        args = self.args
        device = self.accelerator.device
        samples = [s for batch in batches for s in batch]
        prompts = [s["prompt"] for s in samples]
        columns = {key: [s.get(key) for s in samples] for key in samples[0] if key != "prompt"}
        micro = len(batches[0])
        sources = self._source_pixels(columns)  # an editing model's source images

        start = time.perf_counter()
        embeds, negative = self._encode(prompts, sources)
        with use_old_weights(self.transformer), self._autocast():
            x0_all, images_all = rollouts(
                self.model_adapter,
                self.rollout_scheduler,
                embeds,
                negative,
                micro,
                len(batches),
                args,
                lambda m: self._generator(0, self._global_batch_index(m)),
            )
        rollout_time = time.perf_counter() - start
        if sources is not None:  # the rewards receive each edit's source beside it, pixel for pixel
            columns[SOURCE_IMAGES_COLUMN] = beside(sources, images_all)
        if not torch.isfinite(x0_all).all():
            raise FloatingPointError(
                f"Step {self.state.global_step}: the rollouts' latents contain NaN/inf, so every image and reward would "
                "be NaN. The old-policy adapter or the base model has non-finite weights (a corrupt checkpoint or "
                "model file?), or the rollout overflowed in half precision; check the model and the last checkpoint."
            )

        start = time.perf_counter()
        timings: dict[str, float] = {}
        reward_logs = RewardLogs()  # GRPO's trainer_state / log_extra / log_metric kwargs
        rewards_local = run_together(  # a reward failing on one process stops every process here
            self.accelerator,
            "scoring the rewards",
            lambda: score_rewards(
                self.reward_funcs, prompts, images_all, columns, self.reward_names, timings,
                trainer_state=self.state, logs=reward_logs,
            ),
        )  # fmt: skip
        reward_time = time.perf_counter() - start
        logged, self.reward_extras = flush_reward_logs(self.accelerator, reward_logs, len(prompts))
        self._append_metrics(logged)
        for name, seconds in timings.items():
            self._metrics[f"rewards/{name}/time"].append(seconds)

        gathered_rewards = gather_rewards(
            self.accelerator, rewards_local, prompts, micro, args.num_generations, columns.get(SOURCE_COLUMN)
        )
        adv = collate_advantages(
            gathered_rewards.rewards, args.num_generations, args.scale_rewards, self.reward_weights, self.aggregation
        )
        self._append_metrics(
            reward_metrics(
                gathered_rewards.rewards,
                self.reward_names,
                self.reward_weights,
                args.num_generations,
                gathered_rewards.sources,
            )
        )
        local_positions = gathered_rewards.local_positions
        self._log_rollout_samples(prompts, images_all, rewards_local, local_positions // args.num_generations)
        self._metrics["time/rollout"].append(rollout_time)
        self._metrics["time/reward"].append(reward_time)

        paper = isinstance(self.balancer, MarbleBalancer)
        plan = plan_step(
            adv.per_reward,
            adv.combined,
            self.balancer,
            self.state.global_step,
            log_update_cosines=self._update_cosines_this_step,
            adv_clip_max=args.adv_clip_max,
            solve_first=args.marble_refresh_update == "gradient"
            and (args.marble_refresh_subset > 0 or self.backend.owns_gradients),
        )
        if paper:
            self._metrics["marble/clamp_violations"].append(float(self.balancer.num_clamp_violations))
        return self.start_step(
            make_micro_batches(
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
                applicable=~torch.isnan(gathered_rewards.rewards),
            )
        )

    def start_step(self, batches: list[MicroBatch]) -> list[MicroBatch]:
        """Open the optimizer step's :class:`~marble_trl.trainer.session.StepSession` on its micro-batches, and return
        them: the Trainer hands each back to ``training_step``, which asks the session for the one to train."""
        self.session = StepSession(batches, self.balancer)
        return list(self.session.batches)

    def _encode(
        self, prompts: list[str], source_images: torch.Tensor | None = None
    ) -> tuple[Conditioning, Conditioning | None]:
        return encode_prompts_and_negative(
            self.model_adapter, prompts, self.args, self.accelerator.device, source_images
        )

    def _source_pixels(self, columns: dict[str, list[Any]]) -> torch.Tensor | None:
        """An editing model's rows' source images as ``[B, 3, S, S]`` in ``[0, 1]`` (``S``: the model's source
        resolution); ``None`` for a text-to-image model."""
        if self.source_images is None:
            return None
        return self.source_images(columns[SOURCE_IMAGES_COLUMN])

    def _append_metrics(self, metrics: dict[str, float]) -> None:
        for key, value in metrics.items():
            self._metrics[key].append(value)

    def _log_rollout_samples(self, prompts, images, rewards, groups) -> None:
        """``log_samples``: every that many optimizer steps, a captioned grid of this process's rollouts (main process
        only; :func:`~marble_trl.trainer.metrics.save_rollout_grid`)."""
        every = self.args.log_samples
        step = self.state.global_step + 1  # the optimizer step these rollouts train
        if every and not step % every and self.is_world_process_zero():
            grid, caption, video = save_rollout_grid(
                images, prompts, rewards, self.reward_names, groups, step, self.args.output_dir
            )
            log_image(self.callback_handler.callbacks, "train/samples", grid, step, caption=caption, video=video)
