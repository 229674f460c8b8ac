"""A real-width rehearsal of each family's recipe on CPU: the published transformer configuration at full width with
one block of each kind (SD3.5: two dual-attention blocks), its text encoders at full width with one layer, the
published VAE, saved as a diffusers folder and trained for one optimizer step through ``marble-trl train --config
<the family's recipe>`` at the recipe's resolution, token counts, solver, LoRA targets and MARBLE settings.

It catches what the tiny models' widths hide (dual attention, q/k norms, packed latents, real sequence lengths,
position embeddings at the recipe's resolution) and measures the bytes autograd saves per transformer block at the
recipe's token count (a 2-block minus a 1-block forward, bf16 autocast), printed beside ``benchmarks/family_memory.py``'s
estimate (``benchmarks/results/family_memory.json``, measured on a quarter of the tokens and scaled).

Overrides, listed once: the sizes of the step (groups of 2, one prompt, 2 rollout solver steps, 1 optimizer step),
the rewards (``brightness contrast saturation``: no weights to download; the recipe's number of rewards is kept),
the prompts (the bundled file), CPU and float32. Tokenizers are the tiny offline ones (the embeddings are the real
width, the vocabulary is small); prompts are padded to the recipe's ``max_sequence_length``.

    python benchmarks/real_width_rehearsal.py                         # every family; minutes per family on CPU
    python benchmarks/real_width_rehearsal.py --only flux --resolution-divisor 2
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
REWARDS = ["brightness", "contrast", "saturation"]


def _clip(width: int, projection: int, with_projection: bool):
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    from marble_trl.models.tiny import tiny_clip_tokenizer

    config = CLIPTextConfig(
        hidden_size=width, intermediate_size=4 * width, num_hidden_layers=1, num_attention_heads=width // 64,
        projection_dim=projection, vocab_size=len(tiny_clip_tokenizer()), hidden_act="quick_gelu",
    )  # fmt: skip
    return (CLIPTextModelWithProjection if with_projection else CLIPTextModel)(config)


def _t5(umt5: bool = False):
    from transformers import T5Config, T5EncoderModel, UMT5Config, UMT5EncoderModel

    from marble_trl.models.tiny import tiny_t5_tokenizer

    config_cls, model_cls = (UMT5Config, UMT5EncoderModel) if umt5 else (T5Config, T5EncoderModel)
    config = config_cls(vocab_size=len(tiny_t5_tokenizer()), d_model=4096, d_kv=64, d_ff=10240, num_layers=1,
                        num_heads=64, feed_forward_proj="gated-gelu")  # fmt: skip
    return model_cls(config)


def _sd3_vae():
    from diffusers import AutoencoderKL

    return AutoencoderKL(down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
                         block_out_channels=(128, 256, 512, 512), layers_per_block=2, latent_channels=16,
                         use_quant_conv=False, use_post_quant_conv=False, scaling_factor=1.5305,
                         shift_factor=0.0609)  # fmt: skip


def build_sd35m(blocks: int = 1):
    from diffusers import FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel, StableDiffusion3Pipeline

    from marble_trl.models.tiny import tiny_clip_tokenizer, tiny_t5_tokenizer

    transformer = SD3Transformer2DModel(
        sample_size=128, patch_size=2, in_channels=16, num_layers=blocks + 1, attention_head_dim=64,
        num_attention_heads=24, joint_attention_dim=4096, caption_projection_dim=1536, pooled_projection_dim=2048,
        out_channels=16, pos_embed_max_size=384, dual_attention_layers=tuple(range(blocks)), qk_norm="rms_norm",
    )  # fmt: skip
    return StableDiffusion3Pipeline(
        transformer=transformer, scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0), vae=_sd3_vae(),
        text_encoder=_clip(768, 768, True), tokenizer=tiny_clip_tokenizer(),
        text_encoder_2=_clip(1280, 1280, True), tokenizer_2=tiny_clip_tokenizer(),
        text_encoder_3=_t5(), tokenizer_3=tiny_t5_tokenizer(),
    )  # fmt: skip


def _dynamic_shift_scheduler():
    from diffusers import FlowMatchEulerDiscreteScheduler

    return FlowMatchEulerDiscreteScheduler(shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
                                           base_image_seq_len=256, max_image_seq_len=4096)  # fmt: skip


def build_flux(blocks: int = 1):
    from diffusers import FluxPipeline, FluxTransformer2DModel

    from marble_trl.models.tiny import tiny_clip_tokenizer, tiny_t5_tokenizer

    return FluxPipeline(
        transformer=FluxTransformer2DModel(num_layers=blocks, num_single_layers=blocks, guidance_embeds=True),
        scheduler=_dynamic_shift_scheduler(), vae=_sd3_vae(),
        text_encoder=_clip(768, 768, False), tokenizer=tiny_clip_tokenizer(),
        text_encoder_2=_t5(), tokenizer_2=tiny_t5_tokenizer(),
    )  # fmt: skip


def build_qwen_image(blocks: int = 1):
    from diffusers import AutoencoderKLQwenImage, QwenImagePipeline, QwenImageTransformer2DModel
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    from marble_trl.models.qwen_image import tiny_qwen_tokenizer

    tokenizer = tiny_qwen_tokenizer()
    text = Qwen2_5_VLForConditionalGeneration(Qwen2_5_VLConfig(
        text_config=dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=1, num_attention_heads=28,
                         num_key_value_heads=4, vocab_size=len(tokenizer),
                         rope_scaling={"mrope_section": [16, 24, 24], "rope_type": "default", "type": "default"}),
        vision_config=dict(depth=1, hidden_size=1280, intermediate_size=3420, num_heads=16, out_hidden_size=3584),
        vocab_size=len(tokenizer), hidden_size=3584,
    ))  # fmt: skip
    return QwenImagePipeline(
        transformer=QwenImageTransformer2DModel(num_layers=blocks), scheduler=_dynamic_shift_scheduler(),
        vae=AutoencoderKLQwenImage(), text_encoder=text, tokenizer=tokenizer,
    )  # fmt: skip


def build_z_image(blocks: int = 1):
    from diffusers import ZImagePipeline, ZImageTransformer2DModel
    from transformers import Qwen3Config, Qwen3Model

    from marble_trl.models.qwen_image import tiny_qwen_tokenizer
    from marble_trl.models.z_image import _TINY_CHAT_TEMPLATE

    tokenizer = tiny_qwen_tokenizer()
    tokenizer.chat_template = _TINY_CHAT_TEMPLATE
    text = Qwen3Model(Qwen3Config(vocab_size=len(tokenizer), hidden_size=2560, intermediate_size=9728,
                                  num_hidden_layers=1, num_attention_heads=32, num_key_value_heads=8, head_dim=128))  # fmt: skip
    return ZImagePipeline(
        transformer=ZImageTransformer2DModel(n_layers=blocks, n_refiner_layers=1), scheduler=_dynamic_shift_scheduler(),
        vae=_sd3_vae(), text_encoder=text, tokenizer=tokenizer,
    )  # fmt: skip


def build_wan(blocks: int = 1):
    from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanPipeline, WanTransformer3DModel

    from marble_trl.models.tiny import tiny_t5_tokenizer

    scheduler = UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0)
    return WanPipeline(
        transformer=WanTransformer3DModel(num_layers=blocks), scheduler=scheduler, vae=AutoencoderKLWan(),
        text_encoder=_t5(umt5=True), tokenizer=tiny_t5_tokenizer(),
    )  # fmt: skip


# family -> (builder, recipe, the family_memory.json entry)
FAMILIES = {
    "sd35m": (build_sd35m, "sd35m-marble-5rewards.yaml", None),
    "flux": (build_flux, "flux-marble-3rewards.yaml", "FLUX.1-dev"),
    "qwen-image": (build_qwen_image, "qwen-image-marble-3rewards.yaml", "Qwen-Image"),
    "z-image": (build_z_image, "z-image-marble-3rewards.yaml", "Z-Image"),
    "wan": (build_wan, "wan-marble-video.yaml", "Wan2.1-T2V-14B"),
}


def train_command(folder: Path, recipe: str, out: Path, divisor: int, num_rewards: int) -> list[str]:
    """``marble-trl train`` on the recipe with only the overrides of the module docstring."""
    import yaml

    raw = yaml.safe_load((ROOT / "recipes" / recipe).read_text())
    resolution = raw["resolution"] // divisor
    flags = {
        "model_name_or_path": str(folder), "torch_dtype": "float32", "bf16": "false", "use_cpu": "true",
        "dataset_name": "bundled", "reward_kwargs": "{}", "output_dir": str(out), "max_steps": "1",
        "num_generations": "2", "prompts_per_step": "1", "per_device_train_batch_size": "2",
        "num_sample_steps": "2", "sample_grid_prompts": "0", "report_to": "none", "logging_steps": "1",
        "resolution": str(resolution),
    }  # fmt: skip
    if "dataset_mixture" in raw:
        flags.pop("dataset_name")
        flags["dataset_mixture"] = "bundled"
    cmd = [sys.executable, "-m", "marble_trl.cli", "train", "--config", str(ROOT / "recipes" / recipe)]
    for key, value in flags.items():
        cmd += [f"--{key}", value]
    return cmd + ["--reward_funcs", *REWARDS[:num_rewards]]


def saved_bytes(pipe, resolution: int, max_len: int) -> float:
    """Bytes autograd saves for one forward of the pipeline's transformer at the recipe's token count (bf16 weights
    and autocast, a trainable r=32 LoRA on the family's targets; parameters excluded)."""
    import copy

    from peft import LoraConfig

    from marble_trl.models import adapter_for

    adapter = adapter_for(pipe)
    cond = adapter.encode(["a red apple"], max_len, torch.device("cpu"))
    scheduler = copy.deepcopy(pipe.scheduler)
    with torch.no_grad():
        x = adapter.sample(scheduler, cond, 1, resolution, torch.Generator().manual_seed(0))
    # bf16 weights, as the recipes load them (torch_dtype auto) and as family_memory.py measures: with float32 weights
    # autocast would save a bf16 copy of every weight for the backward, which a bf16 run does not hold
    module = adapter.transformer.to(torch.bfloat16)
    module.add_adapter(LoraConfig(r=32, lora_alpha=64, target_modules=list(adapter.default_lora_targets)))
    params = {p.untyped_storage().data_ptr() for p in module.parameters()}
    seen: dict[int, int] = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params and ptr != 0:
            seen[ptr] = max(seen.get(ptr, 0), t.untyped_storage().nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), torch.autocast("cpu", dtype=torch.bfloat16):
        adapter.predict(module, x, torch.full((x.shape[0],), 0.5), cond)
    return float(sum(seen.values()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--only", nargs="*", choices=list(FAMILIES), help="families to run (default: all)")
    parser.add_argument("--resolution-divisor", type=int, default=1, help="divide the recipes' resolution (CPU time)")
    parser.add_argument("--no-train", action="store_true", help="only build and measure (no CLI step)")
    args = parser.parse_args()
    estimates = {}
    memory_file = ROOT / "benchmarks" / "results" / "family_memory.json"
    if memory_file.is_file():
        estimates = json.loads(memory_file.read_text())
    rows = []
    for name, (build, recipe, memory_key) in FAMILIES.items():
        if args.only and name not in args.only:
            continue
        import yaml

        raw = yaml.safe_load((ROOT / "recipes" / recipe).read_text())
        resolution = raw["resolution"] // args.resolution_divisor
        torch.manual_seed(0)
        start = time.perf_counter()
        pipe = build()
        with tempfile.TemporaryDirectory() as tmp:
            folder = Path(tmp) / "model"
            pipe.save_pretrained(folder)
            status, seconds = "not run", 0.0
            if not args.no_train:
                t0 = time.perf_counter()
                proc = subprocess.run(
                    train_command(folder, recipe, Path(tmp) / "out", args.resolution_divisor, len(raw["reward_funcs"])),
                    capture_output=True, text=True, check=False,
                )  # fmt: skip
                seconds = time.perf_counter() - t0
                status = "trained" if proc.returncode == 0 else f"FAILED: {proc.stderr.strip().splitlines()[-1]}"
        torch.manual_seed(0)
        one = saved_bytes(pipe, resolution, raw["max_sequence_length"])
        del pipe
        torch.manual_seed(0)
        block = saved_bytes(build(2), resolution, raw["max_sequence_length"]) - one  # one more block of each kind
        estimate = (estimates.get(memory_key) or {}).get("activation_bytes_per_sample", {}).get("per_block")
        rows.append((name, recipe, status, seconds, block, estimate))
        print(json.dumps({"family": name, "status": status, "train_seconds": round(seconds, 1),
                          "saved_bytes_per_block": block, "family_memory_per_block": estimate,
                          "seconds": round(time.perf_counter() - start, 1)}), flush=True)  # fmt: skip
    print("\n| family | recipe | one step through the CLI | saved bytes per block, measured (GiB) | family_memory.py "
          "(GiB) |\n| --- | --- | --- | --- | --- |")  # fmt: skip
    for name, recipe, status, seconds, block, estimate in rows:
        est = ", ".join(f"{k} {v / 2**30:.2f}" for k, v in estimate.items()) if estimate else "n/a"
        print(f"| {name} | {recipe} | {status} ({seconds:.0f} s) | {block / 2**30:.2f} | {est} |")


if __name__ == "__main__":
    main()
