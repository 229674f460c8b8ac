"""Memory estimate for SD3.5 Medium training (docs/distributed.md): exact parameter counts, measured activations.

Parameter counts are exact: every model is built on the meta device from its published architecture (SD3.5 Medium's
transformer from METHOD.md section 6; the VAE, CLIP-L, CLIP-G (bigG), T5-XXL encoder and the reward models' CLIPs from
their configs) and the LoRA (r=32 on the eight attention projections) is added with peft and counted.

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

GIB = 1024**3
SD35M = dict(
    sample_size=128,
    patch_size=2,
    in_channels=16,
    num_layers=24,
    attention_head_dim=64,
    num_attention_heads=24,
    joint_attention_dim=4096,
    caption_projection_dim=1536,
    pooled_projection_dim=2048,
    out_channels=16,
    pos_embed_max_size=384,
    dual_attention_layers=tuple(range(13)),
    qk_norm="rms_norm",
)


def lora_config(r: int = 32):
    from peft import LoraConfig

    from marble_trl.models import DEFAULT_LORA_TARGETS

    return LoraConfig(r=r, lora_alpha=2 * r, init_lora_weights="gaussian", target_modules=list(DEFAULT_LORA_TARGETS))


def count(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def parameter_counts(lora_r: int) -> dict[str, int]:
    from diffusers import AutoencoderKL, SD3Transformer2DModel
    from transformers import (
        CLIPConfig,
        CLIPModel,
        CLIPTextConfig,
        CLIPTextModelWithProjection,
        T5Config,
        T5EncoderModel,
    )

    out: dict[str, int] = {}
    with torch.device("meta"):
        transformer = SD3Transformer2DModel(**SD35M)
        out["transformer"] = count(transformer)
        transformer.add_adapter(lora_config(lora_r))
        out["lora"] = sum(p.numel() for n, p in transformer.named_parameters() if "lora_" in n)
        out["lora_layers"] = sum(1 for n, _ in transformer.named_modules() if n.endswith("lora_A.default"))
        vae = AutoencoderKL(
            in_channels=3,
            out_channels=3,
            down_block_types=("DownEncoderBlock2D",) * 4,
            up_block_types=("UpDecoderBlock2D",) * 4,
            block_out_channels=(128, 256, 512, 512),
            layers_per_block=2,
            latent_channels=16,
            use_quant_conv=False,
            use_post_quant_conv=False,
        )
        out["vae"] = count(vae)
        # SD3.5's text encoders: CLIP ViT-L/14 text tower, OpenCLIP bigG/14 text tower (both with projection), T5-XXL.
        out["clip_l"] = count(
            CLIPTextModelWithProjection(
                CLIPTextConfig(
                    hidden_size=768,
                    intermediate_size=3072,
                    num_hidden_layers=12,
                    num_attention_heads=12,
                    projection_dim=768,
                    hidden_act="quick_gelu",
                )
            )
        )
        out["clip_g"] = count(
            CLIPTextModelWithProjection(
                CLIPTextConfig(
                    hidden_size=1280,
                    intermediate_size=5120,
                    num_hidden_layers=32,
                    num_attention_heads=20,
                    projection_dim=1280,
                    hidden_act="gelu",
                )
            )
        )
        out["t5_xxl"] = count(
            T5EncoderModel(
                T5Config(
                    vocab_size=32128,
                    d_model=4096,
                    d_kv=64,
                    d_ff=10240,
                    num_layers=24,
                    num_heads=64,
                    feed_forward_proj="gated-gelu",
                )
            )
        )

        def clip(text_dim, text_layers, text_heads, vision_dim, vision_layers, vision_heads, proj, patch=14):
            config = CLIPConfig(
                text_config=dict(
                    hidden_size=text_dim,
                    intermediate_size=4 * text_dim,
                    num_hidden_layers=text_layers,
                    num_attention_heads=text_heads,
                ),
                vision_config=dict(
                    hidden_size=vision_dim,
                    intermediate_size=4 * vision_dim,
                    num_hidden_layers=vision_layers,
                    num_attention_heads=vision_heads,
                    patch_size=patch,
                    image_size=224,
                ),
                projection_dim=proj,
            )
            return count(CLIPModel(config))

        # PickScore_v1 and HPSv2.1 are CLIP ViT-H/14 (text 1024x24, vision 1280x32); CLIPScore is CLIP ViT-L/14.
        out["reward_pickscore"] = clip(1024, 24, 16, 1280, 32, 16, 1024)
        out["reward_hpsv2"] = out["reward_pickscore"]
        out["reward_clipscore"] = clip(768, 12, 12, 1024, 24, 16, 768)
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
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    counts = parameter_counts(args.lora_r)
    acts = activations(args.lora_r, args.batch)
    report = {"params": counts, "activation_bytes_per_sample": acts}
    print(json.dumps(report, indent=2))
    print("\n| item | params | GiB |\n| --- | --- | --- |")
    for name, n in counts.items():
        if name != "lora_layers":
            print(f"| {name} | {n / 1e6:.1f} M | {2 * n / GIB:.2f} (bf16) |")
    for key, v in acts.items():
        print(f"| activations/sample, {key} | | {v['total'] / GIB:.2f} |")


if __name__ == "__main__":
    main()
