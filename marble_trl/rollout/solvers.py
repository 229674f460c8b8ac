"""Rollout solvers: each ``sample_scheduler`` name as a diffusers scheduler on the family's training grid.

DiffusionNFT needs only the final clean latents ``x0`` of each rollout (no trajectory, no log-probabilities), so any
flow ODE solver works; sampling goes through the family pipeline's own ``__call__`` with precomputed prompt embeddings
and ``output_type="latent"``. DiffusionNFT's loss trains on the sampler's sigma grid (:func:`training_sigmas`: the
family pipeline's Euler grid with its shift, FLUX's / Qwen-Image's / Z-Image's sigma list and dynamic shift ``mu``,
Wan's ``flow_shift``), so **every solver here evaluates the transformer on that grid and nowhere else**, whatever the
family: the grid is rebuilt from exactly what the pipeline passes to ``set_timesteps`` (``sigmas``, ``mu``), so the
family pipelines' signature checks (``retrieve_timesteps`` asks for ``sigmas``) pass for every solver.

- ``euler``: ``FlowMatchEulerDiscreteScheduler`` (the grid's own scheduler);
- ``dpm2`` (default): the reference's 2nd-order multistep DPM-Solver (:mod:`marble_trl.rollout.dpm_solver`);
- ``heun``: ``FlowMatchHeunDiscreteScheduler``'s predictor-corrector on the grid (two evaluations per step but the
  last, both at grid sigmas);
- ``dpm2_diffusers``: diffusers' own ``DPMSolverMultistepScheduler`` (DPM-Solver++ 2M, flow prediction) on the grid:
  the same update as ``dpm2`` written by diffusers, agreeing with it to float rounding (tests/test_solvers.py).
  Deviation from diffusers: its flow mode builds its own grid and rounds the transformer's timesteps to integers;
  here both are the training grid's;
- a diffusers flow solver's class name (:data:`FLOW_SOLVER_CLASSES`), in flow-prediction mode on the grid;
- ``pipeline``: the pipeline's own scheduler class (Wan's ``UniPCMultistepScheduler``), on the grid.

Anything else is refused when the config is checked (:func:`check_solver_name`), before a model is loaded: a diffusers
scheduler without a flow-prediction mode would read the velocity as a noise prediction and roll out garbage without an
error.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
from collections.abc import Iterator
from typing import Any

import torch
from diffusers import (
    DPMSolverMultistepScheduler,
    FlowMatchEulerDiscreteScheduler,
    FlowMatchHeunDiscreteScheduler,
    UniPCMultistepScheduler,
)

from .dpm_solver import FlowMatchDPMSolver2Scheduler

# The rollout solvers by name (sample_scheduler / eval_sample_scheduler); "pipeline" and FLOW_SOLVER_CLASSES too.
SAMPLER_ALIASES = ("euler", "heun", "dpm2", "dpm2_diffusers")


def flow_config(config) -> dict:
    """A scheduler config as ``FlowMatchEulerDiscreteScheduler`` reads it: a flow-sigma scheduler's ``flow_shift``
    (Wan's ``UniPCMultistepScheduler``) becomes ``shift``."""
    config = dict(config)
    if config.get("use_flow_sigmas") and "flow_shift" in config and "shift" not in config:
        config["shift"] = config["flow_shift"]
    return config


def euler_grid(
    config, num_steps: int | None = None, *, sigmas=None, mu: float | None = None, timesteps=None, device=None
) -> torch.Tensor:
    """The flow times of the pipeline's Euler grid (``sigma = 0`` excluded, float32, on the CPU): what
    ``FlowMatchEulerDiscreteScheduler.set_timesteps`` makes of ``num_steps`` and the family's ``sigmas`` / ``mu``
    under the pipeline's scheduler ``config`` (its shift and dynamic-shift settings)."""
    sched = _from_config(FlowMatchEulerDiscreteScheduler, flow_config(config))
    if sched.config.get("use_dynamic_shifting", False) and mu is None:
        mu = 0.0  # [choice] neutral shift when the family gives none (SD3/3.5 do not shift dynamically)
    if sigmas is not None or timesteps is not None:
        num_steps = None  # the pipelines pass one of them (diffusers' retrieve_timesteps)
    sched.set_timesteps(num_steps, device=device, sigmas=sigmas, mu=mu, timesteps=timesteps)
    return sched.sigmas[:-1].float().cpu().clone()


def training_sigmas(base_scheduler, num_steps: int, **set_timesteps_kwargs) -> torch.Tensor:
    """The sampler's sigma grid that DiffusionNFT trains on: ``num_steps`` flow times of the Euler grid with the
    pipeline's shift (the final ``sigma = 0`` excluded). ``set_timesteps_kwargs`` are what the family's pipeline
    passes to ``set_timesteps`` (``FlowModelAdapter.timestep_kwargs``: FLUX's sigma list and dynamic shift)."""
    return euler_grid(base_scheduler.config, num_steps, **set_timesteps_kwargs)


class _OnTrainingGrid:
    """A diffusers solver that runs on the training grid: the grid pinned by :func:`pinned_grid` (what the family
    adapter's rollouts do), else the grid rebuilt from what ``set_timesteps`` gets (``sigmas``, ``mu``) under
    ``grid_config``, the pipeline scheduler's config. Pinning matters: a pipeline computes its ``mu`` from the config
    of the scheduler it holds (FLUX's ``base_image_seq_len``, ...) and drops its sigma list for a scheduler whose config
    says ``use_flow_sigmas``, so what it passes to another solver class is not what it passes to its own."""

    grid_config: dict = {}  # set per instance by make_scheduler
    pinned: torch.Tensor | None = None

    def set_timesteps(
        self,
        num_inference_steps: int | None = None,
        device: str | torch.device | None = None,
        sigmas: list[float] | None = None,
        mu: float | None = None,
        timesteps: list[float] | None = None,
    ) -> None:
        if self.pinned is None:
            grid = euler_grid(self.grid_config, num_inference_steps, sigmas=sigmas, mu=mu, timesteps=timesteps)
        else:
            grid = self.pinned
            asked = len(sigmas) if sigmas is not None else num_inference_steps
            if asked is not None and asked != len(grid):
                raise RuntimeError(f"The pipeline asked for {asked} steps on a pinned grid of {len(grid)}.")
        self._place_on_grid(grid, device)

    def _place_on_grid(self, grid: torch.Tensor, device) -> None:
        raise NotImplementedError


class GridHeunScheduler(_OnTrainingGrid, FlowMatchHeunDiscreteScheduler):
    """``FlowMatchHeunDiscreteScheduler`` on the training grid: step ``i`` evaluates at ``sigma_i`` and corrects at
    ``sigma_{i+1}``; the last step (to ``sigma = 0``) is an Euler step."""

    def _place_on_grid(self, grid, device) -> None:
        FlowMatchHeunDiscreteScheduler.set_timesteps(self, len(grid), device)  # resets the solver's state
        sigmas = torch.cat([grid, torch.zeros(1)])
        steps = grid * self.config.num_train_timesteps
        self.sigmas = torch.cat([sigmas[:1], sigmas[1:-1].repeat_interleave(2), sigmas[-1:]])
        self.timesteps = torch.cat([steps[:1], steps[1:].repeat_interleave(2)]).to(device)


class _GridMultistep(_OnTrainingGrid):
    """A diffusers multistep solver in flow-prediction mode (``alpha = 1 - sigma``) on the training grid, with the
    transformer's timesteps ``1000 sigma`` unrounded (diffusers rounds its own to integers)."""

    def _place_on_grid(self, grid, device) -> None:
        super(_OnTrainingGrid, self).set_timesteps(len(grid), device)  # resets the multistep history
        self.sigmas = torch.cat([grid, torch.zeros(1)])
        self.timesteps = (grid * self.config.num_train_timesteps).to(device)
        self.num_inference_steps = len(grid)


class GridDPMSolverMultistepScheduler(_GridMultistep, DPMSolverMultistepScheduler):
    """``DPMSolverMultistepScheduler`` (DPM-Solver++) on the training grid."""


class GridUniPCMultistepScheduler(_GridMultistep, UniPCMultistepScheduler):
    """``UniPCMultistepScheduler`` (UniPC) on the training grid."""


# The diffusers solver classes a name may give, each run on the training grid (tests/test_solvers.py checks each one's
# order of accuracy on a closed-form flow and its grid on every family). Not here: DEISMultistepScheduler (NaN from
# the grid's sigma = 1), the diffusion (epsilon / v) schedulers and the stochastic ones.
FLOW_SOLVER_CLASSES: dict[str, type] = {
    "FlowMatchEulerDiscreteScheduler": FlowMatchEulerDiscreteScheduler,
    "FlowMatchHeunDiscreteScheduler": GridHeunScheduler,
    "DPMSolverMultistepScheduler": GridDPMSolverMultistepScheduler,
    "UniPCMultistepScheduler": GridUniPCMultistepScheduler,
}
ALIAS_CLASSES = {
    "euler": "FlowMatchEulerDiscreteScheduler",
    "heun": "FlowMatchHeunDiscreteScheduler",
    "dpm2_diffusers": "DPMSolverMultistepScheduler",
}
# Flow-prediction settings of the multistep solvers (the grid replaces their own flow sigmas and dynamic shift).
_FLOW_PREDICTION = {
    "prediction_type": "flow_prediction",
    "use_flow_sigmas": True,
    "use_dynamic_shifting": False,
    "final_sigmas_type": "zero",
    "thresholding": False,
    "use_karras_sigmas": False,
    "use_exponential_sigmas": False,
    "use_beta_sigmas": False,
}
_DPM2_DIFFUSERS = {"solver_order": 2, "algorithm_type": "dpmsolver++", "solver_type": "midpoint"}


def solver_names() -> tuple[str, ...]:
    """Every accepted ``sample_scheduler`` / ``eval_sample_scheduler`` value."""
    return (*SAMPLER_ALIASES, "pipeline", *FLOW_SOLVER_CLASSES)


def check_solver_name(name: str, field: str = "sample_scheduler") -> None:
    """Refuse a solver name that cannot roll out a flow-matching model on the training grid, saying why and what to
    use (config time: no model is needed; ``pipeline`` is resolved once the model is loaded)."""
    if name in solver_names():
        return
    import diffusers

    choices = ", ".join(repr(n) for n in solver_names())
    cls = getattr(diffusers, name, None) if name.endswith("Scheduler") else None
    if cls is None:
        raise ValueError(f"{field}={name!r} is not a rollout solver. Choose one of {choices}.")
    raise ValueError(
        f"{field}={name!r}: diffusers' {name} cannot roll out a flow-matching model on its training grid (it has no "
        "flow-prediction mode, or it is stochastic or untested here), so it would read the velocity as something else "
        f"and train on broken rollouts. Choose one of {choices}."
    )


@contextlib.contextmanager
def pinned_grid(scheduler, grid: torch.Tensor) -> Iterator[None]:
    """Within the block, a solver of :func:`make_scheduler` that is not an Euler-grid scheduler itself runs on
    ``grid`` (the training sigmas, ``sigma = 0`` excluded) whatever the pipeline passes to its ``set_timesteps``."""
    if not isinstance(scheduler, _OnTrainingGrid):
        yield  # euler / dpm2: the pipeline's own set_timesteps arguments make the grid (tests/test_families.py)
        return
    scheduler.pinned = grid.float().cpu()
    try:
        yield
    finally:
        scheduler.pinned = None


def _solver_class(name: str, base_scheduler) -> type:
    if name == "dpm2":
        return FlowMatchDPMSolver2Scheduler
    if name == "pipeline":
        class_name = type(base_scheduler).__name__
        if class_name not in FLOW_SOLVER_CLASSES:
            raise ValueError(
                f"sample_scheduler='pipeline': the pipeline's {class_name} is not a flow solver marble_trl runs on the "
                f"training grid. Name one of {', '.join(repr(n) for n in solver_names() if n != 'pipeline')}."
            )
        name = class_name
    check_solver_name(name)
    return FLOW_SOLVER_CLASSES[ALIAS_CLASSES.get(name, name)]


def _from_config(cls, config: dict):
    """``cls.from_config`` with the keys ``cls`` takes (diffusers warns about the others: the shift of one class is
    another's ``flow_shift``)."""
    known = inspect.signature(cls.__init__).parameters
    return cls.from_config({k: v for k, v in config.items() if k in known})


def make_scheduler(name: str, base_scheduler) -> Any:
    """Build the rollout solver ``name`` from the pipeline's scheduler (its shift and grid settings), on the grid of
    :func:`training_sigmas`."""
    config = flow_config(base_scheduler.config)
    cls = _solver_class(name, base_scheduler)
    if cls is FlowMatchEulerDiscreteScheduler and name == "pipeline":
        return copy.deepcopy(base_scheduler)
    if issubclass(cls, FlowMatchEulerDiscreteScheduler):  # euler, dpm2: the grid is their own
        return _from_config(cls, config)
    # The pipeline's own settings (Wan's UniPC order, ...) stay; the grid replaces any flow sigmas and shift of theirs.
    overrides = dict(_FLOW_PREDICTION) if issubclass(cls, _GridMultistep) else {}
    if name == "dpm2_diffusers":
        overrides.update(_DPM2_DIFFUSERS)
    scheduler = _from_config(cls, {**config, **overrides})
    scheduler.grid_config = config
    return scheduler
