"""End-to-end and integration tests of MarbleDiffusionNFTTrainer on the tiny offline pipeline."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from datasets import Dataset
from tiny import brightness, contrast, trainer_args

from marble_trl import MarbleDiffusionNFTTrainer
from marble_trl.data.prompts import load_prompt_dataset
from marble_trl.policy.lora import OLD_ADAPTER, TRAIN_ADAPTER
from marble_trl.rewards import RewardError

tiny_args = trainer_args  # this file's config: tests/tiny.py


def history(trainer, key):
    return [h[key] for h in trainer.state.log_history if key in h]


def test_constructs_and_trains_with_CI_unset(tmp_path, monkeypatch):
    # TRL's telemetry crashes on diffusers models outside CI (it reads model.config.model_type).
    monkeypatch.delenv("CI", raising=False)
    monkeypatch.delenv("HF_HUB_DISABLE_TELEMETRY", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    trainer = MarbleDiffusionNFTTrainer(
        "tiny", brightness, args=tiny_args(tmp_path, max_steps=1), train_dataset=load_prompt_dataset()
    )
    trainer.train()
    assert trainer.state.global_step == 1


def test_only_lora_changes_and_brightness_rises(tmp_path):
    args = tiny_args(tmp_path, max_steps=8, beta=0.0)
    trainer = MarbleDiffusionNFTTrainer("tiny", brightness, args=args, train_dataset=load_prompt_dataset())
    before = {n: p.detach().clone() for n, p in trainer.transformer.named_parameters()}
    frozen = {
        name: {n: p.detach().clone() for n, p in getattr(trainer.pipeline, name).named_parameters()}
        for name in ("vae", "text_encoder", "text_encoder_2")
    }
    trainer.train()

    after = dict(trainer.transformer.named_parameters())
    changed = {n for n in before if not torch.equal(before[n], after[n])}
    assert changed, "training changed nothing"
    assert all(f".{TRAIN_ADAPTER}." in n or f".{OLD_ADAPTER}." in n for n in changed), sorted(changed)[:3]
    assert any(f".{TRAIN_ADAPTER}." in n for n in changed)
    assert any(f".{OLD_ADAPTER}." in n for n in changed)  # the old policy followed
    for name, params in frozen.items():
        for n, p in getattr(trainer.pipeline, name).named_parameters():
            assert torch.equal(p, params[n]), f"{name}.{n} changed"

    curve = history(trainer, "rewards/brightness/mean")
    assert len(curve) == 8
    # The group std of brightness is ~0.0015 here; 8 steps must move the mean well beyond that.
    assert sum(curve[-2:]) / 2 > curve[0] + 0.003, curve
    for key in (
        "loss",
        "kl",
        "reward",
        "reward_std",
        "frac_reward_zero_std",
        "rewards/brightness/std",
        "time/rollout",
        "time/train",
        "nft/loss_pos",
        "nft/loss_neg",
    ):
        assert history(trainer, key), f"metric {key} was not logged"


def test_marble_refresh_and_amortised_steps(tmp_path):
    args = tiny_args(tmp_path, max_steps=3, marble_refresh_interval=2)
    trainer = MarbleDiffusionNFTTrainer("tiny", [brightness, contrast], args=args, train_dataset=load_prompt_dataset())
    assert trainer.aggregation == "marble"
    trainer.train()
    assert trainer.balancer.num_refreshes == 2  # steps 0 and 2
    worst = history(trainer, "marble/worst_cos")
    assert len(worst) == 2
    # Eq. 7 with the min-norm alpha*: the update conflicts with no reward.
    assert all(w >= -1e-5 for w in worst), worst
    alphas = [history(trainer, f"marble/alpha/{n}") for n in ("brightness", "contrast")]
    for a, b in zip(*alphas):
        assert a >= 0 and b >= 0 and math.isclose(a + b, 1.0, abs_tol=1e-9)


def test_amortised_gradient_equals_alpha_weighted_per_reward_gradients(tmp_path):
    """Prop. 1 through the whole trainer: the one-backward A_bar step equals sum_k alpha_k g_k (+ KL)."""
    args = tiny_args(tmp_path, max_steps=1, beta=0.0, marble_gradient_engine="reference")
    trainer = MarbleDiffusionNFTTrainer("tiny", [brightness, contrast], args=args, train_dataset=load_prompt_dataset())
    state = trainer.balancer.state_dict()
    state["alpha_bar"] = [0.8, 0.2]
    trainer.balancer.load_state_dict(state)
    trainer.state.global_step = 1  # an amortised step (refresh interval 10)
    trainer.create_optimizer_and_scheduler(num_training_steps=1)
    loader = trainer.get_train_dataloader()
    it = iter(loader)
    micro = trainer.get_batch_samples(it, args.gradient_accumulation_steps, trainer.args.device)[0]
    assert all(mb.plan.mode == "amortised" for mb in micro)
    trainer.current_gradient_accumulation_steps = len(micro)
    model = trainer.model
    model.zero_grad()
    for mb in micro:
        trainer.training_step(model, mb)
    params = list(trainer.trainable_parameters().values())
    amortised = torch.cat([p.grad.reshape(-1) for p in params]).clone()

    model.zero_grad()
    # same batch, same noise: now with the engine
    micro = trainer.start_step(
        [dataclasses.replace(mb, plan=dataclasses.replace(mb.plan, mode="cosines")) for mb in micro]
    )
    for mb in micro:
        trainer.training_step(model, mb)
    g = trainer._gradient_engine.buffers
    weighted = 0.8 * g[0] + 0.2 * g[1]
    torch.testing.assert_close(amortised, weighted, rtol=1e-4, atol=1e-7)


def constant(prompts, images, **_):
    return [1.0] * len(prompts)


def _lora_after(tmp_path, name, rewards, **overrides):
    args = tiny_args(tmp_path / name, **overrides)
    trainer = MarbleDiffusionNFTTrainer("tiny", rewards, args=args, train_dataset=load_prompt_dataset())
    trainer.train()
    return trainer, {n: p.detach().clone() for n, p in trainer.trainable_parameters().items()}


@pytest.mark.parametrize(
    "aggregation, interval", [("sum_then_normalize", 10), ("marble", 2)], ids=["weighted_sum", "marble"]
)
def test_update_cosines_are_logged_without_changing_training(tmp_path, aggregation, interval):
    """Table S1 diagnostics: cos(update, g_k) on every non-refresh step, and the same parameters as without them."""
    rewards = [brightness, contrast, constant]
    common = dict(max_steps=3, multi_objective_aggregation=aggregation, marble_refresh_interval=interval)
    plain, lora_plain = _lora_after(tmp_path, "plain", rewards, **common)
    diag, lora_diag = _lora_after(tmp_path, "diag", rewards, log_update_cosines=True, **common)
    for name in lora_plain:
        torch.testing.assert_close(lora_diag[name], lora_plain[name], rtol=1e-5, atol=1e-7)
    assert not history(plain, "update_cos/worst")
    steps = [h["step"] for h in diag.state.log_history if "update_cos/worst" in h]
    # MARBLE refreshes at steps 0 and 2 (0-based; logged as 1 and 3) report marble/cos instead.
    assert steps == ([1, 2, 3] if aggregation != "marble" else [2])
    for h in diag.state.log_history:
        if "update_cos/worst" in h:
            cos = [h["update_cos/brightness"], h["update_cos/contrast"]]
            assert all(-1 <= c <= 1 for c in cos)
            assert h["update_cos/worst"] == pytest.approx(min(cos))
            assert h["update_cos/conflict"] == float(min(cos) < 0)
            assert math.isnan(h["update_cos/constant"])  # no signal in any group: left out
    if aggregation == "marble":
        return
    # log_update_cosines_interval: only on steps whose global step (0-based) is a multiple of it, same training.
    sparse, lora_sparse = _lora_after(
        tmp_path, "sparse", rewards, log_update_cosines=True, log_update_cosines_interval=2, **common
    )
    assert [h["step"] for h in sparse.state.log_history if "update_cos/worst" in h] == [1, 3]
    for name in lora_plain:
        torch.testing.assert_close(lora_sparse[name], lora_plain[name], rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize(
    "dataset, message",
    [
        (Dataset.from_dict({"prompt": []}), "empty"),
        (Dataset.from_dict({"text": ["a", "b"]}), "no 'prompt' column"),
        (None, "train_dataset is required"),
    ],
)
def test_bad_datasets(tmp_path, dataset, message):
    with pytest.raises((ValueError, TypeError), match=message):
        MarbleDiffusionNFTTrainer("tiny", brightness, args=tiny_args(tmp_path), train_dataset=dataset)


def _raising(prompts, images, **_):
    raise KeyError("boom")


def _short(prompts, images, **_):
    return [0.0] * (len(prompts) - 1)


def _inf(prompts, images, **_):
    return [float("inf")] + [0.0] * (len(prompts) - 1)


@pytest.mark.parametrize(
    "reward, message",
    [
        (_raising, r"Reward '_raising' raised KeyError.*prompts"),
        (_short, "returned 15 values for 16"),
        (_inf, "finite"),
    ],
)
def test_bad_rewards_fail_clearly(tmp_path, reward, message):
    trainer = MarbleDiffusionNFTTrainer(
        "tiny", reward, args=tiny_args(tmp_path, max_steps=1), train_dataset=load_prompt_dataset()
    )
    with pytest.raises(RewardError, match=message):
        trainer.train()


def test_reward_weights_length_and_unique_names(tmp_path):
    with pytest.raises(ValueError, match="reward_weights has 1 entries for 2 rewards"):
        MarbleDiffusionNFTTrainer(
            "tiny",
            [brightness, contrast],
            args=tiny_args(tmp_path, reward_weights=[1.0]),
            train_dataset=load_prompt_dataset(),
        )
    with pytest.raises(ValueError, match="unique"):
        MarbleDiffusionNFTTrainer(
            "tiny", [brightness, brightness], args=tiny_args(tmp_path), train_dataset=load_prompt_dataset()
        )


def test_missing_model_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="model_name_or_path"):
        MarbleDiffusionNFTTrainer(
            "./no/such/model", brightness, args=tiny_args(tmp_path), train_dataset=load_prompt_dataset()
        )


def test_extra_columns_reach_rewards(tmp_path):
    seen = {}

    def uses_column(prompts, images, target, **_):
        seen["pairs"] = list(zip(prompts, target))
        return [float(t == "x") for t in target]

    ds = Dataset.from_dict({"prompt": ["p0", "p1", "p2"], "target": ["x", "y", "z"]})
    trainer = MarbleDiffusionNFTTrainer("tiny", uses_column, args=tiny_args(tmp_path, max_steps=1), train_dataset=ds)
    trainer.train()
    expected = {"p0": "x", "p1": "y", "p2": "z"}
    assert seen["pairs"] and all(expected[p] == t for p, t in seen["pairs"])


def test_single_reward_weight_does_not_scale_the_advantage(tmp_path):
    ds = load_prompt_dataset()
    advantages = []
    for weights in (None, [3.0]):
        args = tiny_args(tmp_path, max_steps=1, reward_weights=weights, multi_objective_aggregation="marble")
        trainer = MarbleDiffusionNFTTrainer("tiny", brightness, args=args, train_dataset=ds)
        assert trainer.balancer is None  # one reward: plain DiffusionNFT
        micro = trainer.get_batch_samples(
            iter(trainer.get_train_dataloader()), args.gradient_accumulation_steps, None
        )[0]
        advantages.append(torch.cat([mb.advantages for mb in micro]))
    assert advantages[0].abs().max() > 0.5
    # Equal up to the 1e-4 std epsilon (brightness std here is ~1e-3); a weight that scaled A would give ratio 3.
    ratio = advantages[1].norm() / advantages[0].norm()
    assert 0.9 < ratio < 1.1, ratio
    assert torch.equal(advantages[1].sign(), advantages[0].sign())


def test_old_policy_update_interval_keeps_the_old_policy_for_n_steps(tmp_path):
    """old_policy_update_interval=2 (the reference's OCR setting: 2 optimizer steps per sampling epoch): the old
    policy moves only after every second optimizer step, so two steps roll out with the same old policy."""
    from transformers import TrainerCallback

    from marble_trl.policy.lora import lora_parameters as trainer_lora

    snapshots = []

    class Snapshot(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            t = trainer.transformer
            old = {n: p.detach().clone() for n, p in trainer_lora(t, OLD_ADAPTER).items()}
            new = {
                n.replace(f".{TRAIN_ADAPTER}.", f".{OLD_ADAPTER}."): p.detach().clone()
                for n, p in trainer_lora(t, TRAIN_ADAPTER).items()
            }
            snapshots.append((old, new))

    args = tiny_args(tmp_path, max_steps=3, old_policy_decay="on_policy", old_policy_update_interval=2)
    trainer = MarbleDiffusionNFTTrainer("tiny", brightness, args=args, train_dataset=load_prompt_dataset())
    init = {n: p.detach().clone() for n, p in trainer_lora(trainer.transformer, OLD_ADAPTER).items()}
    trainer.add_callback(Snapshot())
    trainer.train()
    (old1, new1), (old2, new2), (old3, new3) = snapshots
    assert all(torch.equal(old1[n], init[n]) for n in init)  # after step 1: not updated
    assert any(not torch.equal(new1[n], init[n]) for n in init)
    assert all(torch.equal(old2[n], new2[n]) for n in init)  # after step 2: eta = 0 copies the trained adapter
    assert all(torch.equal(old3[n], old2[n]) for n in init)  # after step 3: not updated
    assert any(not torch.equal(new3[n], new2[n]) for n in init)
    decays = [h.get("old_policy/decay") for h in trainer.state.log_history if "loss" in h]
    assert decays == [None, 0.0, None]


def test_old_policy_update_interval_must_be_positive(tmp_path):
    with pytest.raises(ValueError, match="old_policy_update_interval must be >= 1"):
        tiny_args(tmp_path, old_policy_update_interval=0)
