"""Memory estimate for SD3.5 Medium training (docs/distributed.md): exact parameter counts, measured activations.

Parameter counts are exact: every model is built on the meta device from its published architecture (SD3.5 Medium's
transformer from METHOD.md section 6; the VAE, CLIP-L, CLIP-G (bigG), T5-XXL encoder and the reward models' CLIPs from
their configs) and the LoRA (r=32 on the eight attention projections) is added with peft and counted.

The models are built by ``marble_trl.preflight.architectures`` (one home for the published configurations, shared with
``marble-trl check``); ``--ship`` writes the measured activations into the package's ``measured_memory.json``.

Activations are measured, not guessed: a real-width (1536, 24 heads) SD3.5-M transformer with 3-4 blocks runs one
forward at 512 px (1024 image tokens + 333 text tokens) with the LoRA trainable and bf16 autocast, and a
``saved_tensors_hooks`` pair records the bytes autograd keeps for the backward (distinct storages, parameters excluded).
Differences between the small models give the bytes of one plain block and of the extra attention of a dual-attention
block; the 24-block total follows. That is what stays alive between the forward and the backward of the trainable
forward; with gradient checkpointing only the block inputs stay, plus one block's activations during its recompute.

    python benchmarks/memory_estimate.py            # ~2 minutes on 2 CPU cores; prints a JSON report and a table
"""

from __future__ import annotations

import argparse
import json

import torch

from marble_trl.preflight.architectures import GIB, REWARD_MODELS, SD35M, architecture_named, count, on_meta


def lora_config(r: int = 32):
    from peft import LoraConfig

    from marble_trl.models import DEFAULT_LORA_TARGETS

    return LoraConfig(r=r, lora_alpha=2 * r, init_lora_weights="gaussian", target_modules=list(DEFAULT_LORA_TARGETS))


def parameter_counts(lora_r: int) -> dict[str, int]:
    """Exact counts of SD3.5 Medium's models and the reward models (marble_trl.preflight.architectures builds them on
    the meta device)."""
    from marble_trl.preflight.architectures import frozen_counts, lora_parameter_count

    arch = architecture_named("SD3.5-Medium")
    transformer = on_meta(arch.build)
    out: dict[str, int] = {"transformer": count(transformer)}
    out["lora"] = lora_parameter_count(transformer, lora_config(lora_r))
    out["lora_layers"] = sum(1 for n, _ in transformer.named_modules() if n.endswith("lora_A.default"))
    counts = frozen_counts(arch)
    out["vae"] = counts.pop("vae")
    out.update(counts)  # clip_l, clip_g, t5_xxl
    for name in ("pickscore", "hpsv2", "clipscore"):
        out[f"reward_{name}"] = count(on_meta(REWARD_MODELS[name]))
    return out


def saved_bytes(num_layers: int, dual: tuple[int, ...], batch: int, checkpointing: bool, lora_r: int) -> int:
    """Bytes autograd saves for the backward of one trainable forward (distinct storages, parameters excluded)."""
    from diffusers import SD3Transformer2DModel

    torch.manual_seed(0)
    config = dict(SD35M, num_layers=num_layers, dual_attention_layers=dual)
    model = SD3Transformer2DModel(**config).to(torch.bfloat16)
    model.requires_grad_(False)
    model.add_adapter(lora_config(lora_r))
    for n, p in model.named_parameters():
        p.requires_grad_("lora_" in n)
    if checkpointing:
        model.enable_gradient_checkpointing()
    model.train()
    param_ptrs = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor):
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr not in param_ptrs and ptr != 0:
            seen[ptr] = max(seen.get(ptr, 0), storage.nbytes())
        return t

    x = torch.randn(batch, 16, 64, 64)
    text = torch.randn(batch, 333, 4096)
    pooled = torch.randn(batch, 2048)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(
            hidden_states=x,
            encoder_hidden_states=text,
            pooled_projections=pooled,
            timestep=torch.full((batch,), 500.0),
            return_dict=False,
        )[0]
    del out
    return sum(seen.values())


def activations(lora_r: int, batch: int) -> dict[str, float]:
    res = {}
    for ckpt in (False, True):
        a = saved_bytes(3, (0,), batch, ckpt, lora_r)  # embed + dual block 0 + plain block 1 + last block
        b = saved_bytes(4, (0,), batch, ckpt, lora_r)  # ... + one more plain block
        c = saved_bytes(4, (0, 1), batch, ckpt, lora_r)  # ... that block with dual attention
        plain, dual_extra = b - a, c - b
        total = a + 21 * plain + 12 * dual_extra  # blocks 2..22 plain, 1..12 dual (0 is already in `a`)
        key = "checkpointing" if ckpt else "no_checkpointing"
        res[key] = {"per_plain_block": plain / batch, "dual_extra": dual_extra / batch, "total": total / batch}
    return res


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lora-r", type=int, default=32)
    parser.add_argument("--batch", type=int, default=1, help="samples in the measured forward (per-sample = / batch)")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--ship", action="store_true", help="write the activations into the package's "
                        "marble_trl/preflight/measured_memory.json (what marble-trl check reads)")  # fmt: skip
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    counts = parameter_counts(args.lora_r)
    acts = activations(args.lora_r, args.batch)
    report = {"params": counts, "activation_bytes_per_sample": acts}
    if args.ship:
        from marble_trl.preflight.measurements import ship

        plain, ckpt = acts["no_checkpointing"], acts["checkpointing"]
        block = plain["per_plain_block"] + plain["dual_extra"]  # the block being recomputed
        ship(
            "SD3.5-Medium",
            {"no_checkpointing": plain["total"], "checkpointing": ckpt["total"] + block,
             "per_block": {"plain": plain["per_plain_block"], "dual_extra": plain["dual_extra"],
                           "checkpointed_inputs": ckpt["total"]}},
            tokens=architecture_named("SD3.5-Medium").tokens(512, 256),
            conditions="512 px (1,024 image tokens) + 77 CLIP + 256 T5 tokens; real-width 3/4-block models",
            source="benchmarks/memory_estimate.py",
        )  # fmt: skip
    print(json.dumps(report, indent=2))
    print("\n| item | params | GiB |\n| --- | --- | --- |")
    for name, n in counts.items():
        if name != "lora_layers":
            print(f"| {name} | {n / 1e6:.1f} M | {2 * n / GIB:.2f} (bf16) |")
    for key, v in acts.items():
        print(f"| activations/sample, {key} | | {v['total'] / GIB:.2f} |")


if __name__ == "__main__":
    main()
