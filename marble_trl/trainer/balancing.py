"""The trainer's gradient-space balancing around the timestep loop: the per-reward gradient engine, MARBLE's refreshes
(exact at the step's end, or solved first: :mod:`.solve_first`), the released MARBLE's pairs (:mod:`.pairwise`) and
the cosine diagnostics; mixed into :class:`~marble_trl.MarbleDiffusionNFTTrainer`."""

from __future__ import annotations

import time

import torch

from .backward import finish_engine_step, per_reward_engine
from .metrics import cosine_metrics, marble_metrics, pair_metrics
from .pairwise import pairwise_micro_batch_loss
from .solve_first import solve_first_refresh
from .step import MicroBatch, StepPlan


class BalancingHooks:
    """``_engine_for`` / ``_finish_engine_step`` around a micro-batch's loss, ``_solve_first`` before the step's first
    one, ``_pairwise_step`` (a released-MARBLE micro-batch). Every refresh opens the step session's transaction
    (:class:`~marble_trl.trainer.session.StepSession`): a skipped step takes it back."""

    @property
    def _update_cosines_this_step(self) -> bool:
        """Whether this step computes the cosine diagnostic (``log_update_cosines`` every ``..._interval`` steps)."""
        args = self.args
        return args.log_update_cosines and self.state.global_step % args.log_update_cosines_interval == 0

    def _engine_for(self, batch: MicroBatch):
        """The per-reward gradient engine on refresh / cosine steps (built on first use), else ``None``."""
        if batch.plan.needs_engine or batch.plan.mode == "solve_first":
            self._gradient_engine = per_reward_engine(
                self._gradient_engine, batch, self.args.marble_gradient_engine, self.trainable_parameters,
                len(self.reward_funcs), self.backend, self.transformer,
            )  # fmt: skip
            return self._gradient_engine
        return None

    def _solve_first(self, batch: MicroBatch) -> None:
        """A ``"solve_first"`` refresh (at the step's first micro-batch): the per-reward gradients of the subset, the
        QP, then every micro-batch of the step re-planned for its Prop. 1 update."""
        start = time.perf_counter()
        self.session.begin_refresh()  # a skipped step must not move alpha_bar
        num_train = batch.timestep_index.shape[1]
        result = solve_first_refresh(
            self.session.batches,
            transformer=self.transformer,
            predict=self.model_adapter.predict,
            sigmas=self.train_sigmas,
            settings=self._loss_settings,
            engine=self._engine_for(batch),
            noise_generator=lambda m: self._generator(2, self._global_batch_index(m)),
            autocast=self._autocast,
            scale=1.0 / (num_train * self.current_gradient_accumulation_steps),
            device=self.accelerator.device,
            subset=self.args.marble_refresh_subset,
            balancer=self.balancer,
            backend=self.backend,
            log_update_cosines=self._update_cosines_this_step,
        )
        self.session.replan(result.batches)
        if result.skipped:
            self.nonfinite_guard.flag(result.skipped)
            return
        self._append_metrics(marble_metrics(result.refresh, self.reward_names, self.balancer.num_refreshes))
        self._metrics["marble/refresh_pairs"].append(float(result.pairs))
        self._metrics["time/balancer"].append(time.perf_counter() - start)

    def _finish_engine_step(self, engine, plan: StepPlan) -> None:
        """After the step's last micro-batch: MARBLE's QP and Eq. 7, or the baseline cosines; logs them."""
        start = time.perf_counter()
        if plan.mode == "refresh":
            self.session.begin_refresh()  # the guard may still skip the step (its gradients, its update)
        result = finish_engine_step(
            engine,
            plan.mode,
            plan.has_signal,
            self.backend,
            self.balancer,
            self._loss_settings.refresh_update,
            bool(self.nonfinite_guard.reasons),
            self.reward_names,
        )
        if result.skipped:
            if result.reason is not None:  # a reason this process's guard has not recorded yet
                self.nonfinite_guard.flag(result.reason)
            return  # the step is skipped: no QP, no coefficient update
        if result.refresh is not None:
            self._append_metrics(marble_metrics(result.refresh, self.reward_names, self.balancer.num_refreshes))
        else:
            self._append_metrics(
                cosine_metrics(result.cosines, result.cosine_stats, self.reward_names, plan.has_signal)
            )
        self._metrics["time/balancer"].append(time.perf_counter() - start)

    def _pairwise_step(self, model, batch: MicroBatch, start: float) -> torch.Tensor:
        """A micro-batch of the released MARBLE (``marble_procedure="released"``: :mod:`.pairwise`)."""
        self.session.begin_refresh()  # its pairs move alpha_bar: a skipped step must not
        num_train = batch.timestep_index.shape[1]
        scale = 1.0 / (num_train * self.current_gradient_accumulation_steps)

        def engine():
            self._gradient_engine = per_reward_engine(
                self._gradient_engine, batch, self.args.marble_gradient_engine, self.trainable_parameters,
                len(self.reward_funcs), self.backend, self.transformer,  # a "pairwise" plan: K rows on every back-end
            )  # fmt: skip
            return self._gradient_engine

        result = pairwise_micro_batch_loss(
            batch,
            step=self.state.global_step,
            balancer=self.balancer,
            engine=engine,
            model=model,
            transformer=self.transformer,
            predict=self.model_adapter.predict,
            sigmas=self.train_sigmas,
            settings=self._loss_settings,
            backend=self.backend,
            noise_generator=self._generator(2, self._global_batch_index(batch.index)),
            autocast=self._autocast,
            scale=scale,
            device=self.accelerator.device,
        )
        if result.skipped:
            self.nonfinite_guard.flag(result.skipped)
        self._observe(result, batch, num_train)
        for row in pair_metrics(result, self.balancer, self.state.global_step, batch.last):
            self._append_metrics(row)
        self._step_timer["train"] += time.perf_counter() - start
        return result.total * scale
