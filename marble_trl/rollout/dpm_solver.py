"""DiffusionNFT's rollout solver: deterministic 2nd-order multistep DPM-Solver on the pipeline's Euler sigma grid.

The reference code (NVlabs/DiffusionNFT, ``flow_grpo/diffusers_patch/solver.py``, ``dpm_step`` with ``order=2``)
does not use diffusers' ``DPMSolverMultistepScheduler``: it runs its own data-prediction DPM-Solver++ update on the
sigmas of the pipeline's own ``FlowMatchEulerDiscreteScheduler`` (SD3.5: shift 3; 10 steps end
``..., 0.278, 0.0089 -> 0``). diffusers' scheduler with flow sigmas builds another grid (10 steps end
``..., 0.4283, 0.2498 -> 0``): a large last jump that changes every ``x0`` the NFT loss trains on and every reward. So
the model is evaluated exactly at the training grid's sigmas (``rollout.solvers.training_sigmas``), which DiffusionNFT's loss
assumes.

With flow matching ``x_sigma = (1 - sigma) x0 + sigma eps``, ``alpha = 1 - sigma`` and ``lambda = log(alpha / sigma)``.
From the model's velocity ``v``, ``x0_hat = x - sigma v``. Step ``i`` from ``s = sigma_i`` to ``t = sigma_{i+1}``:

- the first and the last step: the DDIM update ``t / s x + (1 - t - t (1 - s) / s) x0_hat``, which is Euler's
  ``x + (t - s) v`` (the last one lands on ``x0_hat``);
- every other step: the 2nd-order multistep update
  ``t / s x - alpha_t (e^{-h} - 1) (D0 + D1 / 2)``, ``h = lambda_t - lambda_s``, ``D0 = x0_hat_i``,
  ``D1 = (x0_hat_i - x0_hat_{i-1}) h / h_prev``. The step after ``sigma = 1`` has ``lambda_{s-1} = -inf``, so its
  ``D1`` is 0 (first order), as in the reference.

Deviation: the reference casts its rollout timesteps to integers (``torch.long`` of ``1000 sigma``) before the
transformer; here the transformer gets ``1000 sigma`` unrounded, as diffusers' pipelines and the training loss do.
"""

from __future__ import annotations

import torch
from diffusers import FlowMatchEulerDiscreteScheduler
from diffusers.schedulers.scheduling_flow_match_euler_discrete import FlowMatchEulerDiscreteSchedulerOutput


class FlowMatchDPMSolver2Scheduler(FlowMatchEulerDiscreteScheduler):
    """The reference's 2nd-order multistep DPM-Solver on ``FlowMatchEulerDiscreteScheduler``'s own sigma grid.

    A drop-in diffusers scheduler: ``set_timesteps`` (the grid, shift and dynamic shifting) is the Euler scheduler's,
    ``step`` is the DPM-Solver update; one model evaluation per step.
    """

    # The parent's signature spelled out: the family pipelines (FLUX, Qwen-Image, Z-Image) pass their sigma list only
    # to a set_timesteps whose signature names `sigmas` (diffusers' retrieve_timesteps).
    def set_timesteps(
        self,
        num_inference_steps: int | None = None,
        device: str | torch.device | None = None,
        sigmas: list[float] | None = None,
        mu: float | None = None,
        timesteps: list[float] | None = None,
    ) -> None:
        super().set_timesteps(num_inference_steps, device, sigmas=sigmas, mu=mu, timesteps=timesteps)
        self._previous_x0: torch.Tensor | None = None

    def step(
        self,
        model_output: torch.Tensor,
        timestep: float | torch.Tensor,
        sample: torch.Tensor,
        *args,
        return_dict: bool = True,
        **kwargs,
    ) -> FlowMatchEulerDiscreteSchedulerOutput | tuple:
        if self.step_index is None:
            self._init_step_index(timestep)
        i = self.step_index
        sigmas = self.sigmas.to(torch.float64)
        s, t = sigmas[i], sigmas[i + 1]
        x = sample.to(torch.float32)
        x0 = x - s.float() * model_output.to(torch.float32)
        previous, self._previous_x0 = getattr(self, "_previous_x0", None), x0
        if i == 0 or i == len(self.timesteps) - 1 or previous is None:
            prev_sample = _ddim(x, x0, s, t)
        else:
            prev_sample = _multistep_second_order(x, x0, previous, sigmas[i - 1], s, t)
        self._step_index += 1
        prev_sample = prev_sample.to(model_output.dtype)
        if not return_dict:
            return (prev_sample,)
        return FlowMatchEulerDiscreteSchedulerOutput(prev_sample=prev_sample)


def _lambda(sigma: torch.Tensor) -> torch.Tensor:
    return torch.log(1.0 - sigma) - torch.log(sigma)  # -inf at sigma = 1


def _ddim(x: torch.Tensor, x0: torch.Tensor, s: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    eps = (x - (1.0 - s.float()) * x0) / s.float()
    return (1.0 - t.float()) * x0 + t.float() * eps


def _multistep_second_order(
    x: torch.Tensor, x0: torch.Tensor, x0_prev: torch.Tensor, s_prev: torch.Tensor, s: torch.Tensor, t: torch.Tensor
) -> torch.Tensor:
    h, h_prev = _lambda(t) - _lambda(s), _lambda(s) - _lambda(s_prev)
    r = h_prev / h
    d1 = (x0 - x0_prev) / r.float() if torch.isfinite(r) else torch.zeros_like(x0)
    coeff = (-(1.0 - t) * torch.expm1(-h)).float()  # -alpha_t (e^{-h} - 1)
    return (t / s).float() * x + coeff * (x0 + 0.5 * d1)
