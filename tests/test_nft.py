"""Property tests of the DiffusionNFT loss pieces (METHOD.md section 1, step 3; MARBLE Prop. 1)."""

from __future__ import annotations

import itertools

import pytest
import torch

from marble_trl.policy.nft import (
    DECAY_TYPES,
    add_noise,
    advantage_to_r,
    nft_loss,
    nft_loss_terms,
    nft_policy_loss,
    old_policy_decay,
    param_ema_decay,
)

A_MAX = 5.0
SHAPES = [(3, 5), (2, 4, 3, 3), (4, 2, 6)]
NFT_BETAS = [1.0, 0.1, 0.7]


# ---------------------------------------------------------------- independent re-derivation from METHOD.md


def reference_terms(v_th, v_old, x_t, x0, t, nft_beta, v_ref=None, floor=1e-5):
    """METHOD.md section 1.3 written from scratch on flattened samples: returns (L_pos, L_neg, KL) per sample."""
    b = v_th.shape[0]
    v_th, v_old, x_t, x0 = (z.reshape(b, -1) for z in (v_th, v_old, x_t, x0))
    v_old = v_old.detach()
    v_pos = v_old + nft_beta * (v_th - v_old)
    v_neg = v_old - nft_beta * (v_th - v_old)
    err_pos = x_t - t[:, None] * v_pos - x0
    err_neg = x_t - t[:, None] * v_neg - x0
    n = err_pos.shape[1]
    w_pos = torch.maximum(err_pos.detach().abs().sum(1) / n, torch.full((b,), floor, dtype=err_pos.dtype))
    w_neg = torch.maximum(err_neg.detach().abs().sum(1) / n, torch.full((b,), floor, dtype=err_neg.dtype))
    l_pos = (err_pos * err_pos).sum(1) / n / w_pos
    l_neg = (err_neg * err_neg).sum(1) / n / w_neg
    kl = torch.zeros(b, dtype=v_th.dtype) if v_ref is None else ((v_th - v_ref.reshape(b, -1)) ** 2).sum(1) / n
    return l_pos, l_neg, kl


def reference_loss(v_th, v_old, x_t, x0, t, adv, nft_beta, beta, v_ref=None):
    l_pos, l_neg, kl = reference_terms(v_th, v_old, x_t, x0, t, nft_beta, v_ref)
    r = torch.clamp(0.5 + torch.clamp(adv, -A_MAX, A_MAX) / (2 * A_MAX), 0.0, 1.0)
    return A_MAX / nft_beta * (r * l_pos + (1 - r) * l_neg).mean() + beta * kl.mean()


def make_batch(shape, seed, with_ref=True):
    gen = torch.Generator().manual_seed(seed)

    def rnd(*s):
        return torch.randn(*s, generator=gen, dtype=torch.float64)

    b = shape[0]
    x0, noise = rnd(*shape), rnd(*shape)
    t = torch.rand(b, generator=gen, dtype=torch.float64) * 0.9 + 0.05
    x_t = add_noise(x0, noise, t)
    v_old = noise - x0 + 0.3 * rnd(*shape)
    v_th = v_old + 0.2 * rnd(*shape)
    v_ref = v_old + 0.1 * rnd(*shape) if with_ref else None
    adv = rnd(b) * 1.5
    return dict(v_th=v_th, v_old=v_old, x_t=x_t, x0=x0, t=t, v_ref=v_ref, adv=adv)


def leaf(x):
    return x.detach().clone().requires_grad_(True)


def grad_of(fn, v_th):
    v = leaf(v_th)
    (g,) = torch.autograd.grad(fn(v), v)
    return g


def lib_terms(batch, v_th, nft_beta):
    return nft_loss_terms(v_th, batch["v_old"], batch["x_t"], batch["x0"], batch["t"], nft_beta, v_ref=batch["v_ref"])


# ---------------------------------------------------------------- nft_loss_terms / nft_loss


@pytest.mark.parametrize("with_ref", [True, False])
@pytest.mark.parametrize("nft_beta", NFT_BETAS)
@pytest.mark.parametrize("shape", SHAPES)
def test_terms_match_independent_derivation(shape, nft_beta, with_ref):
    batch = make_batch(shape, seed=hash((shape, nft_beta)) % 1000, with_ref=with_ref)
    terms = lib_terms(batch, batch["v_th"], nft_beta)
    l_pos, l_neg, kl = reference_terms(
        batch["v_th"], batch["v_old"], batch["x_t"], batch["x0"], batch["t"], nft_beta, batch["v_ref"]
    )
    for got, want in [(terms.loss_pos, l_pos), (terms.loss_neg, l_neg), (terms.kl, kl)]:
        assert got.shape == (shape[0],)
        assert got.dtype == torch.float64
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-14)
    if with_ref:
        assert (terms.kl > 0).all()
    else:
        assert (terms.kl == 0).all()


@pytest.mark.parametrize("beta", [0.0, 1e-4, 0.5])
@pytest.mark.parametrize("with_ref", [True, False])
@pytest.mark.parametrize("nft_beta", NFT_BETAS)
@pytest.mark.parametrize("shape", SHAPES)
def test_scalar_loss_and_gradient_match_derivation(shape, nft_beta, with_ref, beta):
    batch = make_batch(shape, seed=7 + len(shape), with_ref=with_ref)
    r = advantage_to_r(batch["adv"], A_MAX)

    def lib(v):
        return nft_loss(lib_terms(batch, v, nft_beta), r, nft_beta, A_MAX, beta)

    def ref(v):
        return reference_loss(
            v, batch["v_old"], batch["x_t"], batch["x0"], batch["t"], batch["adv"], nft_beta, beta, batch["v_ref"]
        )

    torch.testing.assert_close(lib(batch["v_th"]), ref(batch["v_th"]), rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(grad_of(lib, batch["v_th"]), grad_of(ref, batch["v_th"]), rtol=1e-10, atol=1e-14)


def test_kl_weight_adds_beta_times_mean_kl():
    batch = make_batch((4, 3, 2), seed=3)
    terms = lib_terms(batch, batch["v_th"], 1.0)
    r = advantage_to_r(batch["adv"], A_MAX)
    with_kl = nft_loss(terms, r, 1.0, A_MAX, beta=0.25)
    without = nft_loss(terms, r, 1.0, A_MAX, beta=0.0)
    torch.testing.assert_close(with_kl - without, 0.25 * terms.kl.mean(), rtol=1e-12, atol=0)
    torch.testing.assert_close(without, nft_policy_loss(terms, r, 1.0, A_MAX).mean(), rtol=1e-14, atol=0)


def test_v_old_and_v_ref_receive_no_gradient():
    batch = make_batch((3, 4), seed=11)
    v_th, v_old, v_ref = leaf(batch["v_th"]), leaf(batch["v_old"]), leaf(batch["v_ref"])
    terms = nft_loss_terms(v_th, v_old, batch["x_t"], batch["x0"], batch["t"], 0.5, v_ref=v_ref)
    loss = nft_loss(terms, torch.full((3,), 0.7, dtype=torch.float64), 0.5, A_MAX, beta=1.0)
    g_th, g_old, g_ref = torch.autograd.grad(loss, [v_th, v_old, v_ref], allow_unused=True)
    assert g_th is not None and g_th.abs().sum() > 0
    assert g_old is None and g_ref is None


@pytest.mark.parametrize("nft_beta", NFT_BETAS)
def test_weights_are_stop_gradient(nft_beta):
    batch = make_batch((3, 2, 4), seed=5)
    tb = batch["t"][:, None, None]

    def err_pos(v):
        return batch["x_t"] - tb * ((1 - nft_beta) * batch["v_old"] + nft_beta * v) - batch["x0"]

    const = err_pos(batch["v_th"]).abs().mean(dim=(1, 2)).detach()  # the weight, as a plain number

    def lib(v):
        return lib_terms(batch, v, nft_beta).loss_pos.sum()

    def sg_weight(v):
        return ((err_pos(v) ** 2).mean(dim=(1, 2)) / const).sum()

    def live_weight(v):  # what a missing stop-gradient would give
        e = err_pos(v)
        return ((e**2).mean(dim=(1, 2)) / e.abs().mean(dim=(1, 2))).sum()

    g_lib = grad_of(lib, batch["v_th"])
    torch.testing.assert_close(g_lib, grad_of(sg_weight, batch["v_th"]), rtol=1e-10, atol=1e-14)
    assert not torch.allclose(g_lib, grad_of(live_weight, batch["v_th"]), rtol=1e-3, atol=0)


def test_weight_floor_applies_below_1e_minus_5():
    # t = 0 gives x0_pos = x0_neg = x_t, so the x0 error is exactly x_t - x0.
    x0 = torch.randn(2, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    delta = torch.tensor([[1e-8], [1e-3]], dtype=torch.float64) * torch.linspace(-1, 1, 8, dtype=torch.float64)
    x_t = x0 + delta
    err = x_t - x0  # delta up to rounding
    v = leaf(torch.randn(2, 8, dtype=torch.float64))
    terms = nft_loss_terms(v, v.detach(), x_t, x0, torch.zeros(2, dtype=torch.float64), 1.0)
    mse = (err**2).mean(1)
    mae = err.abs().mean(1)
    assert mae[0] < 1e-5 < mae[1]
    expected = torch.stack([mse[0] / 1e-5, mse[1] / mae[1]])
    torch.testing.assert_close(terms.loss_pos, expected, rtol=1e-12, atol=0)
    torch.testing.assert_close(terms.loss_neg, expected, rtol=1e-12, atol=0)
    custom = nft_loss_terms(v, v.detach(), x_t, x0, torch.zeros(2, dtype=torch.float64), 1.0, weight_floor=1e-2)
    torch.testing.assert_close(custom.loss_pos, mse / 1e-2, rtol=1e-12, atol=0)


def test_zero_error_is_finite_with_finite_gradient():
    x0 = torch.randn(2, 5, dtype=torch.float64)
    v = leaf(torch.randn(2, 5, dtype=torch.float64))
    terms = nft_loss_terms(v, v.detach(), x0.clone(), x0, torch.zeros(2, dtype=torch.float64), 1.0)
    assert (terms.loss_pos == 0).all() and (terms.loss_neg == 0).all()
    (g,) = torch.autograd.grad(nft_loss(terms, torch.full((2,), 0.3, dtype=torch.float64), 1.0, A_MAX, 0.0), v)
    assert torch.isfinite(g).all()


def test_reward_has_no_effect_when_theta_equals_old():
    batch = make_batch((4, 6), seed=2)
    terms = lib_terms(batch, batch["v_old"].clone(), 0.3)
    torch.testing.assert_close(terms.loss_pos, terms.loss_neg, rtol=1e-12, atol=0)
    losses = [nft_loss(terms, torch.full((4,), r, dtype=torch.float64), 0.3, A_MAX, 0.0) for r in (0.0, 0.5, 1.0)]
    torch.testing.assert_close(losses[0], losses[2], rtol=1e-14, atol=0)


# ---------------------------------------------------------------- affine identity (MARBLE Prop. 1)


def simplex(k, gen):
    a = torch.rand(k, generator=gen, dtype=torch.float64) + 0.05
    return a / a.sum()


def per_reward_and_bar(batch, nft_beta, alpha, advs):
    """sum_k alpha_k l(A_k) and l(sum_k alpha_k A_k) as per-sample losses, and the two batch-mean gradients."""

    def mixed(v):
        terms = lib_terms(batch, v, nft_beta)
        return sum(
            a * nft_policy_loss(terms, advantage_to_r(adv, A_MAX), nft_beta, A_MAX) for a, adv in zip(alpha, advs)
        )

    def bar(v):
        a_bar = (alpha[:, None] * advs).sum(0)
        return nft_policy_loss(lib_terms(batch, v, nft_beta), advantage_to_r(a_bar, A_MAX), nft_beta, A_MAX)

    v = batch["v_th"]
    return mixed(v), bar(v), grad_of(lambda x: mixed(x).mean(), v), grad_of(lambda x: bar(x).mean(), v)


@pytest.mark.parametrize("k,nft_beta,seed", list(itertools.product([2, 3, 5], [1.0, 0.1], [0, 1])))
def test_affine_identity_holds_inside_the_clip(k, nft_beta, seed):
    gen = torch.Generator().manual_seed(100 + seed)
    batch = make_batch((6, 3, 4), seed=seed)
    alpha = simplex(k, gen)
    advs = (torch.rand(k, 6, generator=gen, dtype=torch.float64) * 2 - 1) * (A_MAX - 1e-3)
    mixed, bar, g_mixed, g_bar = per_reward_and_bar(batch, nft_beta, alpha, advs)
    torch.testing.assert_close(mixed, bar, rtol=1e-12, atol=1e-13)
    torch.testing.assert_close(g_mixed, g_bar, rtol=1e-10, atol=1e-14)


def test_affine_identity_holds_on_simplex_vertices_and_edges():
    batch = make_batch((4, 5), seed=9)
    advs = torch.tensor([[4.9, -4.9, 0.0, 1.0], [-2.0, 3.0, 4.99, -4.99]], dtype=torch.float64)
    for alpha in ([1.0, 0.0], [0.0, 1.0], [0.5, 0.5]):
        mixed, bar, g_mixed, g_bar = per_reward_and_bar(batch, 0.5, torch.tensor(alpha, dtype=torch.float64), advs)
        torch.testing.assert_close(mixed, bar, rtol=1e-12, atol=1e-13)
        torch.testing.assert_close(g_mixed, g_bar, rtol=1e-10, atol=1e-14)


def test_affine_identity_breaks_once_a_clamp_is_active():
    """Why clamp violations are counted: with |A_k| > A_max the amortised update is not the combined one."""
    batch = make_batch((4, 3, 3), seed=4)
    alpha = torch.tensor([0.5, 0.5], dtype=torch.float64)
    advs = torch.tensor([[8.0, -7.0, 6.0, 0.5], [-2.0, 1.0, 3.0, -0.5]], dtype=torch.float64)
    mixed, bar, g_mixed, g_bar = per_reward_and_bar(batch, 1.0, alpha, advs)
    clamped = (advs.abs() > A_MAX).any(0)
    gap = (mixed - bar).abs()
    assert (gap[clamped] > 1e-3 * bar[clamped].abs()).all()
    torch.testing.assert_close(mixed[~clamped], bar[~clamped], rtol=1e-12, atol=1e-13)
    assert not torch.allclose(g_mixed, g_bar, rtol=1e-6, atol=0)


# ---------------------------------------------------------------- advantage_to_r


def test_advantage_to_r_anchor_values():
    adv = torch.tensor([0.0, -A_MAX, A_MAX, 2.5, -1.0], dtype=torch.float64)
    expected = torch.tensor([0.5, 0.0, 1.0, 0.75, 0.4], dtype=torch.float64)
    torch.testing.assert_close(advantage_to_r(adv, A_MAX), expected, rtol=0, atol=1e-15)


def test_advantage_to_r_clamps_beyond_the_clip():
    adv = torch.tensor([-1e9, -5.01, -100.0, 5.01, 77.0, float("inf"), float("-inf")], dtype=torch.float64)
    torch.testing.assert_close(
        advantage_to_r(adv, A_MAX), torch.tensor([0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 0.0], dtype=torch.float64)
    )


@pytest.mark.parametrize("a_max", [1.0, 5.0, 12.5])
def test_advantage_to_r_is_monotone_and_affine_inside(a_max):
    adv = torch.linspace(-3 * a_max, 3 * a_max, 601, dtype=torch.float64)
    r = advantage_to_r(adv, a_max)
    assert (r.diff() >= 0).all()
    assert r.min() == 0 and r.max() == 1
    inside = adv.abs() < a_max
    torch.testing.assert_close(r[inside], 0.5 + adv[inside] / (2 * a_max), rtol=0, atol=1e-15)
    assert (r[inside].diff() > 0).all()


# ---------------------------------------------------------------- schedules

DECAY_TABLE = {
    "on_policy": {0: 0.0, 1: 0.0, 74: 0.0, 75: 0.0, 76: 0.0, 500: 0.0, 10_000: 0.0},
    # MARBLE's release: min(0.001 s, 0.95) with s the steps done including this one (s = step + 1 here)
    "marble": {0: 0.001, 1: 0.002, 74: 0.075, 499: 0.5, 948: 0.949, 949: 0.95, 950: 0.95, 10_000: 0.95},
    "linear": {0: 0.0, 1: 0.001, 74: 0.074, 75: 0.075, 76: 0.076, 500: 0.5, 10_000: 0.5},
    "delayed": {
        0: 0.0,
        1: 0.0,
        74: 0.0,
        75: 0.0,
        76: 0.0075,
        175: 0.75,
        208: 0.9975,
        209: 0.999,
        500: 0.999,
        10_000: 0.999,
    },
}


@pytest.mark.parametrize("decay_type", sorted(DECAY_TABLE))
def test_old_policy_decay_hand_values(decay_type):
    for step, expected in DECAY_TABLE[decay_type].items():
        assert old_policy_decay(step, decay_type) == pytest.approx(expected, abs=1e-12), (decay_type, step)


def test_decay_types_are_the_documented_four():
    assert set(DECAY_TYPES) == set(DECAY_TABLE)


def test_old_policy_decay_unknown_type_raises():
    with pytest.raises(ValueError, match="cosine"):
        old_policy_decay(3, "cosine")


@pytest.mark.parametrize(
    "step,max_decay,expected",
    [
        (0, 0.9, 0.1),
        (1, 0.9, 2 / 11),
        (10, 0.9, 11 / 20),
        (71, 0.9, 72 / 81),
        (80, 0.9, 0.9),
        (10_000, 0.9, 0.9),
        (1000, 0.999, 1001 / 1010),
        (0, 0.05, 0.05),
    ],
)
def test_param_ema_decay(step, max_decay, expected):
    assert param_ema_decay(step, max_decay) == pytest.approx(expected, abs=1e-15)


def test_param_ema_decay_default_cap_is_0_9():
    assert param_ema_decay(10**6) == pytest.approx(0.9)


# ---------------------------------------------------------------- forward process


def test_add_noise_endpoints_and_interpolation():
    gen = torch.Generator().manual_seed(0)
    x0 = torch.randn(3, 2, 4, 4, generator=gen, dtype=torch.float64)
    noise = torch.randn(3, 2, 4, 4, generator=gen, dtype=torch.float64)
    torch.testing.assert_close(add_noise(x0, noise, torch.zeros(3, dtype=torch.float64)), x0, rtol=0, atol=0)
    torch.testing.assert_close(add_noise(x0, noise, torch.ones(3, dtype=torch.float64)), noise, rtol=0, atol=0)
    t = torch.tensor([0.0, 0.25, 1.0], dtype=torch.float64)
    x_t = add_noise(x0, noise, t)
    torch.testing.assert_close(x_t[0], x0[0], rtol=0, atol=0)
    torch.testing.assert_close(x_t[1], 0.75 * x0[1] + 0.25 * noise[1], rtol=1e-15, atol=1e-15)
    torch.testing.assert_close(x_t[2], noise[2], rtol=0, atol=0)


def test_target_velocity_reconstructs_x0():
    """With v = eps - x0 exactly, x0_hat = x_t - t v is x0: both policies reproduce x0, the loss is zero."""
    gen = torch.Generator().manual_seed(1)
    x0, noise = (
        torch.randn(4, 6, generator=gen, dtype=torch.float64),
        torch.randn(4, 6, generator=gen, dtype=torch.float64),
    )
    t = torch.rand(4, generator=gen, dtype=torch.float64)
    v = noise - x0
    terms = nft_loss_terms(v, v, add_noise(x0, noise, t), x0, t, 1.0)
    assert terms.loss_pos.abs().max() < 1e-12 and terms.loss_neg.abs().max() < 1e-12
