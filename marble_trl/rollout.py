"""Rollouts: sampling clean latents with a black-box diffusers ODE solver, and decoding them for the rewards.

DiffusionNFT needs only the final clean latents ``x0`` of each rollout (no trajectory, no log-probabilities), so any
diffusers flow scheduler works; sampling goes through the pipeline's own ``__call__`` with precomputed prompt
embeddings and ``output_type="latent"``. The default ``dpm2`` is the reference's solver, which evaluates the model at
the training grid's sigmas (:mod:`marble_trl.dpm_solver`); ``euler`` does too; ``heun`` and ``dpm2_diffusers``
(diffusers' ``DPMSolverMultistepScheduler``) evaluate it elsewhere.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch

from .nft_config import SAMPLER_ALIASES


def make_scheduler(name: str, base_scheduler):
    """Build the rollout scheduler ``name`` from the pipeline's scheduler config (keeps its ``shift``)."""
    import diffusers

    config = base_scheduler.config
    if name == "pipeline":
        return copy.deepcopy(base_scheduler)
    if name == "euler":
        return diffusers.FlowMatchEulerDiscreteScheduler.from_config(config)
    if name == "heun":
        return diffusers.FlowMatchHeunDiscreteScheduler.from_config(config)
    if name == "dpm2":  # the reference's solver on the pipeline's Euler grid (marble_trl.dpm_solver)
        from .dpm_solver import FlowMatchDPMSolver2Scheduler

        return FlowMatchDPMSolver2Scheduler.from_config(config)
    if name == "dpm2_diffusers":  # diffusers' own DPM-Solver grid, which differs from the training grid
        return diffusers.DPMSolverMultistepScheduler(
            num_train_timesteps=config.get("num_train_timesteps", 1000),
            solver_order=2,
            prediction_type="flow_prediction",
            use_flow_sigmas=True,
            flow_shift=config.get("shift", 1.0),
        )
    cls = getattr(diffusers, name, None)
    if cls is None or not hasattr(cls, "from_config"):
        raise ValueError(
            f"sample_scheduler {name!r} is neither one of {SAMPLER_ALIASES + ('pipeline',)} nor a diffusers "
            "scheduler class name."
        )
    return cls.from_config(config)


def training_sigmas(base_scheduler, num_steps: int) -> torch.Tensor:
    """The sampler's sigma grid that DiffusionNFT trains on: ``num_steps`` flow times of the Euler grid with the
    pipeline's shift (the final ``sigma = 0`` excluded)."""
    import diffusers

    sched = diffusers.FlowMatchEulerDiscreteScheduler.from_config(base_scheduler.config)
    kwargs = {}
    if sched.config.get("use_dynamic_shifting", False):
        kwargs["mu"] = 0.0  # [choice] neutral shift: SD3/3.5 configs do not use dynamic shifting
    sched.set_timesteps(num_steps, **kwargs)
    return sched.sigmas[:num_steps].float().clone()


@dataclass
class PromptEmbeddings:
    prompt_embeds: torch.Tensor  # [B, tokens, joint_attention_dim]
    pooled: torch.Tensor  # [B, pooled_projection_dim]

    def index(self, idx: torch.Tensor | list[int]) -> PromptEmbeddings:
        return PromptEmbeddings(self.prompt_embeds[idx], self.pooled[idx])


@torch.no_grad()
def encode_prompts(pipeline, prompts: list[str], max_sequence_length: int, device: torch.device) -> PromptEmbeddings:
    """Encode each distinct prompt once and expand back to ``prompts`` (groups repeat a prompt G times)."""
    unique = list(dict.fromkeys(prompts))
    embeds, _, pooled, _ = pipeline.encode_prompt(
        prompt=unique,
        prompt_2=None,
        prompt_3=None,
        device=device,
        num_images_per_prompt=1,
        do_classifier_free_guidance=False,
        max_sequence_length=max_sequence_length,
    )
    where = {p: i for i, p in enumerate(unique)}
    idx = torch.tensor([where[p] for p in prompts], device=embeds.device)
    return PromptEmbeddings(embeds[idx], pooled[idx])


@torch.no_grad()
def sample_latents(
    pipeline,
    scheduler,
    embeddings: PromptEmbeddings,
    num_steps: int,
    resolution: int,
    generator: torch.Generator,
    guidance_scale: float = 1.0,
    negative: PromptEmbeddings | None = None,
) -> torch.Tensor:
    """Run the ODE solver from fresh noise and return the clean latents ``x0`` (transformer space)."""
    original = pipeline.scheduler
    pipeline.scheduler = scheduler
    try:
        kwargs = {}
        if guidance_scale > 1.0:
            if negative is None:
                raise ValueError("guidance_scale > 1 needs negative prompt embeddings.")
            kwargs = dict(negative_prompt_embeds=negative.prompt_embeds, negative_pooled_prompt_embeds=negative.pooled)
        out = pipeline(
            prompt_embeds=embeddings.prompt_embeds,
            pooled_prompt_embeds=embeddings.pooled,
            num_inference_steps=num_steps,
            guidance_scale=guidance_scale,
            height=resolution,
            width=resolution,
            generator=generator,
            output_type="latent",
            return_dict=True,
            **kwargs,
        )
    finally:
        pipeline.scheduler = original
    return out.images


@torch.no_grad()
def decode_latents(pipeline, latents: torch.Tensor) -> torch.Tensor:
    """Clean latents -> images ``[B, 3, H, W]`` in ``[0, 1]`` (float32), the reward input format."""
    vae = pipeline.vae
    scaled = latents.to(vae.dtype) / vae.config.scaling_factor + vae.config.get("shift_factor", 0.0)
    images = vae.decode(scaled, return_dict=False)[0]
    return (images.float() / 2 + 0.5).clamp(0, 1)
