"""The ``layer_gram`` engine (marble_trl/balance/layer_gram.py): a solved pair's per-reward Gram without per-reward
gradient buffers, equal to the Gram of explicit ``torch.autograd.grad`` gradients (masked, sliced, averaged by a
``reduce``), flat in K for memory; on tiny SD3 and FLUX: tests/test_full_finetuning.py; against the written-out
release on two processes: tests/test_released.py."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
from tiny import tiny_args
from torch import nn

from marble_trl.balance import LayerGramEngine, ReleasedMarble, make_gradient_engine


class Toy(nn.Module):
    """Per-sample independent: an embedding, a convolution, a LayerNorm, Linears with and without bias."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(5, 6)
        self.conv = nn.Conv2d(2, 6, 3, padding=1)
        self.norm = nn.LayerNorm(6)
        self.lin = nn.Linear(6, 7)
        self.head = nn.Linear(7, 3, bias=False)
        self.frozen = nn.Linear(3, 3)

    def forward(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        h = self.conv(x).flatten(2).transpose(1, 2) + self.embed(ids)[:, None]  # [B, 16, 6]
        return self.frozen(self.head(torch.tanh(self.lin(self.norm(h)))))


def _losses(model, x, ids, target):
    out = model(x, ids)
    pos = ((out - target) ** 2).mean(dim=(1, 2))
    neg = ((out + target) ** 2).mean(dim=(1, 2))
    return pos, neg


@pytest.mark.parametrize("slice_elements", [1 << 24, 40], ids=["whole_layers", "sliced"])
def test_gram_equals_explicit_autograd_with_masks_slices_and_a_reduce(slice_elements):
    torch.manual_seed(0)
    model = Toy().double()
    model.frozen.requires_grad_(False)
    params = [p for p in model.parameters() if p.requires_grad]
    b, k = 3, 4
    x, ids, target = torch.randn(b, 2, 4, 4, dtype=torch.float64), torch.tensor([0, 3, 4]), torch.randn(b, 16, 3)
    target = target.double()
    r = torch.rand(k, b, dtype=torch.float64)
    w = (torch.rand(k, b) > 0.3).double() / 2.0
    scale = 0.7
    rows = []
    for j in range(k):
        pos, neg = _losses(model, x, ids, target)
        loss = scale * (w[j] * (r[j] * pos + (1 - r[j]) * neg)).sum()
        rows.append(torch.cat([g.reshape(-1) for g in torch.autograd.grad(loss, params)]))
    expected = torch.stack(rows) @ torch.stack(rows).T

    reduced = []

    def reduce(rows: torch.Tensor) -> None:  # stands for the average over processes: must come before R R^T
        reduced.append(rows)
        rows.mul_(0.5)

    engine = LayerGramEngine(params, k, model, reduce=reduce, slice_elements=slice_elements)
    twice = torch.arange(b).repeat(2)
    with engine.capture(model):
        pos, neg = _losses(model, x[twice], ids[twice], target[twice])
        engine.accumulate(pos, neg, r, scale, weights=w)
    torch.testing.assert_close(engine.gram, 0.25 * expected, rtol=1e-10, atol=1e-14)
    assert sum(t.shape[1] for t in reduced) == sum(p.numel() for p in params)  # every coordinate reduced once
    assert all(t.shape[0] == k for t in reduced)
    if slice_elements == 40:
        assert max(t.numel() for t in reduced) <= 40
    engine.reset()
    assert engine.gram.abs().max() == 0


def test_gradient_checkpointing_recomputes_are_not_second_calls():
    """Non-reentrant checkpointing (the full recipes' activation_checkpointing) re-runs the forward, hooks included,
    inside the engine's backward: the Gram is still the explicit one, and no "ran twice" error."""

    class Checkpointed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(4, 5), nn.Linear(5, 2)

        def forward(self, x):
            h = torch.utils.checkpoint.checkpoint(lambda t: torch.tanh(self.a(t)), x, use_reentrant=False)
            return self.b(h)

    torch.manual_seed(1)
    model = Checkpointed().double()
    params = list(model.parameters())
    x, r = torch.randn(3, 4, dtype=torch.float64), torch.rand(2, 3, dtype=torch.float64)
    rows = []
    for k in range(2):
        out = model(x)
        pos, neg = (out**2).sum(dim=1), (out - 1).abs().sum(dim=1)
        rows.append(
            torch.cat([g.reshape(-1) for g in torch.autograd.grad((r[k] * pos + (1 - r[k]) * neg).sum(), params)])
        )
    engine = LayerGramEngine(params, 2, model)
    twice = torch.arange(3).repeat(2)
    with engine.capture(model):
        out = model(x[twice])
        engine.accumulate((out**2).sum(dim=1), (out - 1).abs().sum(dim=1), r, 1.0)
    torch.testing.assert_close(engine.gram, torch.stack(rows) @ torch.stack(rows).T, rtol=1e-10, atol=1e-14)


def test_unsupported_parameters_and_calls_are_named_with_the_way_out():
    class Owner(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.scale = nn.Parameter(torch.ones(3))  # read in forward by a module with children
            self.lin = nn.Linear(3, 3)

        def forward(self, x):
            return self.lin(x) * self.scale

    model = Owner()
    with pytest.raises(ValueError, match=r"cannot handle trainable parameter scale.*full_finetune_modules"):
        LayerGramEngine(list(model.parameters()), 2, model)

    class TwoInputs(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.bil = nn.Bilinear(3, 3, 2)

        def forward(self, x):
            return self.bil(x, x)

    class Twice(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(3, 3)
            self.other = nn.Linear(3, 3)
            self.other.weight = self.lin.weight  # tied

        def forward(self, x):
            return self.lin(self.lin(x))

    model = Twice()
    with pytest.raises(ValueError, match=r"cannot handle trainable parameter lin\.weight"):
        LayerGramEngine(list(model.parameters()), 2, model)
    engine = LayerGramEngine([model.lin.bias], 2, model)
    with engine.capture(model), pytest.raises(RuntimeError, match="lin ran twice in one forward"):
        model(torch.randn(2, 3))

    class Pair(nn.Module):  # a leaf returning a tuple
        def __init__(self) -> None:
            super().__init__()
            self.scale = nn.Parameter(torch.ones(3))

        def forward(self, x):
            return x * self.scale, x

    pair = Pair()
    engine = LayerGramEngine([pair.scale], 2, pair)
    with engine.capture(pair), pytest.raises(RuntimeError, match=r"returns tuple, not a tensor"):
        pair(torch.randn(2, 3))

    model = TwoInputs()
    engine = LayerGramEngine(list(model.parameters()), 2, model)
    with engine.capture(model), pytest.raises(RuntimeError, match=r"bil \(Bilinear\) was called with 2 positional"):
        model(torch.randn(2, 3))
    with pytest.raises(ValueError, match=r"\[2B=4\]"):
        with engine.capture(model):
            engine.accumulate(torch.zeros(2), torch.zeros(2), torch.zeros(2, 2), 1.0)


def test_the_released_balancer_solves_from_the_gram_as_from_the_gradients():
    g = torch.randn(3, 50, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    names = ["a", "b", "c"]
    from_grads, from_gram = ReleasedMarble(names), ReleasedMarble(names)
    a, b = from_grads.solve(g, step=0), from_gram.solve_pair_gram(g @ g.T, step=0)
    assert a.coefficients == pytest.approx(b.coefficients, rel=1e-9)
    assert from_grads.state_dict() == from_gram.state_dict()
    bad = (g @ g.T).clone()
    bad[0, 1] = float("nan")
    with pytest.raises(ValueError, match="not finite"):
        from_gram.solve_pair_gram(bad, step=1)
    assert from_gram.last_full == 0  # unchanged


def test_layer_gram_needs_the_released_procedure(tmp_path):
    with pytest.raises(ValueError, match="marble_gradient_engine='layer_gram'.*marble_procedure='released'"):
        tiny_args(tmp_path, marble_gradient_engine="layer_gram")
    tiny_args(tmp_path, marble_gradient_engine="layer_gram", marble_procedure="released")
    layer = nn.Linear(2, 2)
    assert isinstance(make_gradient_engine("layer_gram", [layer.weight], 2, layer), LayerGramEngine)


def test_its_peak_memory_does_not_grow_with_k_where_the_buffers_do():
    """benchmarks/gram_memory.py on tiny SD3, every weight trained: the profiler's peak of live tensors over one
    solved pair (construction, forward, accumulate, Gram). The reference engine's grows by (10 - 2) gradient-size
    buffers; layer_gram's by at most the K rows of one slice (here a small layer's: 16 KB, 5% of one gradient;
    bounded by ``slice_elements`` whatever K)."""
    path = Path(__file__).parents[1] / "benchmarks" / "gram_memory.py"
    spec = importlib.util.spec_from_file_location("gram_memory", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    setup = bench.Setup(batch=2)
    p = setup.gradient_bytes
    rows = {(r["engine"], r["K"]): r for r in bench.measure(setup, ["reference", "layer_gram"], [2, 10])}
    assert abs(rows["layer_gram", 10]["peak"] - rows["layer_gram", 2]["peak"]) < 0.1 * p
    assert rows["reference", 10]["peak"] - rows["reference", 2]["peak"] >= 7.5 * p
    assert rows["layer_gram", 10]["own"] < p  # beyond the doubled forward: less than one gradient-size buffer
