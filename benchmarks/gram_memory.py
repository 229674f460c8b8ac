"""Peak memory of one solved pair's per-reward Gram, per engine, at K = 2, 5, 10 (full fine-tuning of tiny SD3).

For each engine and K, one profiled region holds what a solved pair of the released MARBLE allocates for its Gram:
the engine's construction (its buffers), the policy's forward inside ``capture`` (on the micro-batch twice for
``layer_gram``), ``accumulate`` and the K x K Gram. The peak of the live CPU tensors in that region (torch.profiler's
memory timeline: every allocation, not a sampled RSS) is compared with the same region for the ordinary
single-reward forward and backward (the baseline: what a step without MARBLE allocates there). "extra" = peak -
baseline; "P" = the trained parameters in float32 bytes (one gradient-size buffer).

    python benchmarks/gram_memory.py                 # tiny SD3, every weight, micro-batch 4
    python benchmarks/gram_memory.py --targets to_q to_k to_v to_out.0
"""

from __future__ import annotations

import argparse
import gc
import sys
from collections.abc import Callable
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile
from torch.profiler._memory_profiler import MemoryProfile

try:
    from marble_trl.balance.engines import make_gradient_engine
except ModuleNotFoundError:  # a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from marble_trl.balance.engines import make_gradient_engine
from marble_trl.balance.layer_gram import SLICE_ELEMENTS, LayerGramEngine
from marble_trl.models import load_model
from marble_trl.policy.full import FullPolicy
from marble_trl.policy.nft import add_noise, nft_loss_terms
from marble_trl.rollout.solvers import make_scheduler

PROMPTS = ["a red apple", "a blue boat on a lake"]


def peak_bytes(fn: Callable[[], object]) -> int:
    """The peak of the live CPU tensor bytes allocated inside ``fn`` (tensors alive before it are not counted)."""
    gc.collect()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True) as prof:
        fn()
    live = peak = 0
    for _, action, _, size in MemoryProfile(prof.profiler.kineto_results).timeline:
        if action.name == "CREATE":
            live += size
        elif action.name == "DESTROY":
            live -= size
        peak = max(peak, live)
    return peak


class Setup:
    """Tiny SD3 with its trained weights (``targets``; None: every weight) and one micro-batch of ``batch``."""

    def __init__(self, batch: int = 4, targets: list[str] | None = None) -> None:
        torch.manual_seed(0)
        self.adapter = load_model("tiny")
        self.transformer = self.adapter.transformer
        self.params = list(FullPolicy(self.transformer, targets).trainable(self.transformer).values())
        cpu = torch.device("cpu")
        self.cond = self.adapter.encode(PROMPTS * (batch // 2), 8, cpu, 1.0)
        scheduler = make_scheduler("euler", self.adapter.pipeline.scheduler)
        shape = self.adapter.sample(scheduler, self.cond, 1, 16, torch.Generator().manual_seed(0)).shape
        g = torch.Generator().manual_seed(1)
        self.x0, eps = torch.randn(shape, generator=g), torch.randn(shape, generator=g)
        self.t = torch.rand(batch, generator=g) * 0.8 + 0.1
        self.x_t, self.v_old = add_noise(self.x0, eps, self.t), torch.randn(shape, generator=g)
        self.batch = batch

    @property
    def gradient_bytes(self) -> int:
        return sum(4 * p.numel() for p in self.params)

    def terms(self, copies: int = 1):
        idx = torch.arange(self.batch).repeat(copies)
        v = self.adapter.predict(self.transformer, self.x_t[idx], self.t[idx], self.cond.index(idx))
        return nft_loss_terms(v, self.v_old[idx], self.x_t[idx], self.x0[idx], self.t[idx], 1.0)

    def baseline(self, copies: int = 1) -> None:
        """The ordinary single-reward forward and backward (into ``.grad``, then dropped), on the batch ``copies``
        times (2: the activations of layer_gram's forward, without its Gram)."""
        terms = self.terms(copies)
        (0.5 * terms.loss_pos + 0.5 * terms.loss_neg).sum().backward()
        for p in self.params:
            p.grad = None

    def solved_pair(self, engine_name: str, k: int, slice_elements: int = SLICE_ELEMENTS) -> torch.Tensor:
        """One pair's K x K Gram from ``engine_name`` (its buffers built inside the region, as on a first solve)."""
        r = torch.rand(k, self.batch, generator=torch.Generator().manual_seed(k))
        doubled = engine_name == "layer_gram"
        if doubled:
            engine = LayerGramEngine(self.params, k, self.transformer, slice_elements=slice_elements)
        else:
            engine = make_gradient_engine(engine_name, self.params, k, self.transformer)
        with engine.capture(self.transformer):
            terms = self.terms(2 if doubled else 1)
            engine.accumulate(terms.loss_pos, terms.loss_neg, r, 1.0)
        return engine.gram.clone() if doubled else engine.buffers @ engine.buffers.T


def measure(setup: Setup, engines: list[str], ks: list[int], slice_elements: int = SLICE_ELEMENTS) -> list[dict]:
    """One row per (engine, K), in bytes: ``peak``, ``extra`` over the ordinary backward's peak, and ``own``: over the
    same forward and backward without a Gram (for layer_gram: on the batch twice), the engine's own memory."""
    setup.baseline()  # warm-up: lazily built modules and caches are not counted
    base = peak_bytes(setup.baseline)
    doubled = peak_bytes(lambda: setup.baseline(2))
    rows = []
    for name in engines:
        setup.solved_pair(name, ks[0], slice_elements)  # warm-up
        for k in ks:
            peak = peak_bytes(lambda name=name, k=k: setup.solved_pair(name, k, slice_elements))
            own = peak - (doubled if name == "layer_gram" else base)
            rows.append({"engine": name, "K": k, "peak": peak, "extra": peak - base, "own": own, "baseline": base})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--targets", nargs="*", default=None, help="full_finetune_modules (default: every weight)")
    parser.add_argument("--engines", nargs="*", default=["reference", "layer_gram"])
    parser.add_argument("--k", nargs="*", type=int, default=[2, 5, 10])
    parser.add_argument("--slice", type=int, default=SLICE_ELEMENTS, help="layer_gram's slice_elements")
    args = parser.parse_args()
    setup = Setup(args.batch, args.targets)
    p = setup.gradient_bytes
    rows = measure(setup, args.engines, args.k, args.slice)
    mib = 1 << 20
    base = rows[0]["baseline"] / mib
    print(f"trained parameters: {p // 4:,} (P = {p / mib:.2f} MiB in float32); baseline {base:.2f} MiB")
    print(f"{'engine':<12} {'K':>3} {'peak MiB':>9} {'extra MiB':>10} {'extra / P':>10} {'own MiB':>8} {'own / P':>8}")
    for row in rows:
        print(
            f"{row['engine']:<12} {row['K']:>3} {row['peak'] / mib:>9.2f} {row['extra'] / mib:>10.2f} "
            f"{row['extra'] / p:>10.2f} {row['own'] / mib:>8.2f} {row['own'] / p:>8.2f}"
        )


if __name__ == "__main__":
    main()
