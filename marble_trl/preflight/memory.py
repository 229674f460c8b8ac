"""Memory per GPU of one training run, item by item (``marble-trl check``; docs/check.md).

The arithmetic of docs/distributed.md ("Memory estimates for SD3.5 Medium") for every family and strategy: frozen
weights in the pipeline's dtype, the two LoRA adapters, the parameter EMA and MARBLE's per-reward gradient buffers
(K + 1 rows) in float32, gradients and optimizer moments (sharded by ZeRO-2/3 and FSDP2), the gradient bucket (DDP's,
or DeepSpeed's reduce bucket), the reward models the recipe puts on the GPU, and the activations of the trainable
forward for the per-device micro-batch (measured per sample: :mod:`.measurements`). Three moments are compared:
training (activations alive), scoring (offloaded reward models visiting) and encoding (offloaded text encoders
visiting); the peak plus :data:`CUDA_RESERVE` is what the GPU must hold.

Not counted: the no-grad forwards of the old policy and the reference (transient), activation gradients during the
backward (about one block), the reward models' own activations, the VAE decode of the rollouts (~0.4 GiB per image at
512 px, before training), rewards whose size is not recorded (named in the report).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

GIB = 1024**3
CUDA_RESERVE = 1.5 * GIB  # CUDA context, cuBLAS/cuDNN workspaces, allocator fragmentation: docs' "+1-2 GiB"
TIGHT = 0.9  # above this share of the GPU the verdict is "tight": a warning
DEEPSPEED_BUCKET = 500_000_000  # DeepSpeed's default reduce_bucket_size (elements)
STRATEGIES = ("single", "ddp", "zero2", "zero3", "fsdp2", "cpu")
STRATEGY_NAMES = {
    "single": "one process",
    "ddp": "DDP",
    "zero2": "DeepSpeed ZeRO-2",
    "zero3": "DeepSpeed ZeRO-3",
    "fsdp2": "FSDP2",
    "cpu": "CPU",
}


@dataclass(frozen=True)
class Strategy:
    """How the run is spread: ``kind`` one of :data:`STRATEGIES`, ``processes`` in all (all machines)."""

    kind: str
    processes: int = 1
    offload_optimizer: bool = False  # ZeRO: optimizer states in CPU RAM
    offload_params: bool = False  # ZeRO-3 / FSDP2: parameter shards in CPU RAM
    source: str = "no accelerate config"

    @property
    def label(self) -> str:
        extra = " + CPU offload" if self.offload_optimizer or self.offload_params else ""
        n = f" x {self.processes}" if self.processes > 1 or self.kind not in ("single", "cpu") else ""
        return f"{STRATEGY_NAMES[self.kind]}{extra}{n}"

    @property
    def shards_states(self) -> bool:
        return self.kind in ("zero2", "zero3", "fsdp2") and self.processes > 1

    @property
    def shards_weights(self) -> bool:
        return self.kind in ("zero3", "fsdp2") and self.processes > 1


def strategy_from_accelerate(config_file: str | None, num_processes: int | None, use_cpu: bool = False) -> Strategy:
    """The strategy of an accelerate config (``recipes/accelerate/*.yaml``, read with accelerate's own loader) and a
    process count (``--num_processes`` overrides the config's). Without a config: one process, or DDP for several
    (what ``accelerate launch --num_processes N`` does by default). FSDP1 is refused as the trainer refuses it."""
    if use_cpu:
        return Strategy("cpu", num_processes or 1, source=config_file or "use_cpu: true")
    if config_file is None:
        n = num_processes or 1
        return Strategy("ddp" if n > 1 else "single", n)
    from accelerate.commands.config.config_args import load_config_from_file
    from accelerate.utils import DistributedType

    config = load_config_from_file(config_file)
    n = int(num_processes or config.num_processes or 1)
    kind = config.distributed_type
    if config.use_cpu:
        return Strategy("cpu", n, source=config_file)
    if kind == DistributedType.DEEPSPEED:
        ds = config.deepspeed_config or {}
        stage = int(ds.get("zero_stage", 2))
        if stage not in (2, 3):
            raise ValueError(f"{config_file}: zero_stage {stage}; the trainer is tested with ZeRO-2 and ZeRO-3.")
        return Strategy(
            f"zero{stage}",
            n,
            offload_optimizer=str(ds.get("offload_optimizer_device", "none")) not in ("none", "None", ""),
            offload_params=stage == 3 and str(ds.get("offload_param_device", "none")) not in ("none", "None", ""),
            source=config_file,
        )
    if kind == DistributedType.FSDP:
        fsdp = config.fsdp_config or {}
        if int(fsdp.get("fsdp_version", 1)) != 2:
            raise ValueError(
                f"{config_file}: FSDP1 (fsdp_version 1) is refused by the trainer (its flat parameters hide the LoRA "
                "weights from the engine); set fsdp_version: 2 (recipes/accelerate/fsdp2.yaml)."
            )
        offload = str(fsdp.get("fsdp_offload_params", False)).lower() == "true"
        return Strategy("fsdp2", n, offload_params=offload, source=config_file)
    if kind in (DistributedType.MULTI_GPU, DistributedType.MULTI_CPU) or n > 1:
        return Strategy("ddp", n, source=config_file)
    return Strategy("single", n, source=config_file)


@dataclass(frozen=True)
class MemoryInputs:
    """What the per-GPU memory depends on. Parameter counts are exact (meta device); ``act_*`` are bytes per sample at
    the run's tokens (``None``: not measured for this architecture)."""

    transformer: int
    block: int  # the largest block (ZeRO-3 / FSDP2 gather it whole)
    root: int  # parameters outside the blocks (FSDP2 keeps them whole)
    lora: int  # the trainable adapter
    text_encoders: int
    vae: int
    weight_bytes: int  # the frozen weights' dtype: 2 (bf16 / fp16) or 4 (fp32)
    strategy: Strategy
    micro_batch: int
    act_plain: float | None
    act_checkpointed: float | None
    checkpointing: bool
    param_ema: bool
    marble_rows: int  # per-reward gradient buffers (K + 1 rows with a balancer, 0 without)
    moment_bytes: int  # optimizer moments per LoRA parameter: 8 (AdamW), 2 (8-bit AdamW), 0 (SGD)
    text_resident: bool  # False: offload_text_encoders / cache_prompt_embeddings
    rewards_resident: int = 0  # bytes of reward models kept on the GPU
    rewards_visiting: int = 0  # bytes of the largest offloaded reward model, on the GPU during its own call
    reward_notes: tuple[str, ...] = ()
    full: int = 0  # use_peft=False: the transformer's trained parameters (``lora`` is then 0)
    layer_gram: bool = False  # marble_gradient_engine='layer_gram': one slice instead of the K + 1 buffers
    guard_copy: bool = True  # max_nonfinite_skips > 0: the guard keeps the last finite state
    per_reward_gradients: bool = False  # a balanced aggregation or log_update_cosines (the trainer's rule)

    def replace(self, **changes) -> MemoryInputs:
        return dataclasses.replace(self, **changes)

    @property
    def activation_per_sample(self) -> float | None:
        return self.act_checkpointed if self.checkpointing else self.act_plain


@dataclass(frozen=True)
class MemoryEstimate:
    rows: tuple[tuple[str, float, str], ...]  # (item, bytes per GPU, how it was computed)
    phases: dict[str, float]  # training / scoring / encoding: bytes at that moment
    activations_known: bool

    @property
    def peak_phase(self) -> str:
        return max(self.phases, key=self.phases.get)

    @property
    def peak(self) -> float:
        return self.phases[self.peak_phase]

    @property
    def need(self) -> float:
        return self.peak + CUDA_RESERVE


def estimate_memory(m: MemoryInputs) -> MemoryEstimate:
    """Bytes per GPU, item by item (docs/distributed.md's table for SD3.5 Medium is this function's output)."""
    s = m.strategy
    n = s.processes
    rows: list[tuple[str, float, str]] = []
    dtype = {2: "bf16", 4: "fp32"}.get(m.weight_bytes, f"{m.weight_bytes} B")
    weights = m.transformer * m.weight_bytes
    fsdp_full = m.full and s.kind == "fsdp2" and n > 1
    if fsdp_full:  # full fine-tuning under FSDP2: the weights and their copies, sharded
        frozen = m.transformer - m.full
        sharded = frozen * m.weight_bytes + 4 * m.full
        rows.append(("transformer weights, sharded (trained ones fp32)", sharded / n, f"{m.transformer / 1e6:,.1f} "
                     f"M params ({m.full / 1e6:,.1f} M trained) / {n}"))  # fmt: skip
        rows.append(("units outside the blocks, kept gathered (fp32)", 4 * m.root, f"{m.root / 1e6:,.1f} M params"))
        rows.append(("blocks being gathered (2, fp32), and their gradients before the reduce-scatter",
                     2 * m.block * 8, f"2 x {m.block / 1e6:,.1f} M params x (4 + 4) B"))  # fmt: skip
        rows.append((f"reference: the loaded trained weights ({dtype}), sharded", m.full * m.weight_bytes / n,
                     f"/ {n}"))  # fmt: skip
        rows.append(("old policy (fp32 copy), sharded", 4 * m.full / n, f"one fp32 copy / {n}"))
        rows.append(("the trained shards set aside during a swap", 4 * m.full / n, f"one fp32 copy / {n}"))
        if m.guard_copy:  # one process / DDP: in host memory, not counted
            rows.append(("non-finite guard's last finite weights + moments, sharded", 12 * m.full / n,
                         f"12 B x params / {n} (max_nonfinite_skips 0: none)"))  # fmt: skip
    elif m.full and s.kind in ("zero2", "zero3"):  # full fine-tuning under DeepSpeed: it casts the whole module
        part = n if s.kind == "zero3" and n > 1 else 1  # ZeRO-3 partitions the weights and the copies
        cut, of = (", partitioned", f" / {n}") if part > 1 else ("", "")
        rows.append((f"transformer weights ({dtype}, DeepSpeed casts the module){cut}", weights / part,
                     f"{m.transformer / 1e6:,.1f} M params{of}"))  # fmt: skip
        if part > 1:
            rows.append(("blocks being gathered (2)", 2 * m.block * m.weight_bytes, f"2 x {m.block / 1e6:,.1f} M"))
        rows.append(("trained weights' fp32 masters (DeepSpeed's optimizer), partitioned", 4 * m.full / n,
                     f"{m.full / 1e6:,.1f} M params x 4 B / {n}"))  # fmt: skip
        rows.append((f"reference: the loaded trained weights ({dtype}){cut}", m.full * m.weight_bytes / part, "as "
                     f"loaded{of}"))  # fmt: skip
        rows.append((f"old policy (fp32 copy){cut}", 4 * m.full / part, f"one fp32 copy{of}"))
        if part > 1:
            rows.append(("the trained partitions set aside during a swap", m.full * m.weight_bytes / n, f"/ {n}"))
        elif m.weight_bytes != 4:
            rows.append((f"old policy rounded to {dtype} for its forwards", m.full * m.weight_bytes, "while swapped"))
    elif s.shards_weights:
        kept = 0 if s.offload_params else weights / n
        rows.append((f"transformer weights ({dtype}), sharded", kept, f"{m.transformer / 1e6:,.1f} M params / {n}"))
        if s.kind == "fsdp2":
            rows.append(
                ("transformer root unit, kept whole", m.root * m.weight_bytes, f"{m.root / 1e6:,.1f} M params")
            )
        rows.append(("blocks being gathered (2)", 2 * m.block * m.weight_bytes, f"2 x {m.block / 1e6:,.1f} M params"))
    elif m.full:  # full fine-tuning, one process or DDP: the trained weights become float32 copies
        frozen = m.transformer - m.full
        if frozen:
            rows.append(
                (f"frozen transformer weights ({dtype})", frozen * m.weight_bytes, f"{frozen / 1e6:,.1f} M params")
            )
        rows.append(("trained weights (fp32)", 4 * m.full, f"{m.full / 1e6:,.1f} M params x 4 B"))
        rows.append((f"reference: the loaded trained weights ({dtype})", m.full * m.weight_bytes, "kept as loaded"))
        rows.append(("old policy (fp32 copy)", 4 * m.full, "one fp32 copy of the trained weights"))
    else:
        rows.append((f"transformer weights ({dtype})", weights, f"{m.transformer / 1e6:,.1f} M params"))
    what = "trained weights" if m.full else "LoRA"
    trained = m.full or m.lora
    lora = 4 * trained
    if not m.full:
        adapters = 2 * lora / (n if s.kind == "fsdp2" and n > 1 else 1)
        rows.append(
            ("LoRA: trainable + old-policy adapters (fp32)", adapters, f"2 x {m.lora / 1e6:,.2f} M params x 4 B")
        )
    states = trained * (4 + m.moment_bytes) / (n if s.shards_states else 1)
    if s.offload_optimizer:
        states = trained * 4 / (n if s.shards_states else 1)  # the gradients; moments in CPU RAM
    shard = f" / {n}" if s.shards_states else ""
    label = "trained weights: gradients + optimizer moments" if m.full else "LoRA gradients + optimizer moments"
    rows.append((label, states, f"(4 + {m.moment_bytes}) B x params{shard}"))
    if m.full and s.kind in ("zero2", "zero3"):  # DeepSpeed's reduce buckets, not a whole gradient
        bucket = min(trained, DEEPSPEED_BUCKET) * m.weight_bytes
        rows.append(("gradient bucket (DeepSpeed reduce)", bucket, f"reduce_bucket_size {DEEPSPEED_BUCKET:.0e} x "
                     f"{m.weight_bytes} B"))  # fmt: skip
    elif (s.kind == "ddp" and n > 1) or s.kind in ("zero2", "zero3"):
        rows.append(("gradient bucket (DDP / DeepSpeed reduce)", lora, f"one fp32 copy of the {what} gradients"))
    if m.param_ema:
        # full fine-tuning under FSDP2 / ZeRO-3: this process's shards
        ema_shards = fsdp_full or (m.full and s.kind == "zero3" and n > 1)
        rows.append(("parameter EMA (fp32)" + (", sharded" if ema_shards else ""), lora / (n if ema_shards else 1),
                     f"one fp32 copy of the {what}" + (f" / {n}" if ema_shards else "")))  # fmt: skip
    if m.marble_rows and m.layer_gram:
        from ..balance.layer_gram import SLICE_ELEMENTS

        rows.append(("MARBLE layer_gram: one slice of K rows", 4 * SLICE_ELEMENTS, f"{SLICE_ELEMENTS:,} x 4 B, any K"))
    elif m.marble_rows:
        rows.append(
            ("MARBLE per-reward gradient buffers", m.marble_rows * lora, f"(K + 1) = {m.marble_rows} x {what}")
        )
    rows.append((f"VAE ({dtype})", m.vae * m.weight_bytes, f"{m.vae / 1e6:,.1f} M params"))
    text = m.text_encoders * m.weight_bytes
    if m.text_resident:
        rows.append((f"text encoders ({dtype})", text, f"{m.text_encoders / 1e6:,.1f} M params"))
    if m.rewards_resident:
        rows.append(("reward models on the GPU", m.rewards_resident, ", ".join(m.reward_notes) or "known sizes"))
    base = sum(b for _, b, _ in rows)
    act = m.activation_per_sample
    phases = {"training": base}
    if act is not None:
        how = "checkpointed" if m.checkpointing else "no checkpointing"
        samples = m.micro_batch * (2 if m.marble_rows and m.layer_gram else 1)  # layer_gram: forward on it twice
        twice = ", twice: layer_gram's solved pairs" if samples > m.micro_batch else ""
        rows.append(
            (f"activations, micro-batch {m.micro_batch} ({how}{twice})", act * samples, f"{act / GIB:.3f} GiB/sample")
        )
        phases["training"] = base + act * samples
    if m.rewards_visiting:
        phases["scoring"] = base + m.rewards_visiting
    if not m.text_resident:
        phases["encoding"] = base + text
    return MemoryEstimate(tuple(rows), phases, act is not None)


def verdict(estimate: MemoryEstimate, capacity: float | None) -> str:
    """``fits``, ``tight`` (over :data:`TIGHT` of the GPU), ``does not fit``, or ``unknown`` without a capacity."""
    if capacity is None:
        return "unknown"
    if estimate.need > capacity:
        return "does not fit"
    return "tight" if estimate.need > TIGHT * capacity else "fits"


def parse_size(text: str) -> float:
    """``80GB``, ``80G``, ``80GiB``, ``80`` -> bytes. GPU memory is sold in binary units ("80 GB" H100s hold 80 GiB),
    so GB and GiB both mean GiB here."""
    raw = str(text).strip().lower().replace(" ", "")
    for suffix in ("gib", "gb", "g"):
        if raw.endswith(suffix):
            raw = raw[: -len(suffix)]
            break
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"--gpu_memory {text!r}: give the GPU's memory like 80GB or 24GiB.") from None
    if value <= 0:
        raise ValueError(f"--gpu_memory {text!r} must be positive.")
    return value * GIB


def table_lines(estimate: MemoryEstimate, capacity: float | None) -> list[str]:
    """The breakdown as a Markdown table (GiB per GPU), then the moments and the verdict."""
    lines = ["| item | GiB per GPU | how |", "| --- | ---: | --- |"]
    for item, size, how in estimate.rows:
        lines.append(f"| {item} | {size / GIB:.2f} | {how} |")
    for phase, size in estimate.phases.items():
        mark = " (peak)" if phase == estimate.peak_phase and len(estimate.phases) > 1 else ""
        lines.append(f"| **{phase}**{mark} | **{size / GIB:.2f}** | {_PHASES[phase]} |")
    lines.append(f"| CUDA context, workspaces, fragmentation | {CUDA_RESERVE / GIB:.2f} | docs' +1-2 GiB |")
    cap = f" of {capacity / GIB:.0f} GiB" if capacity else ""
    lines.append(f"| **needed** | **{estimate.need / GIB:.2f}** | {verdict(estimate, capacity)}{cap} |")
    return lines


_PHASES = {
    "training": "every item above (activations alive)",
    "scoring": "without activations, the largest offloaded reward model visiting (one at a time)",
    "encoding": "without activations, the offloaded text encoders visiting",
}
