"""Parameter counts and per-GPU memory of each model family's recipe (docs/models.md), as memory_estimate.py does for
SD3.5 Medium: exact counts on the meta device, activations measured.

Counts: every transformer, text encoder and VAE is built on the meta device from its published configuration (the
diffusers classes' defaults are the flagship checkpoints' configs: FLUX.1-dev, Qwen-Image, Wan2.1-T2V-14B, Z-Image;
the text encoders from their config.json values, written out below), and the LoRA (r=32 on the family's default
targets) is added with peft and counted.

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


def count(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def lora_params(transformer: torch.nn.Module, targets, r: int) -> int:
    from peft import LoraConfig

    transformer.add_adapter(LoraConfig(r=r, lora_alpha=2 * r, target_modules=list(targets)))
    return sum(p.numel() for n, p in transformer.named_parameters() if "lora_" in n)


def t5_xxl(umt5: bool = False):
    from transformers import T5Config, T5EncoderModel, UMT5Config, UMT5EncoderModel

    config_cls, model_cls = (UMT5Config, UMT5EncoderModel) if umt5 else (T5Config, T5EncoderModel)
    return model_cls(config_cls(vocab_size=256384 if umt5 else 32128, d_model=4096, d_kv=64, d_ff=10240,
                                num_layers=24, num_heads=64, feed_forward_proj="gated-gelu"))  # fmt: skip


def clip_l():
    from transformers import CLIPTextConfig, CLIPTextModel

    return CLIPTextModel(CLIPTextConfig(hidden_size=768, intermediate_size=3072, num_hidden_layers=12,
                                        num_attention_heads=12, hidden_act="quick_gelu"))  # fmt: skip


def flux_vae():
    from diffusers import AutoencoderKL

    return AutoencoderKL(down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
                         block_out_channels=(128, 256, 512, 512), layers_per_block=2, latent_channels=16,
                         use_quant_conv=False, use_post_quant_conv=False)  # fmt: skip


def qwen25_vl_7b():
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    return Qwen2_5_VLForConditionalGeneration(Qwen2_5_VLConfig(
        text_config=dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                         num_key_value_heads=4, vocab_size=152064,
                         rope_scaling={"mrope_section": [16, 24, 24], "rope_type": "default", "type": "default"}),
        vision_config=dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, out_hidden_size=3584),
        vocab_size=152064, hidden_size=3584))  # fmt: skip


def qwen3_4b():
    from transformers import Qwen3Config, Qwen3Model

    return Qwen3Model(Qwen3Config(vocab_size=151936, hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
                                  num_attention_heads=32, num_key_value_heads=8, head_dim=128))  # fmt: skip


# family -> (transformer builder(**overrides), block-count keys, text encoders, VAE, the recipe's token counts)
def families():
    import diffusers

    from marble_trl.models import FluxAdapter, QwenImageAdapter, WanAdapter, ZImageAdapter

    return {
        "FLUX.1-dev": dict(
            build=lambda **o: diffusers.FluxTransformer2DModel(guidance_embeds=True, **o),
            blocks={"num_layers": 19, "num_single_layers": 38}, measure_small={"num_layers": 1, "num_single_layers": 1},
            width=3072, targets=FluxAdapter.default_lora_targets,
            text={"clip_l": clip_l, "t5_xxl": t5_xxl}, vae=flux_vae,
            inputs=lambda b: dict(hidden_states=torch.randn(b, 256, 64), encoder_hidden_states=torch.randn(b, 128, 4096),
                                  pooled_projections=torch.randn(b, 768), timestep=torch.full((b,), 0.5),
                                  guidance=torch.full((b,), 3.5), img_ids=torch.zeros(256, 3), txt_ids=torch.zeros(128, 3)),
            tokens=1024 + 512, scale=4.0,
        ),
        "Qwen-Image": dict(
            build=lambda **o: diffusers.QwenImageTransformer2DModel(**o),
            blocks={"num_layers": 60}, measure_small={"num_layers": 1}, width=3072,
            targets=QwenImageAdapter.default_lora_targets, text={"qwen2.5_vl_7b": qwen25_vl_7b},
            vae=lambda: diffusers.AutoencoderKLQwenImage(),
            inputs=lambda b: dict(hidden_states=torch.randn(b, 256, 64), encoder_hidden_states=torch.randn(b, 32, 3584),
                                  encoder_hidden_states_mask=None, timestep=torch.full((b,), 0.5),
                                  img_shapes=[[(1, 16, 16)]] * b),
            tokens=1024 + 128, scale=4.0,
        ),
        "Wan2.1-T2V-14B": dict(
            build=lambda **o: diffusers.WanTransformer3DModel(**o),
            blocks={"num_layers": 40}, measure_small={"num_layers": 1}, width=5120,
            targets=WanAdapter.default_lora_targets, text={"umt5_xxl": lambda: t5_xxl(umt5=True)},
            vae=lambda: diffusers.AutoencoderKLWan(),
            # the recipe: 33 frames of 480 x 480 (9 latent frames of 30 x 30 tokens); measured on 1 latent frame
            inputs=lambda b: dict(hidden_states=torch.randn(b, 16, 1, 60, 60), encoder_hidden_states=torch.randn(b, 512, 4096),
                                  timestep=torch.full((b,), 500.0)),
            tokens=9 * 30 * 30, scale=9.0,
        ),
        "Z-Image": dict(
            build=lambda **o: diffusers.ZImageTransformer2DModel(**o),
            blocks={"n_layers": 30}, measure_small={"n_layers": 1}, width=3840,
            targets=ZImageAdapter.default_lora_targets, text={"qwen3_4b": qwen3_4b}, vae=flux_vae,
            inputs=lambda b: dict(x=[torch.randn(16, 1, 32, 32) for _ in range(b)], t=torch.full((b,), 0.5),
                                  cap_feats=[torch.randn(32, 2560) for _ in range(b)]),
            tokens=1024 + 128, scale=4.0,
        ),
    }  # fmt: skip


def saved_bytes(build, overrides: dict, targets, inputs: dict, r: int) -> int:
    """Bytes autograd saves for one trainable forward (distinct storages, parameters excluded)."""
    torch.manual_seed(0)
    model = build(**overrides).to(torch.bfloat16)
    model.requires_grad_(False)
    lora_params(model, targets, r)
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
    with torch.device("meta"):
        transformer = spec["build"]()
        counts = {"transformer": count(transformer), "lora": lora_params(transformer, spec["targets"], r)}
        counts.update({name: count(make()) for name, make in spec["text"].items()})
        counts["vae"] = count(spec["vae"]())
    lora = counts["lora"] * 4  # fp32
    frozen = 2 * counts["transformer"]
    text = 2 * sum(v for n, v in counts.items() if n in spec["text"])
    states = 3 * lora  # gradients + AdamW moments
    common = lora * 2 + 2 * counts["vae"] + (k + 1) * lora  # trainable + old-policy adapters, VAE, MARBLE buffers
    static = {
        "ddp": frozen + text + common + states + lora,  # + the DDP gradient bucket
        "zero2": frozen + text + common + states / N_GPUS,
        "zero3": frozen / N_GPUS + text + common + states / N_GPUS,
    }
    out = {"params": counts, "static_bytes": static}
    if measure:
        out["activation_bytes_per_sample"] = activations(spec, r)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lora-r", type=int, default=32)
    parser.add_argument("--rewards", type=int, default=5, help="K: MARBLE's per-reward gradient buffers")
    parser.add_argument("--no-activations", action="store_true", help="counts and static memory only (seconds)")
    parser.add_argument("--only", nargs="*", help="family names to run (default: all)")
    args = parser.parse_args()
    report = {}
    for name, spec in families().items():
        if args.only and name not in args.only:
            continue
        start = time.perf_counter()
        report[name] = estimate(spec, args.lora_r, args.rewards, not args.no_activations)
        report[name]["seconds"] = round(time.perf_counter() - start, 1)
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
