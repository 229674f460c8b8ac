"""The per-reward gradient engines against K explicit ``torch.autograd.grad`` calls (float64, tiny SD3 + LoRA)."""

from __future__ import annotations

import logging

import pytest
import torch
from diffusers import SD3Transformer2DModel
from peft import LoraConfig
from torch import nn

from marble_trl.balance.engines import GradientEngine, ReferenceGradientEngine, make_gradient_engine
from marble_trl.balance.gradient_buffers import unflatten
from marble_trl.balance.two_stream import TwoStreamGradientEngine, find_unsupported_params
from marble_trl.models import predict_velocity
from marble_trl.policy.nft import nft_loss_terms

ENGINES = ["reference", "two_stream"]
TARGETS = ["to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out"]
B, SCALE, NFT_BETA = 3, 0.37, 0.5


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny tensors: intra-op threads only add OpenMP overhead (4x on a busy 2-core machine); restored afterwards."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def tiny_transformer(seed: int = 0, qk_norm: str | None = None) -> SD3Transformer2DModel:
    torch.manual_seed(seed)
    model = SD3Transformer2DModel(
        sample_size=8,
        patch_size=1,
        in_channels=4,
        num_layers=2,
        attention_head_dim=8,
        num_attention_heads=4,
        caption_projection_dim=32,
        joint_attention_dim=32,
        pooled_projection_dim=64,
        out_channels=4,
        qk_norm=qk_norm,
    )
    model.add_adapter(LoraConfig(r=4, lora_alpha=8, init_lora_weights="gaussian", target_modules=TARGETS))
    model.double()
    with torch.no_grad():  # gaussian init zeroes lora_B: perturb it so gradients wrt lora_A are non-trivial
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.1)
    return model


def trainable(model: nn.Module) -> list[nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


def make_batch(seed: int, n: int = B) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    d = dict(dtype=torch.float64, generator=g)
    x0 = torch.randn(n, 4, 8, 8, **d)
    t = torch.rand(n, **d) * 0.8 + 0.1
    noise = torch.randn(n, 4, 8, 8, **d)
    tb = t.view(-1, 1, 1, 1)
    return {
        "x0": x0,
        "t": t,
        "x_t": (1 - tb) * x0 + tb * noise,
        "enc": torch.randn(n, 5, 32, **d),
        "pooled": torch.randn(n, 64, **d),
        "v_old": torch.randn(n, 4, 8, 8, **d),
        "v_ref": torch.randn(n, 4, 8, 8, **d),
    }


def forward_terms(model: nn.Module, batch: dict[str, torch.Tensor]):
    v = predict_velocity(model, batch["x_t"], batch["t"], batch["enc"], batch["pooled"])
    return nft_loss_terms(v, batch["v_old"], batch["x_t"], batch["x0"], batch["t"], NFT_BETA, v_ref=batch["v_ref"])


def step_inputs(k: int) -> list[tuple[dict[str, torch.Tensor], torch.Tensor]]:
    """2 micro-batches x 2 timesteps: each with its own latents/noise/time and r in [0, 1]."""
    g = torch.Generator().manual_seed(100 + k)
    return [
        (make_batch(10 * mb + ts), torch.rand(k, B, dtype=torch.float64, generator=g))
        for mb in range(2)
        for ts in range(2)
    ]


def flat_grad(loss: torch.Tensor, params: list[nn.Parameter]) -> torch.Tensor:
    return torch.cat([g.reshape(-1) for g in torch.autograd.grad(loss, params, retain_graph=True)])


def explicit_buffers(model: nn.Module, params: list[nn.Parameter], inputs, k: int) -> torch.Tensor:
    out = torch.zeros(k, sum(p.numel() for p in params), dtype=torch.float64)
    for batch, r in inputs:
        terms = forward_terms(model, batch)
        for j in range(k):
            out[j] += flat_grad(SCALE * (r[j] * terms.loss_pos + (1 - r[j]) * terms.loss_neg).sum(), params)
    return out


def run_engine(engine: GradientEngine, model: nn.Module, inputs, kl_weight: float | None = None) -> None:
    for batch, r in inputs:
        with engine.capture(model):
            terms = forward_terms(model, batch)
            extra = None if kl_weight is None else kl_weight * terms.kl.mean()
            engine.accumulate(terms.loss_pos, terms.loss_neg, r, SCALE, extra_loss=extra)


def assert_close(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.abs().max() > 1e-6  # non-trivial
    torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("k", [1, 3, 5])
@pytest.mark.parametrize("name", ENGINES)
def test_buffers_match_explicit_autograd(name: str, k: int) -> None:
    model = tiny_transformer()
    params = trainable(model)
    inputs = step_inputs(k)
    expected = explicit_buffers(model, params, inputs, k)
    engine = make_gradient_engine(name, params, k, model)
    assert isinstance(engine, GradientEngine)
    assert engine.buffers.shape == (k, sum(p.numel() for p in params)) and engine.buffers.dtype == torch.float64
    run_engine(engine, model, inputs)
    assert_close(engine.buffers, expected)
    assert all(p.grad is None for p in model.parameters())  # per-reward grads never go to .grad


@pytest.mark.parametrize("name", ENGINES)
def test_masked_weights_match_explicit_autograd(name: str) -> None:
    """A masked solve's per-reward sample weights (MARBLE's release: each reward's loss a mean over the samples it
    applies to; 0 elsewhere): buffers[k] = grad of sum_i w_ki l_ki, both streams weighted per sample."""
    k = 3
    model = tiny_transformer()
    params = trainable(model)
    inputs = step_inputs(k)
    g = torch.Generator().manual_seed(7)
    weights = [(torch.rand(k, B, dtype=torch.float64, generator=g) > 0.4).double() * 1.5 for _ in inputs]
    weights[0][1] = 0.0  # a reward that applies to no sample of a pair
    expected = torch.zeros(k, sum(p.numel() for p in params), dtype=torch.float64)
    for (batch, r), w in zip(inputs, weights):
        terms = forward_terms(model, batch)
        for j in range(k):
            loss = SCALE * (w[j] * (r[j] * terms.loss_pos + (1 - r[j]) * terms.loss_neg)).sum()
            expected[j] += flat_grad(loss, params)
    engine = make_gradient_engine(name, params, k, model)
    for (batch, r), w in zip(inputs, weights):
        with engine.capture(model):
            terms = forward_terms(model, batch)
            engine.accumulate(terms.loss_pos, terms.loss_neg, r, SCALE, weights=w)
    assert_close(engine.buffers, expected)
    unweighted = make_gradient_engine(name, params, k, model)
    run_engine(unweighted, model, inputs)
    assert (unweighted.buffers - expected).abs().max() > 1e-3  # the weights matter
    with pytest.raises(ValueError, match="weights must be"):
        with engine.capture(model):
            terms = forward_terms(model, inputs[0][0])
            engine.accumulate(terms.loss_pos, terms.loss_neg, inputs[0][1], SCALE, weights=weights[0][:, :2])


@pytest.mark.parametrize("name", ENGINES)
def test_extra_loss_lands_in_grad_only(name: str) -> None:
    model = tiny_transformer()
    params = trainable(model)
    inputs = step_inputs(3)
    kl_weight = 0.7
    expected = explicit_buffers(model, params, inputs, 3)
    expected_grad = torch.zeros_like(expected[0])
    for batch, _ in inputs:
        expected_grad += flat_grad(kl_weight * forward_terms(model, batch).kl.mean(), params)
    engine = make_gradient_engine(name, params, 3, model)
    run_engine(engine, model, inputs, kl_weight=kl_weight)
    assert_close(engine.buffers, expected)
    assert_close(torch.cat([p.grad.reshape(-1) for p in params]), expected_grad)
    assert all(p.grad is None for p in model.parameters() if not p.requires_grad)


@pytest.mark.parametrize("name", ENGINES)
def test_gradient_checkpointing(name: str) -> None:
    model = tiny_transformer()
    params = trainable(model)
    inputs = step_inputs(3)
    expected = explicit_buffers(model, params, inputs, 3)
    model.enable_gradient_checkpointing()
    assert model.gradient_checkpointing
    engine = make_gradient_engine(name, params, 3, model)
    calls = {"n": 0}
    handle = model.transformer_blocks[0].register_forward_pre_hook(lambda *_: calls.__setitem__("n", calls["n"] + 1))
    run_engine(engine, model, inputs, kl_weight=0.5)
    handle.remove()
    assert calls["n"] > len(inputs)  # the blocks really were recomputed during the backward passes
    assert_close(engine.buffers, expected)


def test_auto_picks_two_stream_for_lora() -> None:
    model = tiny_transformer()
    assert find_unsupported_params(trainable(model), model) == []
    assert isinstance(make_gradient_engine("auto", trainable(model), 2, model), TwoStreamGradientEngine)


def test_auto_falls_back_to_reference_with_warning(caplog: pytest.LogCaptureFixture) -> None:
    model = tiny_transformer(qk_norm="rms_norm")
    model.transformer_blocks[0].norm1_context.linear.requires_grad_(True)  # AdaLayerNorm's Linear: supported
    model.transformer_blocks[1].attn.norm_q.weight.requires_grad_(True)  # an RMSNorm weight: not supported
    params = trainable(model)
    unsupported = find_unsupported_params(params, model)
    assert len(unsupported) == 1 and "transformer_blocks.1.attn.norm_q.weight" in unsupported[0]
    with caplog.at_level(logging.WARNING, logger="marble_trl.balance.engines"):
        engine = make_gradient_engine("auto", params, 2, model)
    assert isinstance(engine, ReferenceGradientEngine)
    # Only this module's records: caplog sees every logger that propagates (transformers' do when CI is set).
    warned = [r.getMessage() for r in caplog.records if r.name == "marble_trl.balance.engines"]
    assert len(warned) == 1 and "attn.norm_q.weight" in warned[0]
    with pytest.raises(ValueError, match="norm_q.weight"):
        make_gradient_engine("two_stream", params, 2, model)
    with pytest.raises(ValueError, match="Unknown gradient engine"):
        make_gradient_engine("fast", params, 2, model)


def test_dora_is_unsupported() -> None:
    """DoRA reads lora_B (and its magnitude vector) outside the Linear forward: per-sample taps would miss that."""
    torch.manual_seed(0)
    model = SD3Transformer2DModel(
        sample_size=8,
        patch_size=1,
        in_channels=4,
        num_layers=1,
        attention_head_dim=8,
        num_attention_heads=4,
        caption_projection_dim=32,
        joint_attention_dim=32,
        pooled_projection_dim=64,
        out_channels=4,
    )
    model.add_adapter(LoraConfig(r=4, lora_alpha=8, use_dora=True, target_modules=["to_q"]))
    unsupported = find_unsupported_params(trainable(model), model)
    assert len(unsupported) == 3 and all("DoRA" in u or "DoraLinearLayer" in u for u in unsupported)
    assert isinstance(make_gradient_engine("auto", trainable(model), 2, model), ReferenceGradientEngine)


def test_full_linear_params_beyond_lora_match() -> None:
    """Frozen base + trainable LoRA + trainable plain Linears with bias seeing [B, dim] and [B, tokens, dim] inputs."""
    model = tiny_transformer()
    model.time_text_embed.timestep_embedder.linear_1.requires_grad_(True)  # input [B, 256]
    model.norm_out.linear.requires_grad_(True)  # input [B, dim]
    model.proj_out.requires_grad_(True)  # input [B, tokens, dim]
    params = trainable(model)
    assert find_unsupported_params(params, model) == []
    inputs = step_inputs(3)
    expected = explicit_buffers(model, params, inputs, 3)
    engine = make_gradient_engine("two_stream", params, 3, model)
    run_engine(engine, model, inputs)
    assert_close(engine.buffers, expected)


class _SharedMLP(nn.Module):
    """One Linear called twice, a second Linear tied to its weight, and a head; per-sample inputs [B, dim]."""

    def __init__(self) -> None:
        super().__init__()
        self.shared = nn.Linear(6, 6)
        self.tied = nn.Linear(6, 6, bias=False)
        self.tied.weight = self.shared.weight
        self.head = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.shared(x))
        h = torch.tanh(self.tied(h))
        h = self.shared(h)
        h += 1.0  # in-place on a tapped layer's output: must stay legal
        return self.head(torch.tanh(h))


def test_shared_and_tied_linear_weights() -> None:
    torch.manual_seed(0)
    model = _SharedMLP().double()
    params = list(model.parameters())
    assert len(params) == 4  # shared weight + bias, head weight + bias
    x = torch.randn(4, 6, dtype=torch.float64)
    r = torch.rand(2, 4, dtype=torch.float64)

    def terms() -> tuple[torch.Tensor, torch.Tensor]:
        y = model(x)
        return (y**2).mean(1), (y - 1).abs().mean(1)

    lp, ln = terms()
    expected = torch.stack([flat_grad(SCALE * (r[k] * lp + (1 - r[k]) * ln).sum(), params) for k in range(2)])
    engine = make_gradient_engine("auto", params, 2, model)
    assert isinstance(engine, TwoStreamGradientEngine)
    with engine.capture(model):
        lp, ln = terms()
        engine.accumulate(lp, ln, r, SCALE)
    assert_close(engine.buffers, expected)
    views = unflatten(engine.buffers[0], params)
    assert [v.shape for v in views] == [p.shape for p in params]


def test_hooks_removed_and_reset() -> None:
    model = tiny_transformer()
    params = trainable(model)
    n_hooks = sum(len(m._forward_hooks) for m in model.modules())
    engine = make_gradient_engine("two_stream", params, 2, model)
    batch, r = step_inputs(2)[0]
    with engine.capture(model):
        assert sum(len(m._forward_hooks) for m in model.modules()) > n_hooks
        terms = forward_terms(model, batch)
        engine.accumulate(terms.loss_pos, terms.loss_neg, r, SCALE)
    assert sum(len(m._forward_hooks) for m in model.modules()) == n_hooks
    with pytest.raises(RuntimeError, match="boom"), engine.capture(model):
        raise RuntimeError("boom")
    assert sum(len(m._forward_hooks) for m in model.modules()) == n_hooks

    ptr = engine.buffers.data_ptr()
    assert engine.buffers.abs().sum() > 0
    engine.reset()
    assert engine.buffers.data_ptr() == ptr and engine.buffers.abs().sum() == 0


@pytest.mark.parametrize("name", ENGINES)
def test_misuse_is_reported(name: str) -> None:
    model = tiny_transformer()
    engine = make_gradient_engine(name, trainable(model), 2, model)
    batch, r = step_inputs(2)[0]
    terms = forward_terms(model, batch)
    with pytest.raises(RuntimeError, match="inside"):
        engine.accumulate(terms.loss_pos, terms.loss_neg, r, SCALE)
    with engine.capture(model), pytest.raises(ValueError, match=r"r must be \[K=2"):
        engine.accumulate(terms.loss_pos, terms.loss_neg, r[:1], SCALE)
    if name == "two_stream":  # forward outside capture: the taps never fired
        with engine.capture(model), pytest.raises(RuntimeError, match="No captured layer"):
            engine.accumulate(terms.loss_pos, terms.loss_neg, r, SCALE)


def test_bf16_model_accumulates_in_float32() -> None:
    model = tiny_transformer().to(torch.bfloat16)
    params = trainable(model)
    batch = {k: v.to(torch.bfloat16) for k, v in make_batch(0).items()}
    r = torch.rand(3, B)
    ref = make_gradient_engine("reference", params, 3, model)
    fast = make_gradient_engine("two_stream", params, 3, model)
    assert ref.buffers.dtype == fast.buffers.dtype == torch.float32
    for engine in (ref, fast):
        with engine.capture(model):
            terms = forward_terms(model, batch)
            engine.accumulate(terms.loss_pos, terms.loss_neg, r, SCALE)
    cos = torch.nn.functional.cosine_similarity(ref.buffers, fast.buffers, dim=1)
    assert (cos > 0.99).all(), cos


def _saved_bytes(model: nn.Module, batch: dict[str, torch.Tensor], engine: GradientEngine | None) -> int:
    """Bytes of the distinct storages autograd saves for one forward (with or without the engine's taps)."""
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        if engine is None:
            forward_terms(model, batch)
        else:
            with engine.capture(model):
                forward_terms(model, batch)
    return sum(storages.values())


@pytest.mark.parametrize("autocast", [False, True])
def test_capture_saves_no_extra_activations(autocast: bool) -> None:
    model = tiny_transformer().float()
    batch = {k: v.float() for k, v in make_batch(0).items()}
    engine = make_gradient_engine("two_stream", trainable(model), 2, model)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        assert _saved_bytes(model, batch, engine) == _saved_bytes(model, batch, None)


def test_autocast_bf16_matches_reference() -> None:
    """float32 model and LoRA under bf16 autocast (peft up-casts LoRA inputs to float32; autocast casts back)."""
    model = tiny_transformer().float()
    params = trainable(model)
    batch = {k: v.float() for k, v in make_batch(0).items()}
    r = torch.rand(3, B)
    engines = [make_gradient_engine(name, params, 3, model) for name in ENGINES]
    for engine in engines:
        with engine.capture(model), torch.autocast("cpu", dtype=torch.bfloat16):
            terms = forward_terms(model, batch)
            engine.accumulate(terms.loss_pos, terms.loss_neg, r, SCALE)
    ref, fast = (e.buffers for e in engines)
    assert ref.dtype == fast.dtype == torch.float32
    assert ((ref - fast).norm(dim=1) / ref.norm(dim=1) < 2e-2).all()


def test_fsdp2_shards_refuse_the_reference_engine(tmp_path):
    """Under FSDP2 the forward computes with temporary gathered copies of the (DTensor) parameters, so gradients with
    respect to the parameters (the reference engine) would silently be missing: refused with an error that names the
    fix, as are parameters of the root unit; the two-stream engine over the blocks' parameters is built."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        module = nn.Sequential(nn.Linear(4, 4), nn.Conv1d(1, 1, 3), nn.Linear(4, 4))
        for child in module[:2]:
            fully_shard(child, mesh=mesh)  # the "blocks"; module[2] stays in the root unit
        fully_shard(module, mesh=mesh)
        linear, conv, root = (list(module[i].parameters()) for i in range(3))
        assert all(isinstance(p, DTensor) for p in linear + conv)
        with pytest.raises(ValueError, match="FSDP2.*marble_gradient_engine='two_stream'"):
            make_gradient_engine("reference", linear, 2, module)
        with pytest.raises(ValueError, match=r"FSDP2 shards the parameters, and parameter 1\.weight"):
            make_gradient_engine("auto", conv, 2, module)
        engine = make_gradient_engine("auto", linear, 2, module)
        assert isinstance(engine, TwoStreamGradientEngine) and engine.buffers.shape == (2, 20)  # whole shapes
        # the root unit's parameters: their gradient is not reduce-scattered after the engine's passes (measured on
        # the tiny recipe with a proj_out LoRA), so they are refused with the fix
        with pytest.raises(ValueError, match=r"2\.weight \(\+1 more\) is held by the root unit.*lora_target_modules"):
            make_gradient_engine("two_stream", [*linear, *root], 2, module)
    finally:
        dist.destroy_process_group()
