"""The trainable / old-policy LoRA adapters on the tiny SD3 transformer, and the parameter EMA."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from peft import LoraConfig

from marble_trl.models import DEFAULT_LORA_TARGETS
from marble_trl.policy.lora import (
    OLD_ADAPTER,
    TRAIN_ADAPTER,
    LoraEMA,
    add_policy_adapters,
    lora_parameters,
    soft_update_old_policy,
    use_old_policy,
    use_reference,
)

pytestmark = pytest.mark.filterwarnings("ignore:Already found a `peft_config`:UserWarning")


def small_lora_config() -> LoraConfig:
    return LoraConfig(r=4, lora_alpha=8, init_lora_weights="gaussian", target_modules=list(DEFAULT_LORA_TARGETS))


@pytest.fixture
def transformer(tiny_pipeline):
    """A private copy of the tiny transformer with both policy adapters."""
    tr = copy.deepcopy(tiny_pipeline.transformer)
    add_policy_adapters(tr, small_lora_config())
    return tr


def model_inputs(transformer, seed: int = 0, batch: int = 2) -> dict:
    cfg = transformer.config
    gen = torch.Generator().manual_seed(seed)
    size = cfg.sample_size
    return dict(
        hidden_states=torch.randn(batch, cfg.in_channels, size, size, generator=gen),
        encoder_hidden_states=torch.randn(batch, 5, cfg.joint_attention_dim, generator=gen),
        pooled_projections=torch.randn(batch, cfg.pooled_projection_dim, generator=gen),
        timestep=torch.tensor([300.0, 800.0][:batch]),
    )


@torch.no_grad()
def forward(transformer, inputs) -> torch.Tensor:
    return transformer(**inputs, return_dict=False)[0]


def trainable_flags(module) -> dict[str, bool]:
    return {n: p.requires_grad for n, p in module.named_parameters()}


def old_name(name: str) -> str:
    return name.replace(f".{TRAIN_ADAPTER}.", f".{OLD_ADAPTER}.")


@torch.no_grad()
def perturb(params: dict[str, torch.nn.Parameter], seed: int, scale: float = 0.2) -> None:
    gen = torch.Generator().manual_seed(seed)
    for p in params.values():
        p.add_(torch.randn(p.shape, generator=gen) * scale)


def snapshot(params: dict[str, torch.nn.Parameter]) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in params.items()}


def assert_same(a, b) -> None:
    assert set(a) == set(b)
    for n in a:
        torch.testing.assert_close(a[n], b[n], rtol=0, atol=0, msg=n)


# ---------------------------------------------------------------- adapters and trainable flags


def test_only_the_default_lora_parameters_are_trainable(transformer):
    train = lora_parameters(transformer, TRAIN_ADAPTER)
    old = lora_parameters(transformer, OLD_ADAPTER)
    assert train and len(train) == len(old)
    trainable = {n for n, p in transformer.named_parameters() if p.requires_grad}
    assert trainable == set(train)
    assert all(".lora_A.default." in n or ".lora_B.default." in n for n in trainable)
    # every targeted projection of every block got an adapter
    targets = {n.rsplit(".lora_", 1)[0] for n in train}
    for suffix in DEFAULT_LORA_TARGETS:
        assert any(t.endswith(suffix) for t in targets), suffix


def test_old_adapter_starts_as_an_exact_copy(transformer):
    train = lora_parameters(transformer, TRAIN_ADAPTER)
    old = lora_parameters(transformer, OLD_ADAPTER)
    assert {old_name(n) for n in train} == set(old)
    for name, p in train.items():
        torch.testing.assert_close(old[old_name(name)], p, rtol=0, atol=0)
        assert old[old_name(name)].data_ptr() != p.data_ptr()
    assert any(p.abs().sum() > 0 for p in train.values())  # gaussian init: A is random, B is zero


def test_no_matching_module_raises(tiny_pipeline):
    tr = copy.deepcopy(tiny_pipeline.transformer)
    cfg = LoraConfig(r=2, target_modules=["no_such_module"])
    with pytest.raises(ValueError):
        add_policy_adapters(tr, cfg)


@pytest.mark.parametrize("context", [use_old_policy, use_reference])
def test_contexts_restore_trainable_flags(transformer, context):
    before = trainable_flags(transformer)
    with context(transformer):
        pass
    assert trainable_flags(transformer) == before
    with pytest.raises(RuntimeError), context(transformer):
        raise RuntimeError("boom")
    assert trainable_flags(transformer) == before


def test_contexts_restore_the_trained_policy(transformer):
    perturb(lora_parameters(transformer, TRAIN_ADAPTER), seed=1)
    inputs = model_inputs(transformer)
    out = forward(transformer, inputs)
    for context in (use_old_policy, use_reference):
        with context(transformer):
            assert not torch.allclose(forward(transformer, inputs), out)
        torch.testing.assert_close(forward(transformer, inputs), out, rtol=0, atol=0)


# ---------------------------------------------------------------- which policy runs


def test_policies_coincide_before_training(tiny_pipeline, transformer):
    inputs = model_inputs(transformer, seed=3)
    pretrained = forward(tiny_pipeline.transformer, inputs)
    with use_old_policy(transformer):
        old = forward(transformer, inputs)
    with use_reference(transformer):
        ref = forward(transformer, inputs)
    torch.testing.assert_close(forward(transformer, inputs), pretrained, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(old, pretrained, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(ref, pretrained, rtol=1e-6, atol=1e-6)


def test_policies_differ_once_perturbed(tiny_pipeline, transformer):
    perturb(lora_parameters(transformer, TRAIN_ADAPTER), seed=4)
    perturb(lora_parameters(transformer, OLD_ADAPTER), seed=5)
    inputs = model_inputs(transformer, seed=6)
    default = forward(transformer, inputs)
    with use_old_policy(transformer):
        old = forward(transformer, inputs)
    with use_reference(transformer):
        ref = forward(transformer, inputs)
    for a, b in [(default, old), (default, ref), (old, ref)]:
        assert (a - b).abs().max() > 1e-3
    torch.testing.assert_close(ref, forward(tiny_pipeline.transformer, inputs), rtol=1e-6, atol=1e-6)


def test_old_policy_runs_the_old_weights(transformer):
    """Copying the trained weights into the old adapter makes the old policy's output the trained one's."""
    perturb(lora_parameters(transformer, TRAIN_ADAPTER), seed=7)
    inputs = model_inputs(transformer, seed=8)
    default = forward(transformer, inputs)
    soft_update_old_policy(transformer, eta=0.0)
    with use_old_policy(transformer):
        torch.testing.assert_close(forward(transformer, inputs), default, rtol=0, atol=0)


def test_cached_switch_follows_a_new_adapter(tiny_pipeline, transformer):
    """The cached adapter switch is rebuilt when the set of adapters changes: a third adapter added after the first
    switch is disabled by use_reference too, and the trainable flags stay those of the trained adapter."""
    with use_old_policy(transformer):
        pass  # builds the cache on two adapters
    from peft import LoraConfig

    transformer.add_adapter(LoraConfig(r=2, lora_alpha=2, target_modules=["attn.to_q"]), adapter_name="third")
    perturb(lora_parameters(transformer, "third"), seed=11)
    perturb(lora_parameters(transformer, TRAIN_ADAPTER), seed=12)
    transformer.set_adapter(TRAIN_ADAPTER)
    inputs = model_inputs(transformer, seed=13)
    with use_reference(transformer):
        ref = forward(transformer, inputs)
    torch.testing.assert_close(ref, forward(tiny_pipeline.transformer, inputs), rtol=1e-6, atol=1e-6)
    trainable = {n for n, p in transformer.named_parameters() if p.requires_grad}
    assert trainable == set(lora_parameters(transformer, TRAIN_ADAPTER))


# ---------------------------------------------------------------- soft update


@pytest.mark.parametrize("eta", [0.0, 0.5, 1.0, 0.25])
def test_soft_update_math(transformer, eta):
    train = lora_parameters(transformer, TRAIN_ADAPTER)
    old = lora_parameters(transformer, OLD_ADAPTER)
    perturb(train, seed=9)
    perturb(old, seed=10)
    theta, theta_old = snapshot(train), snapshot(old)
    soft_update_old_policy(transformer, eta)
    assert_same(snapshot(train), theta)  # the trained adapter is untouched
    for name in train:
        expected = eta * theta_old[old_name(name)] + (1 - eta) * theta[name]
        torch.testing.assert_close(old[old_name(name)], expected, rtol=1e-6, atol=1e-7)
    if eta == 0.0:
        assert_same({old_name(n): t for n, t in theta.items()}, snapshot(old))
    if eta == 1.0:
        assert_same(theta_old, snapshot(old))
    assert trainable_flags(transformer) == {n: n in train for n, _ in transformer.named_parameters()}


# ---------------------------------------------------------------- parameter EMA


def test_ema_starts_at_the_current_weights_and_is_a_copy(transformer):
    train = lora_parameters(transformer, TRAIN_ADAPTER)
    ema = LoraEMA(transformer)
    assert_same(ema.shadow, snapshot(train))
    perturb(train, seed=11)
    assert not torch.equal(ema.shadow[next(iter(train))], next(iter(train.values())).detach())


@pytest.mark.parametrize("decay", [0.0, 0.9, 1.0])
def test_ema_update_math(transformer, decay):
    train = lora_parameters(transformer, TRAIN_ADAPTER)
    ema = LoraEMA(transformer)
    start = {n: t.clone() for n, t in ema.shadow.items()}
    perturb(train, seed=12)
    ema.update(transformer, decay)
    now = snapshot(train)
    for name in train:
        torch.testing.assert_close(
            ema.shadow[name], decay * start[name] + (1 - decay) * now[name], rtol=1e-6, atol=1e-7
        )
    perturb(train, seed=13)
    second = snapshot(train)
    before = {n: t.clone() for n, t in ema.shadow.items()}
    ema.update(transformer, 0.5)
    for name in train:
        torch.testing.assert_close(ema.shadow[name], 0.5 * before[name] + 0.5 * second[name], rtol=1e-6, atol=1e-7)


def test_ema_state_dict_round_trip(transformer):
    train = lora_parameters(transformer, TRAIN_ADAPTER)
    ema = LoraEMA(transformer)
    perturb(train, seed=14)
    ema.update(transformer, 0.7)
    saved = {n: t.clone() for n, t in ema.state_dict().items()}
    assert set(saved) == set(train)
    restored = LoraEMA(transformer)  # starts at the current (different) weights
    assert not all(torch.equal(restored.shadow[n], saved[n]) for n in saved)
    restored.load_state_dict(saved)
    assert_same(restored.shadow, saved)
    with pytest.raises(KeyError):
        restored.load_state_dict({k: v for i, (k, v) in enumerate(saved.items()) if i > 0})


def test_ema_swapped_in_and_restored(transformer):
    train = lora_parameters(transformer, TRAIN_ADAPTER)
    ema = LoraEMA(transformer)
    inputs = model_inputs(transformer, seed=15)
    ema_out = forward(transformer, inputs)  # the EMA holds the initial weights
    perturb(train, seed=16)
    live = snapshot(train)
    live_out = forward(transformer, inputs)
    with ema.swapped_in(transformer):
        assert_same(snapshot(train), ema.shadow)
        torch.testing.assert_close(forward(transformer, inputs), ema_out, rtol=0, atol=0)
    assert_same(snapshot(train), live)
    torch.testing.assert_close(forward(transformer, inputs), live_out, rtol=0, atol=0)
    with pytest.raises(RuntimeError), ema.swapped_in(transformer):
        raise RuntimeError("boom")
    assert_same(snapshot(train), live)
    assert {n for n, p in transformer.named_parameters() if p.requires_grad} == set(train)


def test_adding_the_policy_adapters_warns_nothing(tiny_pipeline):
    # peft's "Already found a `peft_config`" warning would show on every training run: the second adapter is intended.
    tr = copy.deepcopy(tiny_pipeline.transformer)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        add_policy_adapters(tr, small_lora_config())


def test_saved_lora_has_the_mode_of_every_other_file(tmp_path):
    """diffusers writes the LoRA through a private temporary file (0600): the saved LoRA gets the umask's mode, as
    the manifest and the JSON files beside it."""
    import os

    from marble_trl.models import load_model
    from marble_trl.models.base import save_diffusers_lora

    adapter = load_model("tiny")
    save_diffusers_lora(
        type(adapter.pipeline), tmp_path, {"transformer_blocks.0.attn.to_q.lora_A.weight": torch.zeros(2, 2)}, None
    )
    (tmp_path / "other.json").write_text("{}")
    mode = lambda name: os.stat(tmp_path / name).st_mode & 0o777  # noqa: E731
    assert mode("pytorch_lora_weights.safetensors") == mode("other.json")
