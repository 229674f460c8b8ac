"""The trainer's evaluation: images for every (prompt, image index) of an eval dataset with the deterministic
evaluation sampler, sharded over the processes, scored with the evaluation rewards, summarised into metrics.

Training randomness is untouched (the torch RNG states are restored), so a run with evaluations trains exactly as one
without; the noise of image ``i`` of prompt ``p`` is seeded from ``(eval_seed, p, i)`` alone.
"""

from __future__ import annotations

import contextlib
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from accelerate.utils import gather_object

from ..data.prompts import check_prompt_dataset
from ..data.source_images import SOURCE_IMAGES_COLUMN, SourceImageLoader
from ..data.sources import SOURCE_COLUMN
from ..evaluation.images import generate_eval_images, grid_image, sample_seed
from ..evaluation.results import summarize_scores
from ..models.editing import beside, repeat_sources
from ..persistence.best import selection_metrics
from ..policy.lora import LoraEMA
from ..policy.switch import use_reference_weights
from ..rewards import RewardFunc, score_rewards
from .setup import check_editing_data
from .trackers import log_image


@dataclass
class EvalResult:
    metrics: dict[str, float]  # {prefix}_rewards/{key} and {prefix}_samples
    grid: Any  # the PIL grid of the first eval_grid_prompts prompts (main process), or None


def evaluate_dataset(
    dataset,
    prefix: str,
    *,
    args,
    pipeline,
    scheduler,
    transformer: torch.nn.Module,
    accelerator,
    reward_funcs: list[RewardFunc],
    reward_names: list[str],
    param_ema: LoraEMA | None,
    autocast: Callable[[], contextlib.AbstractContextManager],
    source_images: SourceImageLoader | None = None,
) -> EvalResult:
    """Score ``args.eval_num_images_per_prompt`` images of every prompt of ``dataset`` (see the module docstring),
    with the parameter-EMA weights swapped in when ``param_ema`` is given and ``args.eval_use_param_ema`` is on."""
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
    was_training = transformer.training
    cpu_rng = torch.random.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    use_ema = param_ema is not None and args.eval_use_param_ema
    rows: list[dict[str, Any]] = []
    transformer.eval()
    try:
        with torch.no_grad(), param_ema.swapped_in(transformer) if use_ema else contextlib.nullcontext():
            for b in range(0, len(shard), batch):
                chunk = shard[b : b + batch]
                records = [dataset[p] for p, _ in chunk]
                prompts = [r["prompt"] for r in records]
                columns = {c: [r.get(c) for r in records] for c in extra}
                sources = None
                if source_images is not None:  # an editing model: the rewards get the pixels it edited
                    sources = source_images(columns[SOURCE_IMAGES_COLUMN])
                with autocast():
                    images = generate_eval_images(
                        pipeline,
                        scheduler,
                        prompts,
                        [sample_seed(args.eval_seed, p, i) for p, i in chunk],
                        num_steps=args.eval_num_sample_steps,
                        resolution=args.resolution,
                        guidance_scale=args.eval_guidance_scale,
                        negative_prompt=args.negative_prompt,
                        max_sequence_length=args.max_sequence_length,
                        device=accelerator.device,
                        source_images=sources,
                    )
                if sources is not None:
                    columns[SOURCE_IMAGES_COLUMN] = beside(sources, images)
                scores = score_rewards(reward_funcs, prompts, images, columns, reward_names)
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
    score_rows = [{n: (None if math.isnan(v) else v) for n, v in zip(reward_names, r["scores"])} for r in rows]
    sources = [r["source"] for r in rows] if SOURCE_COLUMN in dataset.column_names else None
    summary = summarize_scores(reward_names, score_rows, sources)
    metrics = {f"{prefix}_rewards/{key}": value for key, value in summary.items()}
    metrics[f"{prefix}_samples"] = float(len(rows))
    grid = [r["image"] for r in rows if r["image"] is not None]
    image = None
    if grid and accelerator.is_main_process:
        image = grid_image(
            torch.stack(grid), n_img if n_img > 1 else len(grid), args.resolution,
            prompts=[dataset[r["p"]]["prompt"] for r in rows if r["image"] is not None],
            scores=[score_rows[k] for k, r in enumerate(rows) if r["image"] is not None],
        )  # fmt: skip
    return EvalResult(metrics, image)


def save_eval_grid(image, output_dir: str, prefix: str, step: int) -> str:
    """``output_dir/eval/[{key}-]step-{N}.png``; returns the tracker tag (``eval/images``, ``eval/{key}/images``)."""
    folder = os.path.join(output_dir, "eval")
    os.makedirs(folder, exist_ok=True)
    tag = prefix[len("eval_") :] + "-" if prefix.startswith("eval_") else ""
    image.save(os.path.join(folder, f"{tag}step-{step}.png"))
    return f"{prefix.replace('_', '/', 1) if prefix.startswith('eval_') else prefix}/images"


class EvaluationHooks:
    """``generate`` and ``evaluate`` for the trainer (mixed in before TRL's trainer base)."""

    @torch.no_grad()
    def generate(
        self,
        prompts: list[str],
        seed: int = 0,
        use_lora: bool = True,
        num_steps: int | None = None,
        source_images: Any = None,
    ) -> torch.Tensor:
        """Images ``[N, 3, H, W]`` in ``[0, 1]`` for ``prompts`` with the trained LoRA (or the base model when
        ``use_lora=False``), with the rollout solver and a fixed seed (one generator per call, so the same seed gives
        the same noise with and without the LoRA). An editing model edits ``source_images``: one per prompt (or one for
        every prompt), as a ``source_images`` column holds them (paths, PIL images, ...) or as a ``[N, 3, H, W]``
        tensor in ``[0, 1]``."""
        args = self.args
        transformer = self.transformer
        was_training = transformer.training
        transformer.eval()
        sources = None
        if self.source_images is not None:
            if source_images is None:
                raise ValueError(
                    "generate: this model edits images; pass source_images= (one per prompt: paths, PIL images or a "
                    "[N, 3, H, W] tensor in [0, 1])."
                )
            sources = repeat_sources(self.source_images(source_images), len(prompts))
        elif source_images is not None:
            raise ValueError("generate: source_images= is for editing models; this one generates from text alone.")
        embeds, negative = self._encode(prompts, sources)
        context = contextlib.nullcontext() if use_lora else use_reference_weights(transformer)
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
        ``{prefix}_hacking`` (:mod:`marble_trl.persistence.best`), ``{prefix}_runtime`` and ``{prefix}_samples``; saves an image grid
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
        if override:  # the trainer's own eval datasets were checked when it was built
            check_editing_data(self.model_adapter, dataset, "eval_dataset")
        start = time.time()
        metrics = self._evaluate_dataset(dataset, metric_key_prefix)
        metrics.update(
            selection_metrics(
                metrics,
                metric_key_prefix,
                self.state.log_history,
                self.state.global_step,
                self.reward_names,
                self.eval_reward_names,
            )
        )  # composite, hacking (marble_trl.persistence.best)
        metrics[f"{metric_key_prefix}_runtime"] = round(time.time() - start, 4)
        self.log_metrics_only(metrics)  # the step's training metrics wait for the training log
        self.control = self.callback_handler.on_evaluate(self.args, self.state, self.control, metrics)
        return metrics

    def _evaluate_dataset(self, dataset, prefix: str) -> dict[str, float]:
        result = evaluate_dataset(
            dataset,
            prefix,
            args=self.args,
            pipeline=self.pipeline,
            scheduler=self.eval_scheduler,
            transformer=self.transformer,
            accelerator=self.accelerator,
            reward_funcs=self.eval_reward_funcs,
            reward_names=self.eval_reward_names,
            param_ema=self.param_ema,
            autocast=self._autocast,
            source_images=self.source_images,
        )
        if result.grid is not None:
            tag = save_eval_grid(result.grid, self.args.output_dir, prefix, self.state.global_step)
            self._log_eval_grid(result.grid, tag)
        return result.metrics

    def _log_eval_grid(self, image, tag: str) -> None:
        """Send the evaluation grid to the TensorBoard / wandb / Trackio runs of ``report_to`` (the Trainer's
        callbacks of those types, subclasses included; see :mod:`marble_trl.trainer.trackers`)."""
        log_image(self.callback_handler.callbacks, tag, image, self.state.global_step)
