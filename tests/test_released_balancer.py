"""The released MARBLE's balancer (``marble_trl.balance.released``) against balancer.py / mgda.py / train.py's rules,
on explicit gradients: the schedule, the EMA without a prior, every fallback, groups, MGDA weights, the floor, reward
dropout; and the config's procedure checks."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from marble_trl import MarbleDiffusionNFTConfig
from marble_trl.balance import ReleasedMarble
from marble_trl.balance.advantages import normalize_rewards
from marble_trl.policy.nft import masked_weights

NAMES = ["pickscore", "ocr", "geneval"]


def _grads(seed: int = 0, k: int = 3, p: int = 50) -> torch.Tensor:
    return torch.randn(k, p, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def test_schedule_solves_every_pair_of_the_warmup_then_the_first_pair_every_n_steps():
    bal = ReleasedMarble(NAMES, refresh_interval=10, warmup_steps=1)
    assert bal.solves(0)  # no coefficients yet
    bal.solve(_grads(), 0)
    assert bal.solves(0)  # step 0 < warmup: every pair
    assert not bal.solves(1) and not bal.solves(9)
    assert bal.solves(10)  # 10 - 0 >= N
    bal.solve(_grads(1), 10)
    assert not bal.solves(10)  # the rest of step 10 is amortised with the new coefficients
    assert bal.last_full == 10 and bal.num_solves == 2


def test_update_is_eq7_and_the_first_solve_sets_alpha_bar():
    g = _grads()
    bal = ReleasedMarble(NAMES, rho=0.7)
    solve = bal.solve(g, 0)
    norms = g.norm(dim=1)
    unit = g / norms[:, None]
    alpha = torch.as_tensor(solve.alpha)
    direction = (alpha[:, None] * unit).sum(0) * norms.mean()
    torch.testing.assert_close(torch.as_tensor(solve.coefficients) @ g, direction)
    assert solve.fallback == "none" and abs(alpha.sum().item() - 1) < 1e-9
    # KKT of min ||sum a g_hat||^2 on the simplex: every active unit gradient's inner product with d* is minimal
    d = (alpha[:, None] * unit).sum(0)
    products = unit @ d
    active = alpha > 1e-9
    assert torch.allclose(products[active], products[active].min(), atol=1e-7)
    assert (products >= (d @ d) - 1e-7).all()
    np.testing.assert_allclose(bal.alpha_bar, solve.alpha)  # no uniform prior
    second = bal.solve(_grads(3), 1)
    np.testing.assert_allclose(bal.alpha_bar, 0.7 * solve.alpha + 0.3 * second.alpha)


def test_fallbacks_enter_the_ema_without_renormalisation():
    g = _grads()
    bal = ReleasedMarble(NAMES, rho=0.7)
    first = bal.solve(g, 0)
    zero = bal.solve(torch.zeros_like(g), 1)
    assert zero.fallback == "all_zero" and not zero.coefficients.any() and zero.rescale == 0.0
    np.testing.assert_allclose(bal.alpha_bar, 0.7 * first.alpha)  # sums to 0.7: not renormalised
    single = torch.zeros_like(g)
    single[1] = g[1]
    one = bal.solve(single, 2)
    assert one.fallback == "single_valid"
    np.testing.assert_allclose(one.coefficients, [0.0, 1.0, 0.0])  # the raw gradient, not normalised
    assert one.rescale == pytest.approx(g[1].norm().item())
    assert bal.num_fallbacks == {"all_zero": 1, "single_valid": 1, "solver_failed": 0}
    tiny = g.clone()
    tiny[2] = 1e-13  # at or below grad_eps: not valid
    assert not bal.solve(tiny, 3).valid[2]


def test_groups_average_their_members_and_split_alpha_in_amortised_pairs():
    g = _grads()
    bal = ReleasedMarble(NAMES, groups={"text": ["ocr", "geneval"]})
    assert bal.qp_names == ["text", "pickscore"]
    solve = bal.solve(g, 0)
    inputs = torch.stack([(g[1] + g[2]) / 2, g[0]])
    norms = inputs.norm(dim=1)
    direction = (torch.as_tensor(solve.alpha)[:, None] * inputs / norms[:, None]).sum(0) * norms.mean()
    torch.testing.assert_close(torch.as_tensor(solve.coefficients) @ g, direction)
    w = bal.amortised_weights()
    np.testing.assert_allclose(w, [solve.alpha[1], solve.alpha[0] / 2, solve.alpha[0] / 2])


def test_mgda_weights_scale_the_unit_gradients_in_the_qp_and_the_update():
    g = _grads()
    bal = ReleasedMarble(NAMES, mgda_weights={"ocr": 2.0})
    solve = bal.solve(g, 0)
    norms = g.norm(dim=1)
    unit = g / norms[:, None] * torch.tensor([1.0, 2.0, 1.0], dtype=g.dtype)[:, None]
    alpha = torch.as_tensor(solve.alpha)
    torch.testing.assert_close(torch.as_tensor(solve.coefficients) @ g, (alpha[:, None] * unit).sum(0) * norms.mean())
    with pytest.raises(ValueError, match="marble_mgda_weights names \\['clip'\\]"):
        ReleasedMarble(NAMES, mgda_weights={"clip": 1.0})


def test_alpha_floor_bounds_every_alpha_and_is_capped_at_one_over_k():
    g = torch.zeros(3, 4, dtype=torch.float64)
    g[0, 0], g[1, 1] = 1.0, 2.0
    g[2, 0] = g[2, 1] = 3.0  # along (e1 + e2): the min-norm point is (1/2, 1/2, 0)
    floored = ReleasedMarble(NAMES, alpha_floor=0.2).solve(g, 0)
    assert (floored.alpha >= 0.2 - 1e-9).all() and abs(floored.alpha.sum() - 1) < 1e-9
    free = ReleasedMarble(NAMES).solve(g, 0)
    np.testing.assert_allclose(free.alpha, [0.5, 0.5, 0.0], atol=1e-9)
    capped = ReleasedMarble(NAMES, alpha_floor=0.9).solve(g, 0)
    np.testing.assert_allclose(capped.alpha, [1 / 3] * 3, atol=1e-6)


def test_reward_dropout_is_seeded_by_step_and_slot_and_removes_non_target_samples():
    bal = ReleasedMarble(NAMES, dropout_targets=["pickscore"], dropout_prob=0.5, dropout_warmup_steps=10)
    assert not bal.dropped(0, 0).any()  # p = 0 at step 0 (warm-up)
    draws = [bal.dropped(20, slot)[0] for slot in range(40)]
    assert 5 < sum(draws) < 35 and draws == [bal.dropped(20, slot)[0] for slot in range(40)]  # seeded
    expected = [torch.rand(1, generator=torch.Generator().manual_seed(20_000 + s)).item() < 0.5 for s in range(40)]
    assert draws == expected  # train.py's generator: seed 1000 step + slot, one draw per target
    applicable = torch.tensor([[True, True, True, True], [False, True, False, False], [False, False, True, False]])
    masks = bal.sample_masks(applicable, np.array([True, False, False]))
    assert masks[0].tolist() == [True, False, False, True]  # pickscore loses the ocr / geneval samples
    assert torch.equal(masks[1:], applicable[1:])


def test_masked_weights_average_each_reward_over_its_samples():
    masks = torch.tensor([[True, True, True, True], [True, False, False, False], [False, False, False, False]])
    w = masked_weights(masks)
    # sum_i w_ki l_i / B = mean over the applicable samples (0 for a reward that applies to none)
    torch.testing.assert_close(w, torch.tensor([[1.0] * 4, [4.0, 0, 0, 0], [0.0] * 4]))


def test_state_round_trips_and_checks_the_rewards():
    bal = ReleasedMarble(NAMES)
    bal.solve(_grads(), 0)
    other = ReleasedMarble(NAMES)
    other.load_state_dict(bal.state_dict())
    assert other.state_dict() == bal.state_dict()
    np.testing.assert_array_equal(other.amortised_weights(), bal.amortised_weights())
    with pytest.raises(ValueError, match="state is for rewards"):
        ReleasedMarble(NAMES[:2]).load_state_dict(bal.state_dict())
    with pytest.raises(ValueError, match="not finite"):
        bal.solve(torch.full((3, 5), float("nan")), 1)
    assert bal.num_solves == 1  # nothing changed


def test_batch_scaling_is_the_released_stat_tracker():
    """stat_tracking.py with global_std: per-prompt mean, population std of every valid reward of the batch + 1e-4,
    NaN (not applicable) -> advantage 0."""
    g = torch.Generator().manual_seed(0)
    rewards = torch.rand(2, 12, generator=g, dtype=torch.float64)
    rewards[1, ::3] = float("nan")
    ours = normalize_rewards(rewards, 4, "batch").double()
    for k in range(2):
        r = rewards[k].numpy()
        sigma = np.std(r[~np.isnan(r)]) + 1e-4
        for start in range(0, 12, 4):
            group = r[start : start + 4]
            expected = (group - np.nanmean(group)) / sigma
            np.testing.assert_allclose(ours[k, start : start + 4].numpy(), np.nan_to_num(expected), rtol=1e-6)


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        ({"marble_procedure": "released", "marble_refresh_subset": 4}, "marble_refresh_subset.*belong to"),
        ({"marble_procedure": "released", "log_update_cosines": True}, "log_update_cosines"),
        ({"marble_alpha_floor": 0.1}, "marble_alpha_floor.*belong to marble_procedure='released'"),
        ({"marble_procedure": "released", "multi_objective_aggregation": "upgrad"}, "needs multi_objective_agg"),
        ({"marble_procedure": "paper-ish"}, "marble_procedure must be one of"),
    ],
)
def test_config_refuses_knobs_of_the_other_procedure(overrides, match, tmp_path):
    with pytest.raises(ValueError, match=match):
        MarbleDiffusionNFTConfig(output_dir=str(tmp_path), num_generations=8, **overrides)


def test_masked_solve_defaults_follow_the_procedure(tmp_path):
    small = dict(output_dir=str(tmp_path), num_generations=8)
    assert MarbleDiffusionNFTConfig(**small, marble_procedure="released").marble_masked_solve
    assert not MarbleDiffusionNFTConfig(**small).marble_masked_solve
    groups = MarbleDiffusionNFTConfig(
        **small, marble_procedure="released", marble_reward_groups='{"text": ["ocr", "geneval"]}'
    ).marble_reward_groups
    assert groups == {"text": ["ocr", "geneval"]}
