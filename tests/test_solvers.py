"""The solver matrix: every ``sample_scheduler`` name the config accepts x every model family.

Each accepted solver rolls out through the family pipeline's own ``__call__`` on exactly the training grid (the Euler
grid with the family's shift, sigma list and dynamic ``mu``), solves a closed-form flow to its order on that grid, and
lands near a fine Euler solve of the real tiny transformer (a solver that read the velocity as a noise prediction
lands far away); every other name is refused when the config is built, before any model is loaded.
"""

from __future__ import annotations

import pytest
import torch
from tiny import tiny_args

from marble_trl import MarbleDiffusionNFTConfig
from marble_trl.models import FAMILIES, load_model
from marble_trl.rollout.solvers import make_scheduler, solver_names, training_sigmas

TINY_NAMES = [f.tiny_name for f in FAMILIES]
SOLVERS = solver_names()
RESOLUTION = 16
PROMPTS = ["a red apple", "a blue boat on a lake"]
CPU = torch.device("cpu")
# Heun evaluates twice per step (at sigma_i and, as a corrector, at sigma_{i+1}) except on the last step.
TWO_EVALUATIONS = {"heun", "FlowMatchHeunDiscreteScheduler"}


@pytest.fixture(scope="module")
def adapters():
    return {name: load_model(name) for name in TINY_NAMES}


def _guidance(adapter) -> float:
    return 3.5 if adapter.guidance == "embedded" else 2.0  # CFG families: a CFG rollout with the negative prompt


def _rollout(adapter, name: str, steps: int, seed: int = 5):
    """``(x0, timesteps the pipeline stepped through)`` of one CFG rollout of the two prompts with solver ``name``."""
    guidance = _guidance(adapter)
    sources = {}  # an editing family edits two source images
    if adapter.editing:
        side = adapter.source_resolution
        sources = {"source_images": torch.rand(2, 3, side, side, generator=torch.Generator().manual_seed(0))}
    cond = adapter.encode(PROMPTS, 8, CPU, guidance, **sources)
    negative = adapter.encode([""] * 2, 8, CPU, **sources) if adapter.needs_negative(guidance) else None
    scheduler = make_scheduler(name, adapter.pipeline.scheduler)
    seen: list[float] = []
    step = scheduler.step

    def recording_step(model_output, timestep, sample, *args, **kwargs):
        seen.append(float(timestep))
        return step(model_output, timestep, sample, *args, **kwargs)

    scheduler.step = recording_step
    x0 = adapter.sample(scheduler, cond, steps, RESOLUTION, torch.Generator().manual_seed(seed), guidance, negative)
    return x0, torch.tensor(seen)


@pytest.mark.parametrize("family", TINY_NAMES)
def test_every_solver_rolls_out_on_the_family_training_grid(adapters, family):
    """The pipeline passes each step's timestep to the transformer and to the solver: for every solver it is
    ``1000 sigma`` of the training grid, in order (Heun: each interior sigma twice), never rounded or shifted."""
    adapter = adapters[family]
    steps = 5
    grid = training_sigmas(adapter.pipeline.scheduler, steps, **adapter.timestep_kwargs(steps, RESOLUTION))
    for name in SOLVERS:
        x0, seen = _rollout(adapter, name, steps)
        assert x0.isfinite().all(), (family, name)
        expected = torch.cat([grid[:1], grid[1:].repeat_interleave(2)]) if name in TWO_EVALUATIONS else grid
        torch.testing.assert_close(seen / 1000, expected, rtol=0, atol=1e-6, msg=f"{family} / {name}")


@pytest.mark.parametrize("family", TINY_NAMES)
def test_every_solver_lands_near_a_fine_euler_solve_of_the_transformer(adapters, family):
    """8 steps of each solver against 64 Euler steps on the tiny transformer (same noise), relative to the latents'
    largest value. Measured, worst over the five families: 0.071 (Euler, Heun), 0.098 (DPM), 0.103 (UniPC). Before
    the fix, UniPC built from SD3's config (epsilon prediction) landed at 149 (the step-1 loss of 7,489 against 62.8)."""
    adapter = adapters[family]
    reference, _ = _rollout(adapter, "euler", 64)
    scale = reference.abs().max()
    for name in SOLVERS:
        x0, _ = _rollout(adapter, name, 8)
        error = ((x0 - reference).abs().max() / scale).item()
        assert error < 0.2, (family, name, error)
    dpm2, _ = _rollout(adapter, "dpm2", 8)
    dpm2_diffusers, _ = _rollout(adapter, "dpm2_diffusers", 8)
    # The reference's DPM-Solver and diffusers' DPM-Solver++ 2M are one update on one grid.
    torch.testing.assert_close(dpm2_diffusers, dpm2, rtol=1e-4, atol=1e-5 * scale.item())


MU, S = 0.3, 0.5  # data x0 ~ N(MU, S^2): the flow's velocity field is linear in x, its ODE solvable exactly


def gaussian_velocity(x: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
    c2 = (1 - sigma) ** 2 * S**2 + sigma**2
    return -MU + (sigma - (1 - sigma) * S**2) / c2 * (x - (1 - sigma) * MU)


def _solve_error(adapter, name: str, steps: int) -> float:
    scheduler = make_scheduler(name, adapter.pipeline.scheduler)
    scheduler.set_timesteps(**_pipeline_timestep_kwargs(adapter, steps))
    eps = torch.randn(4096, 1, generator=torch.Generator().manual_seed(0))
    x = eps.clone()
    for t in scheduler.timesteps:
        x = scheduler.step(gaussian_velocity(x.double(), t.double() / 1000).float(), t, x).prev_sample
    return (x - (MU + S * eps)).abs().max().item()


def _pipeline_timestep_kwargs(adapter, steps: int) -> dict:
    """What the family pipeline passes to ``set_timesteps`` (its sigma list replaces the step count)."""
    kwargs = adapter.timestep_kwargs(steps, RESOLUTION)
    return kwargs if "sigmas" in kwargs else {"num_inference_steps": steps, **kwargs}


# (steps, the least error ratio when the steps double): Euler is 1st order (measured 1.92-2.00), the others 2nd. On
# the packed-latent families' grid (linspace(1, 1/N, N), shifted) the multistep solvers' last step, an Euler step from
# sigma ~ 1/N, dominates and 4 is reached slowly (measured at 80 -> 160 steps: 3.07-3.09 DPM, 3.90-3.93 UniPC; SD3's
# grid 4.56 / 5.96); Heun reaches float32 rounding sooner (measured at 10 -> 20: 4.04-6.74).
ORDER = {"euler": (40, 1.7), "dpm2": (80, 2.8), "dpm2_diffusers": (80, 2.8), "heun": (10, 3.2)}
ORDER |= {"FlowMatchEulerDiscreteScheduler": ORDER["euler"], "FlowMatchHeunDiscreteScheduler": ORDER["heun"]}
ORDER |= {"DPMSolverMultistepScheduler": ORDER["dpm2"], "UniPCMultistepScheduler": (80, 2.8), "pipeline": (40, 1.7)}


@pytest.mark.parametrize("family", TINY_NAMES)
@pytest.mark.parametrize("name", SOLVERS)
def test_every_solver_solves_a_closed_form_flow_to_its_order_on_the_family_grid(adapters, family, name):
    """x(sigma=0) of the Gaussian flow from eps is exactly ``MU + S eps``; halving the step size divides the error by
    ~2 (1st order) or ~4 (2nd), on the grid the family's pipeline asks for."""
    adapter = adapters[family]
    steps, ratio = ORDER[name]
    coarse, fine = _solve_error(adapter, name, steps), _solve_error(adapter, name, 2 * steps)
    assert coarse / fine > ratio, (coarse, fine)


@pytest.mark.parametrize(
    ("name", "match"),
    [
        ("DDIMScheduler", "DDIMScheduler cannot roll out a flow-matching model"),
        ("DEISMultistepScheduler", "DEISMultistepScheduler cannot roll out"),
        ("EulerDiscreteScheduler", "no flow-prediction mode"),
        ("dpm3", "'dpm3' is not a rollout solver. Choose one of 'euler', 'heun', 'dpm2'"),
    ],
)
@pytest.mark.parametrize("field", ["sample_scheduler", "eval_sample_scheduler"])
def test_other_solver_names_are_refused_when_the_config_is_built(field, name, match, tmp_path):
    with pytest.raises(ValueError, match=f"{field}={name!r}") as err:
        MarbleDiffusionNFTConfig(output_dir=str(tmp_path), **{field: name})
    assert match in str(err.value)


def test_pipeline_solver_of_an_unsupported_class_is_refused_by_name(adapters):
    from diffusers import DDIMScheduler

    with pytest.raises(ValueError, match="the pipeline's DDIMScheduler is not a flow solver"):
        make_scheduler("pipeline", DDIMScheduler())


def test_wan_pipeline_scheduler_unipc_runs_on_the_flow_shift_grid():
    """Wan's published scheduler (UniPC, flow sigmas, ``flow_shift``): 'pipeline' keeps its class and order, on the
    Euler grid with ``shift = flow_shift`` (the training grid)."""
    from diffusers import FlowMatchEulerDiscreteScheduler, UniPCMultistepScheduler

    wan = UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=5.0)
    scheduler = make_scheduler("pipeline", wan)
    scheduler.set_timesteps(10)
    assert isinstance(scheduler, UniPCMultistepScheduler) and scheduler.config.solver_order == wan.config.solver_order
    torch.testing.assert_close(scheduler.sigmas[:-1], training_sigmas(wan, 10), rtol=0, atol=0)
    torch.testing.assert_close(
        training_sigmas(wan, 10), training_sigmas(FlowMatchEulerDiscreteScheduler(shift=5.0), 10)
    )


@pytest.mark.slow
@pytest.mark.parametrize("name", ["heun", "dpm2_diffusers", "UniPCMultistepScheduler"])
def test_solvers_train_and_evaluate_on_a_packed_latent_family(name, tmp_path):
    """One MARBLE step and an evaluation of tiny FLUX with each solver that is not covered by a recipe: it trains
    (a finite loss of the scale of the default solver's) and evaluates with the same solver."""
    from tiny import brightness, contrast

    from marble_trl import MarbleDiffusionNFTTrainer
    from marble_trl.data.prompts import load_prompt_dataset

    losses = {}
    for solver in ("dpm2", name):
        args = tiny_args(
            tmp_path / solver,
            max_steps=1,
            sample_scheduler=solver,
            eval_sample_scheduler=solver,
            eval_num_sample_steps=3,
            resolution=RESOLUTION,
        )
        trainer = MarbleDiffusionNFTTrainer(
            "tiny-flux", [brightness, contrast], args=args, train_dataset=load_prompt_dataset()
        )
        result = trainer.train()
        losses[solver] = result.training_loss
        scores = trainer.evaluate(load_prompt_dataset().select(range(2)))
        assert all(torch.isfinite(torch.tensor(v)) for k, v in scores.items() if isinstance(v, float)), scores
    assert 0.5 < losses[name] / losses["dpm2"] < 2.0, losses
