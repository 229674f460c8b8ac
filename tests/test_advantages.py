"""Property tests of the multi-reward advantage collator (MARBLE Eq. 3; TRL GRPO's multi-objective aggregation)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from marble_trl.balance.advantages import STD_EPS, collate_advantages, group_std_is_zero, normalize_rewards

NAN = float("nan")


# ---------------------------------------------------------------- hand computations (numpy, one group at a time)


def hand_normalize(rewards: np.ndarray, g: int, scale: str) -> np.ndarray:
    """One reward row ``[B]``: group mean (and std) over the applicable (non-NaN) entries only; n/a -> 0."""
    rewards = np.asarray(rewards, dtype=np.float64)
    out = np.zeros_like(rewards)
    applicable = rewards[~np.isnan(rewards)]
    batch_std = applicable.std() if applicable.size else 0.0
    for start in range(0, rewards.size, g):
        grp = rewards[start : start + g]
        ok = ~np.isnan(grp)
        if not ok.any():
            continue
        centred = grp[ok] - grp[ok].mean()
        if scale == "group":
            centred = centred / (grp[ok].std() + STD_EPS)
        elif scale == "batch":
            centred = centred / (batch_std + STD_EPS)
        out[start : start + g][ok] = centred
    return out


def as_t(x) -> torch.Tensor:
    return torch.as_tensor(np.asarray(x, dtype=np.float64))


def close(got: torch.Tensor, want: np.ndarray, rtol: float = 1e-5, atol: float = 1e-6) -> None:
    np.testing.assert_allclose(got.double().numpy(), want, rtol=rtol, atol=atol)


def random_rewards(seed: int, shape, nan_frac: float = 0.0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    r = rng.normal(size=shape) * rng.uniform(0.5, 3.0) + rng.normal() * 4
    r[rng.uniform(size=shape) < nan_frac] = np.nan
    return r


# ---------------------------------------------------------------- normalize_rewards


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
@pytest.mark.parametrize("g,groups", [(2, 3), (4, 5), (24, 2)])
def test_normalize_matches_hand_computation(scale, g, groups):
    rewards = random_rewards(g * groups, g * groups)
    adv = normalize_rewards(as_t(rewards), g, scale)
    assert adv.shape == (g * groups,) and adv.dtype == torch.float32
    close(adv, hand_normalize(rewards, g, scale))


def test_group_scaling_gives_zero_mean_unit_population_std_per_group():
    g = 6
    rewards = random_rewards(0, 4 * g)
    adv = normalize_rewards(as_t(rewards), g, "group").double().view(4, g)
    stds = torch.as_tensor(rewards).view(4, g).std(dim=1, unbiased=False)
    torch.testing.assert_close(adv.mean(1), torch.zeros(4, dtype=torch.float64), rtol=0, atol=1e-6)
    torch.testing.assert_close(adv.std(1, unbiased=False), stds / (stds + STD_EPS), rtol=1e-6, atol=0)
    assert (adv.std(1, unbiased=False) - 1).abs().max() < 1e-3  # population std, not the unbiased one


def test_batch_scaling_uses_one_std_for_all_groups():
    g = 4
    rewards = np.concatenate([np.array([0.0, 1.0, 2.0, 3.0]), np.array([10.0, 30.0, 50.0, 70.0])])
    adv = normalize_rewards(as_t(rewards), g, "batch")
    std = rewards.std()
    close(adv, np.concatenate([rewards[:4] - 1.5, rewards[4:] - 40.0]) / (std + STD_EPS))
    # the two groups keep their relative spread: group 2 is 20 times wider
    a = adv.view(2, g)
    torch.testing.assert_close(a[1], 20 * a[0], rtol=1e-5, atol=0)


def test_none_scaling_only_centres():
    rewards = np.array([1.0, 2.0, 6.0, -3.0, -3.0, 0.0])
    close(normalize_rewards(as_t(rewards), 3, "none"), np.array([-2.0, -1.0, 3.0, -1.0, -1.0, 2.0]))


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_nan_entries_get_zero_and_are_excluded_from_statistics(scale):
    g = 5
    rewards = random_rewards(3, 4 * g)
    rewards[[0, 3, 7, 11, 12, 13]] = np.nan
    adv = normalize_rewards(as_t(rewards), g, scale)
    assert torch.isfinite(adv).all()
    assert (adv[torch.as_tensor(np.isnan(rewards))] == 0).all()
    close(adv, hand_normalize(rewards, g, scale))
    # the applicable subset of group 0, normalised on its own
    sub = rewards[:g][~np.isnan(rewards[:g])]
    if scale == "group":
        close(adv[:g][~torch.as_tensor(np.isnan(rewards[:g]))], (sub - sub.mean()) / (sub.std() + STD_EPS))


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_all_nan_group_gives_zero(scale):
    rewards = np.array([NAN, NAN, NAN, 1.0, 2.0, 4.0])
    adv = normalize_rewards(as_t(rewards), 3, scale)
    assert (adv[:3] == 0).all()
    close(adv, hand_normalize(rewards, 3, scale))
    assert (normalize_rewards(as_t(np.full(6, NAN)), 3, scale) == 0).all()


@pytest.mark.parametrize("scale", ["group", "batch"])
def test_zero_std_group_is_finite_and_zero_for_exact_values(scale):
    rewards = np.array([0.5, 0.5, 0.5, 0.5, 1.0, 2.0, 3.0, 4.0, 7.0, 7.0, NAN, 7.0])
    adv = normalize_rewards(as_t(rewards), 4, scale)
    assert torch.isfinite(adv).all()
    assert (adv[:4] == 0).all() and (adv[8:] == 0).all()
    assert (adv[4:8] != 0).all()
    assert group_std_is_zero(as_t(rewards), 4).tolist() == [True, False, True]


@pytest.mark.parametrize("value,g", [(0.1, 3), (0.7, 3)])
def test_equal_rewards_give_exactly_zero_advantage(value, g):
    adv = normalize_rewards(torch.full((2 * g,), value, dtype=torch.float64), g, "group")
    assert (adv == 0).all(), adv.tolist()


@pytest.mark.parametrize("scale,shift", [(3.0, 0.0), (0.5, 0.0), (1.0, -17.5), (250.0, 1e3)])
def test_group_scaling_is_invariant_to_positive_affine_maps(scale, shift):
    g = 8
    rewards = random_rewards(11, 3 * g)  # group stds ~ 1 >> 1e-4
    base = normalize_rewards(as_t(rewards), g, "group")
    moved = normalize_rewards(as_t(scale * rewards + shift), g, "group")
    torch.testing.assert_close(moved, base, rtol=2e-3, atol=2e-4)
    batch_base = normalize_rewards(as_t(rewards), g, "batch")
    torch.testing.assert_close(
        normalize_rewards(as_t(scale * rewards + shift), g, "batch"), batch_base, rtol=2e-3, atol=2e-4
    )


def test_negative_scale_flips_the_sign():
    rewards = random_rewards(2, 12)
    base = normalize_rewards(as_t(rewards), 4, "group")
    torch.testing.assert_close(normalize_rewards(as_t(-rewards), 4, "group"), -base, rtol=1e-6, atol=1e-6)


def test_none_scaling_is_shift_invariant_but_not_scale_invariant():
    rewards = random_rewards(5, 12)
    base = normalize_rewards(as_t(rewards), 4, "none")
    torch.testing.assert_close(normalize_rewards(as_t(rewards + 42.0), 4, "none"), base, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(normalize_rewards(as_t(2 * rewards), 4, "none"), 2 * base, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_k_by_b_input_is_handled_row_by_row(scale):
    g, k = 3, 4
    rewards = random_rewards(8, (k, 4 * g), nan_frac=0.2)
    rewards[1] *= 100  # very different scales per reward must not leak across rows
    adv = normalize_rewards(as_t(rewards), g, scale)
    assert adv.shape == (k, 4 * g)
    for i in range(k):
        torch.testing.assert_close(adv[i], normalize_rewards(as_t(rewards[i]), g, scale), rtol=0, atol=0)
        close(adv[i], hand_normalize(rewards[i], g, scale))
    three_d = normalize_rewards(as_t(rewards).view(2, 2, 4 * g), g, scale)
    torch.testing.assert_close(three_d.view(k, -1), adv, rtol=0, atol=0)


def test_batch_not_a_multiple_of_the_group_raises():
    with pytest.raises(ValueError, match="not a whole number of groups of 4"):
        normalize_rewards(torch.randn(10), 4)
    with pytest.raises(ValueError, match="groups"):
        normalize_rewards(torch.randn(2, 7), 2, "batch")


def test_unknown_scale_raises():
    with pytest.raises(ValueError, match="scale_rewards"):
        normalize_rewards(torch.randn(4), 2, "global")


# ---------------------------------------------------------------- collate_advantages


def hand_sum_then_normalize(rewards: np.ndarray, weights: np.ndarray, g: int, scale: str) -> np.ndarray:
    summed = np.nansum(rewards * weights[:, None], axis=0)
    summed[np.isnan(rewards).all(axis=0)] = np.nan
    return hand_normalize(summed, g, scale)


def hand_normalize_then_sum(rewards: np.ndarray, weights: np.ndarray, g: int) -> np.ndarray:
    per = np.stack([hand_normalize(row, g, "group") for row in rewards])
    summed = (per * weights[:, None]).sum(axis=0)
    ok = ~np.isnan(rewards).all(axis=0)
    out = np.zeros_like(summed)
    out[ok] = (summed[ok] - summed[ok].mean()) / (summed[ok].std() + STD_EPS)
    return out


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
@pytest.mark.parametrize("weights", [None, [2.0, 0.5, 1.0]])
def test_sum_then_normalize(scale, weights):
    g = 4
    rewards = random_rewards(21, (3, 3 * g), nan_frac=0.15)
    rewards[:, 5] = np.nan  # no reward applies to sample 5
    w = np.ones(3) if weights is None else np.array(weights)
    out = collate_advantages(as_t(rewards), g, scale, reward_weights=weights, aggregation="sum_then_normalize")
    close(out.combined, hand_sum_then_normalize(rewards, w, g, scale))
    assert out.combined[5] == 0
    close(out.per_reward, np.stack([hand_normalize(row, g, scale) for row in rewards]))


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
@pytest.mark.parametrize("weights", [None, [2.0, 0.5, 1.0]])
def test_normalize_then_sum(scale, weights):
    g = 4
    rewards = random_rewards(22, (3, 3 * g), nan_frac=0.15)
    rewards[:, 2] = np.nan
    w = np.ones(3) if weights is None else np.array(weights)
    out = collate_advantages(as_t(rewards), g, scale, reward_weights=weights, aggregation="normalize_then_sum")
    close(out.combined, hand_normalize_then_sum(rewards, w, g))
    assert out.combined[2] == 0
    # batch-level normalisation of the sum: zero mean, unit std over the applicable samples
    ok = torch.as_tensor(~np.isnan(rewards).all(axis=0))
    assert abs(float(out.combined[ok].double().mean())) < 1e-5
    assert abs(float(out.combined[ok].double().std(unbiased=False)) - 1) < 1e-3


def test_weights_change_the_combined_advantage():
    g = 4
    rewards = random_rewards(23, (2, 2 * g))
    for aggregation in ("sum_then_normalize", "normalize_then_sum", "marble"):
        plain = collate_advantages(as_t(rewards), g, aggregation=aggregation).combined
        weighted = collate_advantages(as_t(rewards), g, reward_weights=[1.0, 5.0], aggregation=aggregation).combined
        assert not torch.allclose(plain, weighted, atol=1e-3), aggregation
        only_first = collate_advantages(as_t(rewards), g, reward_weights=[1.0, 0.0], aggregation=aggregation)
        if aggregation == "sum_then_normalize":
            torch.testing.assert_close(
                only_first.combined, normalize_rewards(as_t(rewards[0]), g), rtol=1e-5, atol=1e-6
            )


def test_other_aggregations_combine_the_per_reward_advantages_linearly():
    g = 3
    rewards = random_rewards(24, (3, 4 * g), nan_frac=0.1)
    w = [0.2, 0.3, 0.5]
    out = collate_advantages(as_t(rewards), g, "group", reward_weights=w, aggregation="marble")
    expected = (out.per_reward.double() * torch.tensor(w, dtype=torch.float64)[:, None]).sum(0)
    torch.testing.assert_close(out.combined.double(), expected, rtol=1e-6, atol=1e-7)


def test_single_reward_sum_then_normalize_equals_normalize():
    rewards = random_rewards(25, (1, 8), nan_frac=0.2)
    out = collate_advantages(as_t(rewards), 4, "group", aggregation="sum_then_normalize")
    torch.testing.assert_close(out.combined, out.per_reward[0], rtol=1e-6, atol=1e-7)
