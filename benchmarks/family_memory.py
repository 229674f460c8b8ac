"""Parameter counts and per-GPU memory of each model family's recipe (docs/models.md), as memory_estimate.py does for
SD3.5 Medium: exact counts on the meta device, activations measured.

Counts: every transformer, text encoder and VAE is built on the meta device from its published configuration (the
diffusers classes' defaults are the flagship checkpoints' configs: FLUX.1-dev, Qwen-Image, Wan2.1-T2V-14B, Z-Image;
the text encoders from their config.json values), by ``marble_trl.preflight.architectures`` (shared with
``marble-trl check``), and the LoRA (r=32 on the family's default targets) is added with peft and counted. The static
memory per GPU is ``marble_trl.preflight.memory.estimate_memory`` for the case below (K = 5 reward buffers, no EMA, no
reward models). ``--ship`` writes the measured activations into the package's ``measured_memory.json``.

Activations: a real-width transformer with 1 and 2 blocks (FLUX: also 1 + 2 single-stream blocks) runs one forward
under bf16 autocast with the LoRA trainable; ``saved_tensors_hooks`` record the bytes autograd keeps for the backward.
Their difference is one block; times the block count gives the total. bf16 matmuls are slow on CPUs without native
bf16, so the forward runs on a quarter of the recipe's tokens (512 px images: 256 image + 128 / 32 text tokens; Wan:
one latent frame of nine) and is scaled linearly to the recipe's count: every tensor saved for the backward is linear
in the sequence length with fused attention kernels (flash / memory-efficient attention keep O(N) statistics, not
the N x N matrix). With gradient checkpointing only the block inputs stay (tokens x width x 2 bytes per block),
plus one block during its recompute.

    python benchmarks/family_memory.py             # ~3 minutes on 2 CPU cores; JSON report and a markdown table
"""

from __future__ import annotations

import argparse
import json
import time

import torch

GIB = 1024**3
N_GPUS = 8  # the ZeRO columns: states divided over 8 GPUs


def lora_config(targets, r: int):
    from peft import LoraConfig

    return LoraConfig(r=r, lora_alpha=2 * r, target_modules=list(targets))


# What only the measurement needs, per architecture of marble_trl.preflight.architectures (the constructions, block
# counts, widths, text encoders and VAEs live there): the small models measured, their inputs (a quarter of the recipe's
# tokens, see the docstring), the factor back to the recipe's tokens, and the recipe's tokens
# (Architecture.tokens(resolution, max_sequence_length, num_frames)).
def families():
    from marble_trl.models import FluxAdapter, QwenImageAdapter, WanAdapter, ZImageAdapter
    from marble_trl.preflight.architectures import architecture_named

    measure = {
        "FLUX.1-dev": dict(
            measure_small={"num_layers": 1, "num_single_layers": 1}, targets=FluxAdapter.default_lora_targets,
            inputs=lambda b: dict(hidden_states=torch.randn(b, 256, 64), encoder_hidden_states=torch.randn(b, 128, 4096),
                                  pooled_projections=torch.randn(b, 768), timestep=torch.full((b,), 0.5),
                                  guidance=torch.full((b,), 3.5), img_ids=torch.zeros(256, 3), txt_ids=torch.zeros(128, 3)),
            recipe=(512, 512, None), scale=4.0,
        ),
        "Qwen-Image": dict(
            measure_small={"num_layers": 1}, targets=QwenImageAdapter.default_lora_targets,
            inputs=lambda b: dict(hidden_states=torch.randn(b, 256, 64), encoder_hidden_states=torch.randn(b, 32, 3584),
                                  encoder_hidden_states_mask=None, timestep=torch.full((b,), 0.5),
                                  img_shapes=[[(1, 16, 16)]] * b),
            recipe=(512, 512, None), scale=4.0,
        ),
        "Wan2.1-T2V-14B": dict(
            measure_small={"num_layers": 1}, targets=WanAdapter.default_lora_targets,
            # the recipe: 33 frames of 480 x 480 (9 latent frames of 30 x 30 tokens); measured on 1 latent frame
            inputs=lambda b: dict(hidden_states=torch.randn(b, 16, 1, 60, 60), encoder_hidden_states=torch.randn(b, 512, 4096),
                                  timestep=torch.full((b,), 500.0)),
            recipe=(480, 512, 33), scale=9.0,
        ),
        "Z-Image": dict(
            measure_small={"n_layers": 1}, targets=ZImageAdapter.default_lora_targets,
            inputs=lambda b: dict(x=[torch.randn(16, 1, 32, 32) for _ in range(b)], t=torch.full((b,), 0.5),
                                  cap_feats=[torch.randn(32, 2560) for _ in range(b)]),
            recipe=(512, 512, None), scale=4.0,
        ),
    }  # fmt: skip
    out = {}
    for name, spec in measure.items():
        arch = architecture_named(name)
        out[name] = dict(spec, build=arch.build, blocks=arch.blocks, width=arch.width, text=arch.text_encoders,
                         vae=arch.vae, tokens=arch.tokens(*spec["recipe"]))  # fmt: skip
    return out


def saved_bytes(build, overrides: dict, targets, inputs: dict, r: int) -> int:
    """Bytes autograd saves for one trainable forward (distinct storages, parameters excluded)."""
    torch.manual_seed(0)
    model = build(**overrides).to(torch.bfloat16)
    model.requires_grad_(False)
    model.add_adapter(lora_config(targets, r))
    for n, p in model.named_parameters():
        p.requires_grad_("lora_" in n)
    model.train()
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params and ptr != 0:
            seen[ptr] = max(seen.get(ptr, 0), t.untyped_storage().nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(**inputs, return_dict=False)[0]
    del out, model
    return sum(seen.values())


def activations(spec: dict, r: int) -> dict[str, float]:
    """Per-sample activation bytes of the whole transformer: one block measured as a difference, times the blocks."""
    small, inputs = spec["measure_small"], spec["inputs"](1)
    base = saved_bytes(spec["build"], small, spec["targets"], inputs, r)
    total, per_block = float(base), {}
    for key, n in spec["blocks"].items():
        bigger = dict(small, **{key: small[key] + 1})
        block = saved_bytes(spec["build"], bigger, spec["targets"], inputs, r) - base
        per_block[key] = block * spec["scale"]
        total += (n - small[key]) * block
    blocks = sum(spec["blocks"].values())
    return {
        "no_checkpointing": total * spec["scale"],
        "checkpointing": blocks * spec["tokens"] * spec["width"] * 2 + max(per_block.values()),
        "per_block": per_block,
    }


def estimate(spec: dict, r: int, k: int, measure: bool) -> dict:
    from marble_trl.preflight.architectures import block_parameters, count, lora_parameter_count, on_meta
    from marble_trl.preflight.memory import MemoryInputs, Strategy, estimate_memory

    transformer = on_meta(spec["build"])
    block, root = block_parameters(transformer)
    counts = {
        "transformer": count(transformer),
        "lora": lora_parameter_count(transformer, lora_config(spec["targets"], r)),
    }
    counts.update({name: count(on_meta(make)) for name, make in spec["text"].items()})
    counts["vae"] = count(on_meta(spec["vae"]))
    text = sum(v for n, v in counts.items() if n in spec["text"])

    def static(kind: str) -> float:  # bf16 weights, AdamW, K + 1 MARBLE buffers, no EMA, no reward model
        inputs = MemoryInputs(
            transformer=counts["transformer"],
            block=block,
            root=root,
            lora=counts["lora"],
            text_encoders=text,
            vae=counts["vae"],
            weight_bytes=2,
            strategy=Strategy(kind, N_GPUS),
            micro_batch=0,
            act_plain=None,
            act_checkpointed=None,
            checkpointing=False,
            param_ema=False,
            marble_rows=k + 1,
            moment_bytes=8,
            text_resident=True,
        )
        return estimate_memory(inputs).phases["training"]

    out = {"params": counts, "static_bytes": {kind: static(kind) for kind in ("ddp", "zero2", "zero3")}}
    if measure:
        out["activation_bytes_per_sample"] = activations(spec, r)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lora-r", type=int, default=32)
    parser.add_argument("--rewards", type=int, default=5, help="K: MARBLE's per-reward gradient buffers")
    parser.add_argument("--no-activations", action="store_true", help="counts and static memory only (seconds)")
    parser.add_argument("--only", nargs="*", help="family names to run (default: all)")
    parser.add_argument("--ship", action="store_true", help="write the activations into the package's "
                        "marble_trl/preflight/measured_memory.json (what marble-trl check reads)")  # fmt: skip
    args = parser.parse_args()
    report = {}
    for name, spec in families().items():
        if args.only and name not in args.only:
            continue
        start = time.perf_counter()
        report[name] = estimate(spec, args.lora_r, args.rewards, not args.no_activations)
        report[name]["seconds"] = round(time.perf_counter() - start, 1)
        if args.ship and "activation_bytes_per_sample" in report[name]:
            from marble_trl.preflight.measurements import ship

            spec = families()[name]
            ship(name, report[name]["activation_bytes_per_sample"], spec["tokens"],
                 f"recipe {spec['recipe']} (resolution, max_sequence_length, num_frames); scaled x{spec['scale']}",
                 f"benchmarks/family_memory.py ({report[name]['seconds']} s)")  # fmt: skip
    print(json.dumps(report, indent=2))
    print(
        "\n| model | transformer | LoRA r=32 | text encoders | static DDP / ZeRO-2 / ZeRO-3 (8 GPUs) | activations "
        "per sample, no ckpt / ckpt |\n| --- | --- | --- | --- | --- | --- |"
    )
    for name, r in report.items():
        p, s = r["params"], r["static_bytes"]
        text = " + ".join(f"{n} {v / 1e9:.2f} B" for n, v in p.items() if n not in ("transformer", "lora", "vae"))
        act = r.get("activation_bytes_per_sample")
        acts = f"{act['no_checkpointing'] / GIB:.1f} / {act['checkpointing'] / GIB:.2f} GiB" if act else "n/a"
        print(f"| {name} | {p['transformer'] / 1e9:.2f} B | {p['lora'] / 1e6:.1f} M | {text} | "
              f"{s['ddp'] / GIB:.1f} / {s['zero2'] / GIB:.1f} / {s['zero3'] / GIB:.1f} GiB | {acts} |")  # fmt: skip


if __name__ == "__main__":
    main()
