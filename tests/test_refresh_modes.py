"""MARBLE's refreshes solved first (``marble_refresh_subset``, DeepSpeed) and norm-aware amortised steps, through the
trainer: Prop. 1 identities against explicit per-reward gradients, and the exact refresh reproduced."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from tiny import brightness, contrast, small_args
from transformers import TrainerCallback

from marble_trl import MarbleDiffusionNFTTrainer
from marble_trl.data.prompts import load_prompt_dataset
from marble_trl.trainer.solve_first import subset_pairs

REWARDS = [brightness, contrast]


def _trainer(tmp_path, **overrides) -> MarbleDiffusionNFTTrainer:
    args = small_args(tmp_path, param_ema=False, **overrides)
    return MarbleDiffusionNFTTrainer("tiny", REWARDS, args=args, train_dataset=load_prompt_dataset())


def _lora(trainer) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in trainer.trainable_parameters().items()}


def _step_batches(trainer, step: int):
    """The micro-batches of optimizer step ``step`` (0-based), planned as the trainer plans them."""
    trainer.state.global_step = step
    trainer.create_optimizer_and_scheduler(num_training_steps=1)
    it = iter(trainer.get_train_dataloader())
    micro = trainer.get_batch_samples(it, trainer.args.gradient_accumulation_steps, trainer.args.device)[0]
    trainer.current_gradient_accumulation_steps = len(micro)
    return micro


def _grad_of(trainer, micro) -> torch.Tensor:
    trainer.model.zero_grad()
    for mb in micro:
        trainer.training_step(trainer.model, mb)
    return torch.cat([p.grad.reshape(-1) for p in trainer.trainable_parameters().values()]).clone()


def _full_per_reward_gradients(trainer) -> torch.Tensor:
    """The K per-reward gradients of the whole step (every pair), on the same batch and noise: the step's micro-batches
    as the session holds them, planned for the cosine diagnostic."""
    micro = [
        dataclasses.replace(mb, plan=dataclasses.replace(mb.plan, mode="cosines")) for mb in trainer.session.batches
    ]
    _grad_of(trainer, trainer.start_step(micro))
    return trainer._gradient_engine.buffers.clone()


def test_subset_pairs_spread_over_micro_batches_first():
    assert subset_pairs(3, 4, 0) == [4, 4, 4]  # 0: every pair
    assert subset_pairs(3, 4, 99) == [4, 4, 4]
    assert subset_pairs(3, 4, 1) == [1, 0, 0]
    assert subset_pairs(3, 4, 5) == [2, 2, 1]
    assert sum(subset_pairs(2, 3, 4)) == 4


def test_solve_first_on_every_pair_reproduces_the_exact_refresh(tmp_path):
    """Eq. 7 formed by Prop. 1 after solving first equals Eq. 7 written into .grad (3 steps, 2 refreshes, KL on)."""
    common = dict(max_steps=3, optim="sgd", learning_rate=1.0, beta=1e-4)
    exact = _trainer(tmp_path / "exact", **common)
    exact.train()
    first = _trainer(tmp_path / "first", marble_refresh_subset=10**6, **common)
    first.train()
    init = _trainer(tmp_path / "init", **common)
    a, b, a0 = _lora(exact), _lora(first), _lora(init)
    assert max((a[n] - a0[n]).abs().max().item() for n in a) > 1e-2  # it trained
    for name in a:
        torch.testing.assert_close(b[name], a[name], rtol=1e-5, atol=1e-6)
    assert exact.balancer.state_dict()["num_refreshes"] == first.balancer.state_dict()["num_refreshes"] == 2
    np.testing.assert_allclose(first.balancer.alpha_bar, exact.balancer.alpha_bar, rtol=1e-5)
    np.testing.assert_allclose(first.balancer.last_grad_norms, exact.balancer.last_grad_norms, rtol=1e-4)
    pairs = [h["marble/refresh_pairs"] for h in first.state.log_history if "marble/refresh_pairs" in h]
    assert pairs == [2.0, 2.0]  # 2 micro-batches x 1 training timestep
    # The logged loss means the same whichever way the refresh was formed (DeepSpeed solves first too).
    losses = [[h["loss"] for h in t.state.log_history if "loss" in h] for t in (exact, first)]
    np.testing.assert_allclose(losses[1], losses[0], rtol=1e-5)


@pytest.mark.parametrize("subset", [1, 2])
def test_estimated_refresh_is_the_solved_coefficients_on_the_whole_steps_gradients(tmp_path, subset):
    """With a subset, the step's one ordinary backward is sum_k c_k g_k over every pair, c solved on the subset."""
    trainer = _trainer(tmp_path, beta=0.0, num_sample_steps=4, timestep_fraction=0.5, marble_refresh_subset=subset)
    micro = _step_batches(trainer, 0)  # a refresh
    assert all(mb.plan.mode == "solve_first" for mb in micro)
    pairs = len(micro) * micro[0].timestep_index.shape[1]
    assert pairs == 4 > subset
    update = _grad_of(trainer, micro)
    assert all(mb.plan.mode == "solve_first" for mb in micro)  # the Trainer's objects are never edited: the session
    assert all(mb.plan.mode == "plain" for mb in trainer.session.batches)  # re-planned them for the Prop. 1 backward
    norms = np.array(trainer.balancer.last_grad_norms)
    alpha = np.array(trainer.balancer.last_alpha_star)
    coeffs = alpha * norms.mean() / norms
    assert trainer.session.plan.policy_scale == pytest.approx(coeffs.sum(), rel=1e-12)
    g = _full_per_reward_gradients(trainer)
    torch.testing.assert_close(update, (torch.as_tensor(coeffs, dtype=g.dtype) @ g), rtol=1e-4, atol=1e-7)

    # The estimate is that of the subset's pairs: micro-batch 0's first training timestep (and micro-batch 1's).
    probe = _trainer(tmp_path / "probe", beta=0.0, num_sample_steps=4, timestep_fraction=0.5)
    mbs = _step_batches(probe, 0)[:subset]  # the same rollouts and timesteps (an exact refresh's plan, replaced)
    mbs = probe.start_step(
        [
            dataclasses.replace(
                mb, timestep_index=mb.timestep_index[:, :1], plan=dataclasses.replace(mb.plan, mode="cosines"),
                last=i == subset - 1,
            )
            for i, mb in enumerate(mbs)
        ]
    )  # fmt: skip
    probe.current_gradient_accumulation_steps = subset
    _grad_of(probe, mbs)  # scale 1 / subset per pair: the solve's pairs / subset rescaling of 1 / pairs
    subset_norms = probe._gradient_engine.buffers.norm(dim=1).double().numpy()
    np.testing.assert_allclose(norms, subset_norms, rtol=1e-5)


def test_norm_aware_amortised_step_is_eq7_coefficients_on_the_batch(tmp_path):
    """Norm-aware amortisation through the trainer: one backward whose gradient is sum_k c_k g_k with
    c_k = alpha_bar_k mean||g|| / ||g_k|| from the last refresh's norms."""
    trainer = _trainer(tmp_path, beta=0.0, marble_amortised_update="norm_aware")
    state = trainer.balancer.state_dict()
    state.update(alpha_bar=[0.8, 0.2], last_grad_norms=[1.0, 4.0], num_refreshes=1)
    trainer.balancer.load_state_dict(state)
    micro = _step_batches(trainer, 1)  # an amortised step (refresh interval 2)
    assert all(mb.plan.mode == "amortised" for mb in micro)
    update = _grad_of(trainer, micro)
    g = _full_per_reward_gradients(trainer)
    torch.testing.assert_close(update, 2.0 * g[0] + 0.125 * g[1], rtol=1e-4, atol=1e-7)


def test_a_skipped_step_takes_back_its_solved_first_refresh(tmp_path):
    class FlagSecond(MarbleDiffusionNFTTrainer):
        def training_step(self, model, inputs, num_items_in_batch=None):
            loss = super().training_step(model, inputs, num_items_in_batch)
            if inputs.last:  # the refresh was solved at micro-batch 0; the step then goes bad
                self.nonfinite_guard.flag("test: a later micro-batch's loss is not finite")
            return loss

    args = small_args(tmp_path, max_steps=1, param_ema=False, marble_refresh_subset=1)
    trainer = FlagSecond("tiny", REWARDS, args=args, train_dataset=load_prompt_dataset())
    before = trainer.balancer.state_dict()
    trainer.train()
    assert trainer.nonfinite_guard.total == 1
    assert trainer.balancer.state_dict() == before  # no refresh counted, alpha_bar and norms unchanged


def test_a_step_skipped_after_its_exact_refresh_takes_it_back(tmp_path):
    """The exact refresh runs at the step's last micro-batch; the guard can still skip the step afterwards (non-finite
    gradients or update): the coefficients go back too."""

    class FlagAfterRefresh(MarbleDiffusionNFTTrainer):
        def training_step(self, model, inputs, num_items_in_batch=None):
            loss = super().training_step(model, inputs, num_items_in_batch)
            if inputs.last:
                assert self.balancer.num_refreshes == 1  # the refresh ran (exact, at this micro-batch)
                self.nonfinite_guard.flag("test: the step's gradients are not finite")
            return loss

    args = small_args(tmp_path, max_steps=1, param_ema=False)
    trainer = FlagAfterRefresh("tiny", REWARDS, args=args, train_dataset=load_prompt_dataset())
    before = trainer.balancer.state_dict()
    trainer.train()
    assert trainer.nonfinite_guard.total == 1
    assert trainer.balancer.state_dict() == before


def test_an_emergency_checkpoint_holds_the_coefficients_of_the_last_completed_step(tmp_path):
    """A step fails after its solved-first refresh moved alpha_bar: the emergency checkpoint is the last completed
    step's, so its balancer state is that step's, not the half-done refresh's."""
    import json

    class FailSecondStep(MarbleDiffusionNFTTrainer):
        def training_step(self, model, inputs, num_items_in_batch=None):
            loss = super().training_step(model, inputs, num_items_in_batch)
            if self.state.global_step == 1 and inputs.last:
                raise RuntimeError("test: step 2 fails after its refresh")
            return loss

    after_first = {}

    class Snapshot(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            after_first.setdefault("state", trainer.balancer.state_dict())

    args = small_args(tmp_path, max_steps=3, param_ema=False, marble_refresh_subset=1, marble_refresh_interval=1,
                      save_strategy="no")  # fmt: skip
    trainer = FailSecondStep("tiny", REWARDS, args=args, train_dataset=load_prompt_dataset(), callbacks=[Snapshot()])
    with pytest.raises(RuntimeError, match="step 2 fails"):
        trainer.train()
    assert trainer.balancer.num_refreshes == 1  # the failed step's refresh was taken back
    saved = json.loads((tmp_path / "checkpoint-1" / "marble_balancer.json").read_text())
    assert saved == after_first["state"]


def test_non_finite_subset_gradients_skip_the_step_and_refresh_nothing(tmp_path, monkeypatch):
    import marble_trl.trainer.solve_first as solve_first

    original = solve_first.subset_gradients

    def poisoned(batches, **kwargs):
        pairs = original(batches, **kwargs)
        kwargs["engine"].buffers[1, 0] = float("nan")
        return pairs

    monkeypatch.setattr(solve_first, "subset_gradients", poisoned)
    trainer = _trainer(tmp_path, max_steps=1, marble_refresh_subset=1, max_nonfinite_skips=3)
    before, lora = trainer.balancer.state_dict(), _lora(trainer)
    trainer.train()
    assert trainer.nonfinite_guard.total == 1
    assert trainer.balancer.state_dict() == before
    after = _lora(trainer)
    assert all(torch.equal(after[n], lora[n]) for n in lora)


def test_silent_rewards_hold_reaches_the_balancer(tmp_path):
    """The config field is the balancer's mode, so a specialist absent at a refresh keeps its alpha_bar."""
    assert _trainer(tmp_path, marble_silent_rewards="hold").balancer.silent == "hold"
    assert _trainer(tmp_path).balancer.silent == "decay"  # the default: the paper's Eq. 12 with alpha*_k = 0


def _half(prompts, images, **_):
    """Redness on prompts of even length (7 of the 16 bundled prompts), None on the others."""
    red = (images[:, 0] - images[:, 1:].mean(dim=1)).mean(dim=(1, 2)).tolist()
    return [r if len(p) % 2 == 0 else None for p, r in zip(prompts, red)]


def test_masked_solve_for_the_paper_procedure_solved_first_or_exact(tmp_path):
    """marble_masked_solve on the paper's procedure: each reward's refresh gradient averages the samples it applies to
    (micro-batches of 2 groups, one reward on half the prompts). Eq. 7 of those gradients written into .grad equals
    the solved-first update by Prop. 1 with per-sample weights, and differs from the unmasked refresh."""
    common = dict(max_steps=3, optim="sgd", learning_rate=1.0, beta=1e-4, per_device_train_batch_size=8)
    common |= dict(num_generations=4, prompts_per_step=4, param_ema=False)

    def run(name, **extra):
        args = small_args(tmp_path / name, **common, **extra)
        trainer = MarbleDiffusionNFTTrainer(
            "tiny", [brightness, _half], args=args, train_dataset=load_prompt_dataset()
        )
        trainer.train()
        return trainer

    exact = run("exact", marble_masked_solve=True)
    first = run("first", marble_masked_solve=True, marble_refresh_subset=10**6)
    plain = run("plain")
    a, b, c = _lora(exact), _lora(first), _lora(plain)
    for name in a:
        torch.testing.assert_close(b[name], a[name], rtol=1e-5, atol=1e-6)
    assert max((a[n] - c[n]).abs().max().item() for n in a) > 1e-4  # masking changes the refreshes
    np.testing.assert_allclose(first.balancer.alpha_bar, exact.balancer.alpha_bar, rtol=1e-5)
