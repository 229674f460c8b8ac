"""The training methods ShapesBench compares, each a recipe for :class:`~marble_trl.MarbleDiffusionNFTTrainer`.

Every method trains on the same world, prompts, budget (optimizer steps x images per step) and seed; only the way the
rewards are combined differs:

- ``only_<reward>``: each reward trained alone (plain DiffusionNFT) on the prompts it applies to: a specialist on its
  own family, a general reward on every prompt (the learnability check);
- ``weighted_sum``: ``multi_objective_aggregation="sum_then_normalize"`` (DiffusionNFT's multi-reward recipe);
- ``normalize_then_sum``: GDPO's aggregation;
- ``sequential``: hand-made stages, one reward per stage (a callback sets ``trainer.reward_weights`` to a one-hot
  vector; the weighted-sum collator then trains on that reward alone);
- ``marble``: MARBLE, N = 10, rho = 0.7 (the paper's setting);
- ``marble_every_step``: MARBLE solving the QP at every step (N = 1);
- ``marble_released``: MARBLE as the authors' code runs it (``marble_procedure="released"``: per-pair solves, masked
  per-reward gradients, N = 10); ``marble_masked``: the paper's procedure with the release's masked solve;
- ``fixed_uniform``: MARBLE with the QP replaced by fixed uniform coefficients (normalised gradients averaged with
  ``alpha = 1/K`` at refreshes, ``A_bar = mean_k A_k`` in between): the paper's "fixed uniform alpha" ablation;
- ``marble_norm_aware``, ``marble_estimated``, ``marble_every_step_estimated`` (``_s3``): MARBLE with norm-aware
  amortised steps, with refreshes estimated from one (micro-batch, timestep) pair of five (N = 10), and the latter at
  N = 1 (from three pairs of five); ``marble_hold`` and ``marble_norm_aware_hold``: MARBLE (and its norm-aware
  variant) keeping a silent reward's ``alpha_bar`` at refreshes (``marble_silent_rewards="hold"``);
- ``mgda``, ``upgrad``, ``dualproj``, ``pcgrad``, ``imtl_g``, ``aligned_mtl``, ``cagrad``, ``nash_mtl``: the other Gram
  weightings of ``balance.weightings`` in MARBLE's place, with its N = 10 and EMA (``mgda``: no EMA).

Every multi-reward method runs with ``log_update_cosines=True`` so that Table S1 has cos(update, g_k) on every step
(a per-reward gradient pass on every step, which slows them down; MARBLE's refresh steps log ``marble/cos/*``
instead, and MARBLE every step has only refresh steps). ``weighted_sum_plain`` and ``marble_plain`` train exactly
like ``weighted_sum`` and ``marble`` without that diagnostic: they are the cost table's reference and MARBLE's cost
(``timing_only``), left out of the score tables and plots.

``stress_weighted_sum`` and ``stress_marble`` train the weighted sum and MARBLE on v1's rewards (an opposing pair
of pixel statistics, sharpness and compressibility, with the three specialists): the stress test of a reward set
that conflicts, reported in its own table. Cost and stress methods run on seed 0 only (``seed0_only``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from transformers import TrainerCallback

from ..balance.registry import AGGREGATORS
from .scorers import REWARD_NAMES, SPECIALIST_REWARDS, STRESS_REWARDS

# Stage order of the sequential baseline: specialists first, then the general rewards (a hand-made schedule).
SEQUENTIAL_ORDER = ("color", "count", "position", "alignment", "preference", "sharpness", "compressibility")


@dataclass(frozen=True)
class Method:
    """One training recipe: its rewards, config overrides and what to attach to the trainer."""

    name: str
    rewards: tuple[str, ...]
    overrides: dict[str, Any] = field(default_factory=dict)
    sequential: bool = False
    uniform_solver: bool = False
    timing_only: bool = False
    family: str | None = None  # train on this prompt family only (a specialist trained alone)
    stress: bool = False  # the opposing-pair stress test (its own table)
    seed0_only: bool = False  # cost and stress runs

    @property
    def multi_reward(self) -> bool:
        return len(self.rewards) > 1


def all_methods(rewards: tuple[str, ...] = tuple(REWARD_NAMES)) -> dict[str, Method]:
    """Every method of the benchmark, keyed by name (specialists first)."""
    weighted = {"multi_objective_aggregation": "sum_then_normalize", "log_update_cosines": True}
    # the paper's N = 10 (rho stays at the config's default, the paper's 0.7)
    marble = {"multi_objective_aggregation": "marble", "marble_refresh_interval": 10}
    methods = [Method(f"only_{r}", (r,), family=r if r in SPECIALIST_REWARDS else None) for r in rewards]
    stress = tuple(STRESS_REWARDS)
    methods += [
        Method("weighted_sum", rewards, weighted),
        # The same training as weighted_sum without the per-step cosine diagnostics: Table 2's reference.
        Method(
            "weighted_sum_plain",
            rewards,
            {"multi_objective_aggregation": "sum_then_normalize"},
            timing_only=True,
            seed0_only=True,
        ),
        Method("normalize_then_sum", rewards, {**weighted, "multi_objective_aggregation": "normalize_then_sum"}),
        Method("sequential", rewards, weighted, sequential=True),
        Method("marble", rewards, {**marble, "log_update_cosines": True}),
        # The same training as marble without the amortised steps' cosine diagnostics: its cost in Table 2.
        Method("marble_plain", rewards, marble, timing_only=True, seed0_only=True),
        Method("marble_every_step", rewards, {"multi_objective_aggregation": "marble", "marble_refresh_interval": 1}),
        # The authors' released procedure (per-pair solves, masked, alpha_bar from the first alpha*; no cosine
        # diagnostic: its pairs are solved or amortised one by one), and the paper's with the release's masked solve.
        Method("marble_released", rewards, {**marble, "marble_procedure": "released"}),
        Method("marble_masked", rewards, {**marble, "marble_masked_solve": True, "log_update_cosines": True}),
        Method("fixed_uniform", rewards, {**marble, "log_update_cosines": True}, uniform_solver=True),
        # Beyond the paper (docs/marble.md): norm-aware amortised steps, and refreshes estimated from 1 of the
        # step's 5 (micro-batch, timestep) pairs (N = 10, and N = 1: harmony on every step at a fraction of the cost).
        Method(
            "marble_norm_aware",
            rewards,
            {**marble, "marble_amortised_update": "norm_aware", "log_update_cosines": True},
        ),
        # Silent specialists keep their alpha_bar at refreshes (marble_silent_rewards="hold"), alone and with
        # norm-aware amortised steps: the ablation of why MARBLE at N = 10 loses the specialists (docs/shapesbench.md).
        Method("marble_hold", rewards, {**marble, "marble_silent_rewards": "hold", "log_update_cosines": True}),
        Method(
            "marble_norm_aware_hold",
            rewards,
            {
                **marble,
                "marble_amortised_update": "norm_aware",
                "marble_silent_rewards": "hold",
                "log_update_cosines": True,
            },
        ),
        Method("marble_estimated", rewards, {**marble, "marble_refresh_subset": 1, "log_update_cosines": True}),
        *(
            Method(
                "marble_every_step_estimated" + ("" if subset == 1 else f"_s{subset}"),
                rewards,
                {**marble, "marble_refresh_interval": 1, "marble_refresh_subset": subset, "log_update_cosines": True},
            )
            for subset in (1, 3)
        ),
        *(
            Method(name, rewards, {**marble, "multi_objective_aggregation": name, "log_update_cosines": True})
            for name in AGGREGATORS
        ),
        Method("stress_weighted_sum", stress, weighted, stress=True, seed0_only=True),
        Method("stress_marble", stress, {**marble, "log_update_cosines": True}, stress=True, seed0_only=True),
        Method(
            "stress_upgrad",
            stress,
            {**marble, "multi_objective_aggregation": "upgrad", "log_update_cosines": True},
            stress=True,
            seed0_only=True,
        ),  # fmt: skip
    ]
    return {m.name: m for m in methods}


def uniform_solver(gram_hat: np.ndarray):
    """A stand-in for the min-norm QP that always answers uniform coefficients (the fixed-uniform ablation)."""
    from ..balance.qp import QPResult

    k = gram_hat.shape[0]
    alpha = np.full(k, 1.0 / k)
    alpha.flags.writeable = False
    return QPResult(alpha, "uniform", True, 0.0)


def stage_weights(step: int, max_steps: int, rewards: tuple[str, ...]) -> list[float]:
    """The sequential schedule: equal-length stages in ``SEQUENTIAL_ORDER``, one-hot weights for step ``step``."""
    order = [r for r in SEQUENTIAL_ORDER if r in rewards] + [r for r in rewards if r not in SEQUENTIAL_ORDER]
    stage = min(len(order) - 1, step * len(order) // max(1, max_steps))
    return [1.0 if r == order[stage] else 0.0 for r in rewards]


class SequentialStages(TrainerCallback):
    """Sets ``trainer.reward_weights`` to the current stage's one-hot vector.

    The trainer reads ``reward_weights`` when it scores a step's rollouts, which happens before ``on_step_begin``;
    the weights for step ``s`` are therefore set at the end of step ``s - 1`` (and at train begin for step 0).
    """

    def __init__(self, trainer: Any, rewards: tuple[str, ...]) -> None:
        self.trainer = trainer
        self.rewards = rewards
        self.history: list[list[float]] = []

    def _set(self, step: int, max_steps: int) -> None:
        w = stage_weights(step, max_steps, self.rewards)
        self.trainer.reward_weights = torch.tensor(w, dtype=torch.float32)
        self.history.append(w)

    def on_train_begin(self, args, state, control, **kwargs):
        self._set(0, state.max_steps)

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step < state.max_steps:
            self._set(state.global_step, state.max_steps)


class StepTimer(TrainerCallback):
    """Wall-clock stamps at every optimizer-step end (rollouts, rewards, loss, balancer, update)."""

    def __init__(self) -> None:
        self.stamps: list[float] = []

    def on_train_begin(self, args, state, control, **kwargs):
        self.stamps = [time.perf_counter()]

    def on_step_end(self, args, state, control, **kwargs):
        self.stamps.append(time.perf_counter())

    def step_times(self) -> list[float]:
        return [b - a for a, b in zip(self.stamps, self.stamps[1:])]


def attach(trainer: Any, method: Method) -> Callable[[], list[list[float]]]:
    """Attach a method's callbacks/patches to a built trainer; returns a getter of the sequential weights history."""
    if method.uniform_solver:
        if trainer.balancer is None:
            raise ValueError(f"{method.name}: the fixed-uniform ablation needs MARBLE active (>= 2 rewards).")
        trainer.balancer.solver = uniform_solver
    if method.sequential:
        stages = SequentialStages(trainer, method.rewards)
        trainer.add_callback(stages)
        return lambda: stages.history
    return lambda: []
