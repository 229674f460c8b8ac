"""The rollout solvers: the default ``dpm2`` is the DiffusionNFT reference's DPM-Solver on the training grid."""

from __future__ import annotations

import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler

from marble_trl.models import encode_prompts, predict_velocity, sample_latents
from marble_trl.rollout.dpm_solver import FlowMatchDPMSolver2Scheduler
from marble_trl.rollout.solvers import make_scheduler, training_sigmas

SD35_SCHEDULER = FlowMatchEulerDiscreteScheduler(shift=3.0)  # SD3.5's scheduler config


@pytest.mark.parametrize("steps", [10, 25])
def test_dpm2_rollout_evaluates_the_model_exactly_on_the_training_grid(tiny_pipeline, steps):
    seen: list[torch.Tensor] = []

    def record(module, args, kwargs):
        seen.append(kwargs["timestep"].detach().clone())

    handle = tiny_pipeline.transformer.register_forward_pre_hook(record, with_kwargs=True)
    try:
        embeds = encode_prompts(tiny_pipeline, ["a red square", "a blue circle"], 8, torch.device("cpu"))
        scheduler = make_scheduler("dpm2", tiny_pipeline.scheduler)
        x0 = sample_latents(tiny_pipeline, scheduler, embeds, steps, 32, torch.Generator().manual_seed(0))
    finally:
        handle.remove()
    assert x0.isfinite().all()
    grid = training_sigmas(tiny_pipeline.scheduler, steps) * 1000.0
    assert len(seen) == steps  # one model evaluation per step
    for timestep, expected in zip(seen, grid):
        assert timestep.shape == (2,)
        torch.testing.assert_close(timestep.float(), expected.expand(2), rtol=0, atol=1e-4)


def test_dpm2_grid_is_the_reference_grid_not_diffusers_dpm_grid():
    """The reference's 10-step grid at shift 3 ends 0.2780, 0.0089 -> 0; diffusers' own DPM grid 0.4283, 0.2498 -> 0.
    ``dpm2_diffusers`` runs diffusers' DPM-Solver on the reference's grid, not on diffusers' own."""
    from diffusers import DPMSolverMultistepScheduler

    ours = make_scheduler("dpm2", SD35_SCHEDULER)
    ours.set_timesteps(10)
    assert ours.sigmas[-3:].tolist() == pytest.approx([0.2780, 0.0089, 0.0], abs=1e-4)
    assert torch.equal(ours.sigmas[:-1], training_sigmas(SD35_SCHEDULER, 10))
    diffusers_own = DPMSolverMultistepScheduler(
        prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0
    )
    diffusers_own.set_timesteps(10)
    assert diffusers_own.sigmas[-3:].tolist() == pytest.approx([0.4283, 0.2498, 0.0], abs=1e-4)
    on_grid = make_scheduler("dpm2_diffusers", SD35_SCHEDULER)
    on_grid.set_timesteps(10)
    assert torch.equal(on_grid.sigmas, ours.sigmas)
    assert torch.equal(on_grid.timesteps, ours.timesteps)  # unrounded 1000 sigma (diffusers rounds its own)


MU, S = 0.3, 0.5  # data x0 ~ N(MU, S^2): the flow's velocity field is linear in x, its ODE solvable exactly


def gaussian_velocity(x: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
    """Exact velocity ``E[eps - x0 | x_sigma]`` of rectified flow for Gaussian data: ``x_sigma = (1 - sigma) MU +
    c(sigma) z`` with ``c^2 = (1 - sigma)^2 S^2 + sigma^2``, so ``v = -MU + c'/c (x - (1 - sigma) MU)``."""
    c2 = (1 - sigma) ** 2 * S**2 + sigma**2
    return -MU + (sigma - (1 - sigma) * S**2) / c2 * (x - (1 - sigma) * MU)


def solve(scheduler, steps: int, eps: torch.Tensor) -> torch.Tensor:
    scheduler.set_timesteps(steps)
    x = eps.clone()
    for t in scheduler.timesteps:
        x = scheduler.step(gaussian_velocity(x.double(), t.double() / 1000).float(), t, x).prev_sample
    return x


@pytest.mark.parametrize("steps", [40, 80])
def test_dpm2_solves_a_linear_flow_to_second_order(steps):
    """x(sigma=0) of the Gaussian flow from eps is exactly ``MU + S eps``; 2nd order: halving the step size divides
    the error by ~4 (Euler's by ~2). Measured (max error over 4096 samples): DPM 0.172 / 0.042 / 0.0092 at 40 / 80 /
    160 steps, Euler 0.146 / 0.073 / 0.037. At 10 steps both are far off on this field (DPM 0.83, Euler 0.58): the
    shifted grid's jump 0.278 -> 0.0089 is 3.8 in log-SNR, where the field bends."""
    eps = torch.randn(4096, generator=torch.Generator().manual_seed(0))
    exact = MU + S * eps

    def error(cls, n):
        return (solve(cls.from_config(SD35_SCHEDULER.config), n, eps) - exact).abs().max().item()

    dpm, dpm_fine = error(FlowMatchDPMSolver2Scheduler, steps), error(FlowMatchDPMSolver2Scheduler, 2 * steps)
    euler, euler_fine = (
        error(FlowMatchEulerDiscreteScheduler, steps),
        error(FlowMatchEulerDiscreteScheduler, 2 * steps),
    )
    assert 3.2 < dpm / dpm_fine < 4.8, dpm / dpm_fine
    assert 1.7 < euler / euler_fine < 2.3, euler / euler_fine
    assert dpm_fine < euler_fine / 1.7


def test_dpm2_first_and_last_steps_are_euler_steps():
    """Step 0 (from sigma = 1) and the last step (to sigma = 0, landing on x0_hat) are DDIM, i.e. Euler, updates."""
    scheduler = FlowMatchDPMSolver2Scheduler.from_config(SD35_SCHEDULER.config)
    scheduler.set_timesteps(5)
    x = torch.randn(8, generator=torch.Generator().manual_seed(1))
    v = torch.randn(8, generator=torch.Generator().manual_seed(2))
    sigmas = scheduler.sigmas
    first = scheduler.step(v, scheduler.timesteps[0], x).prev_sample
    torch.testing.assert_close(first, x + (sigmas[1] - sigmas[0]) * v)
    for t in scheduler.timesteps[1:-1]:
        x = scheduler.step(v, t, x).prev_sample
    last = scheduler.step(v, scheduler.timesteps[-1], x).prev_sample
    torch.testing.assert_close(last, x - sigmas[-2] * v)  # x0_hat


def test_dpm2_state_resets_between_rollouts(tiny_pipeline):
    """The multistep history must not leak from one rollout into the next: the same noise gives the same x0."""
    embeds = encode_prompts(tiny_pipeline, ["a red square"], 8, torch.device("cpu"))
    scheduler = make_scheduler("dpm2", tiny_pipeline.scheduler)
    a = sample_latents(tiny_pipeline, scheduler, embeds, 6, 32, torch.Generator().manual_seed(3))
    b = sample_latents(tiny_pipeline, scheduler, embeds, 6, 32, torch.Generator().manual_seed(3))
    assert torch.equal(a, b)


def test_dpm2_matches_a_hand_written_multistep_solve(tiny_pipeline):
    """The pipeline's sampling loop with the scheduler equals the update written out from the formulas of
    marble_trl.rollout.dpm_solver's docstring, on the real tiny transformer."""
    torch.manual_seed(0)
    embeds = encode_prompts(tiny_pipeline, ["a green triangle"], 8, torch.device("cpu"))
    steps = 6
    scheduler = make_scheduler("dpm2", tiny_pipeline.scheduler)
    x0 = sample_latents(tiny_pipeline, scheduler, embeds, steps, 32, torch.Generator().manual_seed(4))
    sigmas = torch.cat([training_sigmas(tiny_pipeline.scheduler, steps), torch.zeros(1)]).double()
    x = torch.randn(x0.shape, generator=torch.Generator().manual_seed(4))  # the pipeline's prepare_latents draw
    lam = torch.log(1 - sigmas) - torch.log(sigmas)
    previous = None
    with torch.no_grad():
        for i in range(steps):
            s, t = sigmas[i], sigmas[i + 1]
            v = predict_velocity(
                tiny_pipeline.transformer, x, s.float().expand(1), embeds.prompt_embeds, embeds.pooled
            )
            x0_hat = x - s.float() * v
            if i in (0, steps - 1):
                x = x + (t - s).float() * v
            else:
                h, h_prev = lam[i + 1] - lam[i], lam[i] - lam[i - 1]
                d1 = (x0_hat - previous) * (h / h_prev).float() if i > 1 else torch.zeros_like(x0_hat)
                x = (t / s).float() * x - ((1 - t) * torch.expm1(-h)).float() * (x0_hat + 0.5 * d1)
            previous = x0_hat
    torch.testing.assert_close(x0, x, rtol=1e-4, atol=1e-5)
