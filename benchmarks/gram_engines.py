"""Cost of MARBLE's per-reward gradients: reference (Algorithm 1, K backward passes) vs the two-stream engine.

Unit = one forward + one backward of the ordinary (single-reward) NFT loss on the same batch. For each K, the table
gives time(forward + engine.accumulate) / unit, measured side by side in one process (median of ``--repeats`` after
warm-up; all configurations interleaved round-robin, ratio = median over rounds of time / that round's unit).
METHOD.md section 3 predicts ~(1 + 2 bwd/fwd) / (1 + bwd/fwd) for two-stream, flat in K (<= 2x), and ~K+1-ish
for the reference.

    python benchmarks/gram_engines.py                          # CPU, float32, tiny-but-not-trivial SD3 + LoRA
    python benchmarks/gram_engines.py --device cuda --dtype bfloat16 --layers 24 --dim 1536 --tokens 1024 --batch 4
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from diffusers import SD3Transformer2DModel
from peft import LoraConfig

try:
    from marble_trl.balance.engines import make_gradient_engine
    from marble_trl.models import predict_velocity
    from marble_trl.policy.nft import nft_loss_terms
except ModuleNotFoundError:  # a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from marble_trl.balance.engines import make_gradient_engine
    from marble_trl.models import predict_velocity
    from marble_trl.policy.nft import nft_loss_terms

TARGETS = ["to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out"]
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}


def build(args: argparse.Namespace) -> tuple[SD3Transformer2DModel, dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    heads = args.dim // args.head_dim
    side = int(round(args.tokens**0.5)) * args.patch_size
    model = SD3Transformer2DModel(
        sample_size=side,
        patch_size=args.patch_size,
        in_channels=args.channels,
        num_layers=args.layers,
        attention_head_dim=args.head_dim,
        num_attention_heads=heads,
        caption_projection_dim=args.dim,
        joint_attention_dim=args.text_dim,
        pooled_projection_dim=args.pooled_dim,
        out_channels=args.channels,
        pos_embed_max_size=max(side, 16),
    )
    model.add_adapter(
        LoraConfig(r=args.rank, lora_alpha=2 * args.rank, init_lora_weights="gaussian", target_modules=TARGETS)
    )
    dtype, device = DTYPES[args.dtype], torch.device(args.device)
    model.to(device=device, dtype=dtype)
    with torch.no_grad():  # non-zero lora_B, as after a few steps of training
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.02)
    if args.gradient_checkpointing:
        model.enable_gradient_checkpointing()
    b, c = args.batch, args.channels
    kw = {"device": device, "dtype": dtype}
    t = torch.rand(b, device=device) * 0.8 + 0.1
    x0 = torch.randn(b, c, side, side, **kw)
    tb = t.view(-1, 1, 1, 1).to(dtype)
    batch = {
        "x0": x0,
        "t": t,
        "x_t": (1 - tb) * x0 + tb * torch.randn_like(x0),
        "enc": torch.randn(b, args.text_tokens, args.text_dim, **kw),
        "pooled": torch.randn(b, args.pooled_dim, **kw),
        "v_old": torch.randn_like(x0),
        "v_ref": torch.randn_like(x0),
    }
    return model, batch


def forward_terms(model: SD3Transformer2DModel, batch: dict[str, torch.Tensor], kl: bool):
    v = predict_velocity(model, batch["x_t"], batch["t"], batch["enc"], batch["pooled"])
    v_ref = batch["v_ref"] if kl else None
    return nft_loss_terms(v, batch["v_old"], batch["x_t"], batch["x0"], batch["t"], 1.0, v_ref=v_ref)


def measure(
    fns: dict[str, Callable[[], None]], device: torch.device, warmup: int, repeats: int
) -> tuple[dict[str, list[float]], dict[str, float]]:
    """Seconds per round for every fn, interleaved round-robin (a shared or throttling machine then slows all fns of
    a round alike, and per-round ratios stay meaningful), plus the peak allocated GiB of each fn (CUDA only)."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    peaks: dict[str, float] = {}
    for name, fn in fns.items():
        if device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        for _ in range(warmup):
            fn()
        sync()
        if device.type == "cuda":
            peaks[name] = torch.cuda.max_memory_allocated() / 2**30
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            sync()
            start = time.perf_counter()
            fn()
            sync()
            times[name].append(time.perf_counter() - start)
    return times, peaks


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--dim", type=int, default=256, help="model width (heads x head_dim)")
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--tokens", type=int, default=256, help="image tokens (a square grid)")
    p.add_argument("--patch-size", type=int, default=2)
    p.add_argument("--channels", type=int, default=4)
    p.add_argument("--text-tokens", type=int, default=77)
    p.add_argument("--text-dim", type=int, default=256)
    p.add_argument("--pooled-dim", type=int, default=128)
    p.add_argument("--rank", type=int, default=32, help="LoRA rank")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--ks", type=int, nargs="+", default=[1, 2, 5, 8, 16])
    p.add_argument("--kl", action="store_true", help="also back-propagate a KL term (a third stream) everywhere")
    p.add_argument("--gradient-checkpointing", action="store_true")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (1 is steadier on a shared machine)")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    device = torch.device(args.device)
    model, batch = build(args)
    params = [q for q in model.parameters() if q.requires_grad]
    n_lora = sum(q.numel() for q in params)
    n_all = sum(q.numel() for q in model.parameters())
    print(
        f"SD3 transformer: {args.layers} layers, dim {args.dim}, {args.tokens}+{args.text_tokens} tokens, batch "
        f"{args.batch}, {args.dtype} on {device} ({torch.get_num_threads()} threads); "
        f"{n_all / 1e6:.1f}M params, LoRA r={args.rank}: {n_lora / 1e6:.2f}M trainable"
    )
    r_gen = torch.Generator().manual_seed(0)

    def zero_grad() -> None:
        for q in params:
            q.grad = None

    def unit() -> None:  # the ordinary NFT step: one forward, one backward into .grad
        terms = forward_terms(model, batch, args.kl)
        loss = (0.5 * terms.loss_pos + 0.5 * terms.loss_neg).mean()
        if args.kl:
            loss = loss + 1e-4 * terms.kl.mean()
        loss.backward()
        zero_grad()

    fns: dict[str, Callable[[], None]] = {"unit": unit}
    for k in args.ks:
        r = torch.rand(k, args.batch, generator=r_gen).to(device)
        for name in ("reference", "two_stream"):
            engine = make_gradient_engine(name, params, k, model)

            def step(engine=engine, r=r) -> None:
                with engine.capture(model):
                    terms = forward_terms(model, batch, args.kl)
                    extra = 1e-4 * terms.kl.mean() if args.kl else None
                    engine.accumulate(terms.loss_pos, terms.loss_neg, r, 1.0 / args.batch, extra_loss=extra)
                zero_grad()  # (reset() and reading the buffers happen once per optimizer step: not timed)

            fns[f"{name}/{k}"] = step

    times, peaks = measure(fns, device, args.warmup, args.repeats)
    unit_t = times["unit"]
    mem = f", peak {peaks['unit']:.2f} GiB" if peaks else ""
    print(f"unit (forward + backward of the NFT loss): median {statistics.median(unit_t) * 1e3:.1f} ms{mem}")

    def ratio(name: str) -> float:  # median over rounds of time / the same round's unit
        return statistics.median(t / u for t, u in zip(times[name], unit_t))

    head = f"{'K':>3} | {'reference / unit':>16} | {'two_stream / unit':>17}"
    if peaks:
        head += f" | {'ref peak GiB':>12} | {'2s peak GiB':>11}"
    print(head)
    print("-" * len(head))
    for k in args.ks:
        line = f"{k:>3} | {ratio(f'reference/{k}'):>15.2f}x | {ratio(f'two_stream/{k}'):>16.2f}x"
        if peaks:
            line += f" | {peaks[f'reference/{k}']:>12.2f} | {peaks[f'two_stream/{k}']:>11.2f}"
        print(line)
    if device.type != "cuda":
        print(
            "peak memory: skipped on CPU (torch's CPU allocator is invisible to tracemalloc and exposes no peak "
            "counter); run with --device cuda to get torch.cuda.max_memory_allocated per engine."
        )


if __name__ == "__main__":
    main()
