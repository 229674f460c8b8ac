"""Rollout solvers: the diffusers scheduler of each ``sample_scheduler`` name, and the training sigma grid.

DiffusionNFT needs only the final clean latents ``x0`` of each rollout (no trajectory, no log-probabilities), so any
diffusers flow scheduler works; sampling goes through the pipeline's own ``__call__`` with precomputed prompt
embeddings and ``output_type="latent"``. The default ``dpm2`` is the reference's solver, which evaluates the model at
the training grid's sigmas (:mod:`marble_trl.dpm_solver`); ``euler`` does too; ``heun`` and ``dpm2_diffusers``
(diffusers' ``DPMSolverMultistepScheduler``) evaluate it elsewhere.
"""

from __future__ import annotations

import copy

import torch

# The rollout solvers by name (sample_scheduler / eval_sample_scheduler), besides any diffusers scheduler class.
SAMPLER_ALIASES = ("euler", "heun", "dpm2", "dpm2_diffusers")


def flow_config(config) -> dict:
    """A scheduler config as ``FlowMatchEulerDiscreteScheduler`` reads it: a flow-sigma scheduler's ``flow_shift``
    (Wan's ``UniPCMultistepScheduler``) becomes ``shift``."""
    config = dict(config)
    if config.get("use_flow_sigmas") and "flow_shift" in config and "shift" not in config:
        config["shift"] = config["flow_shift"]
    return config


def make_scheduler(name: str, base_scheduler):
    """Build the rollout scheduler ``name`` from the pipeline's scheduler config (keeps its ``shift``)."""
    import diffusers

    config = flow_config(base_scheduler.config)
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


def training_sigmas(base_scheduler, num_steps: int, **set_timesteps_kwargs) -> torch.Tensor:
    """The sampler's sigma grid that DiffusionNFT trains on: ``num_steps`` flow times of the Euler grid with the
    pipeline's shift (the final ``sigma = 0`` excluded). ``set_timesteps_kwargs`` are what the family's pipeline
    passes to ``set_timesteps`` (``FlowModelAdapter.timestep_kwargs``: FLUX's sigma list and dynamic shift)."""
    import diffusers

    sched = diffusers.FlowMatchEulerDiscreteScheduler.from_config(flow_config(base_scheduler.config))
    kwargs = dict(set_timesteps_kwargs)
    if sched.config.get("use_dynamic_shifting", False) and "mu" not in kwargs:
        kwargs["mu"] = 0.0  # [choice] neutral shift when the family gives none (SD3/3.5 do not shift dynamically)
    sched.set_timesteps(num_steps, **kwargs)
    return sched.sigmas[:num_steps].float().clone()
